"""Terminal tables that fit the width they are drawn at, and the compact number formats they show.

Every table command builds a :class:`FitTable` from column specs (:class:`Col`): keys, ids and
numbers are never cut (an 80-column terminal shows fewer columns instead), low-priority columns
are left out until the table fits, and text columns wrap. ``--wide`` shows every column at its
full width, however wide that is (print it with ``crop=False``: see :func:`print_table`). The
choice is made when the table is drawn, so a live display follows a resized terminal.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

Kind = Literal["text", "key", "num"]


@dataclass(frozen=True)
class Col:
    """One column. ``kind``: ``key`` (a key, an id, a name, a state, a time: never cut, never
    wrapped while the table can fit), ``num`` (the same, right-aligned), ``text`` (wraps at the
    width it is given, never narrower than ``min_width``). ``drop``: 0, always shown; else the
    higher, the sooner it is left out when the width is short (ties: the rightmost first)."""

    header: str
    kind: Kind = "text"
    drop: int = 0
    min_width: int = 12


_TEXT_FLOOR = 8  # the narrowest a text column wraps to when nothing else gives
_BORDER = 3  # each column's padding (one space each side) and its border; the table's own edge: 1


def _width(cell: Text) -> int:
    return max((line.cell_len for line in cell.split("\n")), default=0)


class FitTable:
    """A rich table of :class:`Col` columns that chooses at draw time which columns fit."""

    def __init__(self, cols: Sequence[Col], *, title: str | None = None, wide: bool = False,
                 hint: str | None = "--wide", title_style: str | None = None, table_box: box.Box = box.HEAVY_HEAD,
                 caption: str | None = None) -> None:
        """``hint``: how to see the columns left out (said in the caption; None: say nothing)."""
        self.cols = list(cols)
        self.title, self.title_style, self.caption = title, title_style, caption
        self.wide, self.hint, self.box = wide, hint, table_box
        self.rows: list[list[Text] | None] = []  # None: a section line

    def add_row(self, *cells: str | Text) -> None:
        """Cells as rich markup (escape what a user wrote) or Text, one per column."""
        if len(cells) != len(self.cols):
            raise ValueError(f"{len(cells)} cells for {len(self.cols)} columns")
        # (no emoji codes: a key "a:smile:b" is shown as it is)
        self.rows.append([c.copy() if isinstance(c, Text) else Text.from_markup(c, emoji=False) for c in cells])

    def add_section(self) -> None:
        self.rows.append(None)

    # -- choosing the columns

    def _cells(self, i: int) -> Iterable[Text]:
        return (row[i] for row in self.rows if row is not None)

    def _needs(self) -> list[tuple[int, int]]:
        """Per column: (the narrowest it may be, its width with nothing wrapped)."""
        out = []
        for i, col in enumerate(self.cols):
            cells = max((_width(c) for c in self._cells(i)), default=0)
            word = max((len(w) for w in col.header.split()), default=0)
            full = max(cells, len(col.header))
            if col.kind == "text":  # it wraps between words: a word (a name, a path) is cut only if it must be
                words = max((len(w) for c in self._cells(i) for w in c.plain.split()), default=0)
                out.append((min(full, max(col.min_width, word, words)), full))
            else:  # its header may wrap between words, never its cells
                out.append((max(cells, word), full))
        return out

    def layout(self, width: int) -> tuple[list[int], list[int], bool]:
        """The columns shown at ``width``, the width of each (a text column's: the narrowest it
        wraps to, rich gives it what is left), and whether even those are too wide (squeezed)."""
        needs = self._needs()
        shown = list(range(len(self.cols)))
        if self.wide:
            return shown, [needs[i][1] for i in shown], False

        def narrowest(cols: list[int]) -> int:
            return sum(needs[i][0] for i in cols) + _BORDER * len(cols) + 1

        while narrowest(shown) > width:
            droppable = [i for i in shown if self.cols[i].drop]
            if not droppable:
                break
            shown.remove(max(droppable, key=lambda i: (self.cols[i].drop, i)))
        if narrowest(shown) > width:  # text wraps narrower than it likes before a key has to
            needs = [(min(n[0], _TEXT_FLOOR), n[1]) if c.kind == "text" else n
                     for c, n in zip(self.cols, needs, strict=True)]
        widths = [needs[i][0] for i in shown]
        slack = width - narrowest(shown)
        # what is left unwraps headers, those that need least first; rich gives the rest to text
        for n in sorted(range(len(shown)), key=lambda n: needs[shown[n]][1] - widths[n]):
            grow = needs[shown[n]][1] - widths[n]
            if self.cols[shown[n]].kind != "text" and 0 < grow <= slack:
                slack -= grow
                widths[n] += grow
        return shown, widths, slack < 0

    def table(self, width: int) -> Table:
        """The rich table as drawn at ``width``."""
        shown, widths, squeezed = self.layout(width)
        caption = self.caption
        left_out = len(self.cols) - len(shown)
        if left_out and self.hint:
            more = f"{left_out} more column{'s' if left_out > 1 else ''} with {self.hint}"
            caption = f"{caption}; {more}" if caption else more
        table = Table(title=self.title, title_justify="left", title_style=self.title_style, box=self.box,
                      caption=caption, caption_justify="left", caption_style="dim")
        for i, w in zip(shown, widths, strict=True):
            col = self.cols[i]
            justify: Literal["left", "right"] = "right" if col.kind == "num" else "left"
            if col.kind == "text" or (squeezed and col.kind == "key"):
                # squeezed: too narrow even for the columns that are never left out; numbers keep
                # their width, and rich wraps the widest of the rest first (never an ellipsis)
                table.add_column(col.header, overflow="fold", min_width=None if squeezed else w, justify=justify)
            else:
                table.add_column(col.header, width=w, overflow="fold", justify=justify)
        for row in self.rows:
            if row is None:
                table.add_section()
            else:
                table.add_row(*(row[i] for i in shown))
        return table

    # -- rich's protocol

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = self.table(options.max_width)
        if self.wide:
            natural = Measurement.get(console, options.update_width(1 << 16), table).maximum
            options = options.update_width(max(options.max_width, natural))
        yield from _trimmed(console.render(table, options))

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        needs = self._needs()
        return Measurement(sum(n[0] for n in needs) + _BORDER * len(needs) + 1,
                           sum(n[1] for n in needs) + _BORDER * len(needs) + 1)


def _trimmed(segments: Iterable[Segment]) -> Iterator[Segment]:
    """The lines of ``segments`` without the spaces rich pads them with to the table's width (a
    title, a caption, a row of a box without edges): a copied or piped table has no trailing blanks."""
    for line in Segment.split_lines(segments):
        while line and not line[-1].control and not line[-1].text.rstrip(" "):
            line.pop()
        if line and not line[-1].control:
            line[-1] = Segment(line[-1].text.rstrip(" "), line[-1].style)
        yield from line
        yield Segment.line()


def print_table(console: Console, renderable: RenderableType, *, wide: bool = False) -> None:
    """Print a table (or a group of them): ``wide`` lines are kept whole, not cut at the width."""
    console.print(renderable, crop=not wide)


# -- number formats


def fmt_secs(value: Any) -> str:
    """Seconds as a short duration: 850ms, 4.2s, 12m03s, 3h05m, 2d04h."""
    if value is None:
        return "—"
    s = float(value)
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 1:
        return f"{sign}{s * 1000:.0f}ms"
    if s < 10:
        return f"{sign}{s:.1f}s".replace(".0s", "s")
    if s < 60:
        return f"{sign}{s:.0f}s"
    if s < 3600:
        return f"{sign}{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{sign}{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{sign}{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def fmt_num(value: Any) -> str:
    """A count in at most three digits and a unit: 950, 1.2k, 12.5k, 195k, 3.4M, 12G."""
    if value is None:
        return "—"
    v = float(value)
    if abs(v) < 999.5:
        return f"{v:.0f}" if v == int(v) else f"{v:.1f}"
    for limit, suffix in ((1e3, "k"), (1e6, "M"), (1e9, "G")):
        scaled = v / limit
        text = f"{scaled:.0f}" if abs(scaled) >= 99.95 else f"{scaled:.1f}".removesuffix(".0")
        if abs(float(text)) < 1000 or suffix == "G":
            break
    return text + suffix


def fmt_cost(value: Any) -> str:
    """US dollars in a few digits: $0, $0.0038, $0.55, $12.40, $1,235."""
    if value is None:
        return "—"
    v = float(value)
    if v == 0:
        return "$0"
    if abs(v) >= 1000:
        return f"${v:,.0f}"
    if abs(v) >= 0.01:
        return f"${v:.2f}"
    return f"${v:.4f}"


def fmt_share(value: Any) -> str:
    return "—" if value is None else f"{float(value) * 100:.1f}%"


def human_bytes(n: int | float | None) -> str:
    """1536 → "1.5 KiB"."""
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
