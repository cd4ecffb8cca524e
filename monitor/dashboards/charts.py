"""The report's charts: SVG drawn here (a :class:`Plot` per chart: frame, axes, legend), so the
report needs nothing from the network."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from monitor.dashboards.reads import ReportData, bucket_floor, nice_step
from worker.tables import fmt_num, fmt_secs

PALETTE = ["#2f6fd0", "#e0712c", "#2a9d5b", "#c23b5a", "#8a5cc9", "#9a7b1d", "#1f9eb0", "#d14fa8",
           "#5f6b7a", "#6aa12b"]
TOKEN_COLORS = {"input_tokens": "#2f6fd0", "cache_creation_tokens": "#e0a030",
                "cache_read_tokens": "#7fb8e6", "output_tokens": "#2a9d5b"}
TOKEN_LABELS = {"input_tokens": "input (fresh)", "cache_creation_tokens": "cache write",
                "cache_read_tokens": "cache read", "output_tokens": "output"}

W, H = 920, 280
ML, MR, MT, MB = 64, 64, 16, 46  # margins: left, right, top, bottom


def html_escape(value: Any) -> str:
    """``value`` as HTML text or attribute value."""
    return html.escape(str(value), quote=True)


def utc_iso(t: datetime) -> str:
    """``t`` as ISO 8601 in UTC, to the second (``2025-01-31T12:00:00Z``)."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def nice_ticks(value: float, *, integer: bool = False, most: int = 5) -> tuple[float, float]:
    """(top, step): a round tick step and the axis top, a whole number of steps above ``value``
    (steps of 1, 2 or 5 times a power of ten; whole numbers for counts)."""
    value = max(value, 1e-9)
    raw = value / most
    exp = 10.0 ** math.floor(math.log10(raw))
    step = next(m * exp for m in (1, 2, 2.5, 5, 10) if m * exp >= raw)
    if integer:
        step = max(1.0, math.ceil(step))
    return math.ceil(value / step - 1e-9) * step, step


def _num(v: float) -> str:
    return fmt_num(v) if abs(v) >= 1000 or v == int(v) else f"{v:.2g}"


def _time_label(t: datetime, span: float) -> str:
    t = t.astimezone(UTC)
    if span <= 3 * 3600:
        return t.strftime("%H:%M:%S") if span < 600 else t.strftime("%H:%M")
    if span <= 3 * 86400:
        return t.strftime("%m-%d %H:%M")
    return t.strftime("%m-%d")


class Plot:
    """One SVG chart: a frame, a y axis from 0, a time or category x axis, and a legend."""

    def __init__(self, chart: str, y_max: float, *, y_label: str = "", y2_max: float | None = None,
                 y2_label: str = "", integer: bool = True) -> None:
        self.chart = chart
        self.y_max, self.y_step = nice_ticks(y_max, integer=integer)
        self.y2_max: float | None = None
        if y2_max is not None:  # the same gridlines, with round steps of their own
            n = round(self.y_max / self.y_step)
            raw = max(y2_max, 1e-9) / n
            exp = 10.0 ** math.floor(math.log10(raw))
            self.y2_max = n * next(m * exp for m in (1, 2, 2.5, 5, 10) if m * exp >= raw)
        self.y_label, self.y2_label = y_label, y2_label
        self.body: list[str] = []
        self.legend: list[tuple[str, str, str]] = []  # (series, label, color)

    # geometry
    @property
    def plot_w(self) -> float:
        return W - ML - MR

    @property
    def plot_h(self) -> float:
        return H - MT - MB

    def y(self, v: float) -> float:
        return MT + self.plot_h * (1 - v / self.y_max)

    def y2(self, v: float) -> float:
        assert self.y2_max is not None
        return MT + self.plot_h * (1 - v / self.y2_max)

    def axes(self, x_ticks: Sequence[tuple[float, str]]) -> str:
        out = [f'<rect x="{ML}" y="{MT}" width="{self.plot_w:.1f}" height="{self.plot_h:.1f}" class="frame"/>']
        n = round(self.y_max / self.y_step)
        for i in range(n + 1):
            v = self.y_step * i
            yy = self.y(v)
            out.append(f'<line x1="{ML}" x2="{W - MR}" y1="{yy:.1f}" y2="{yy:.1f}" class="grid"/>')
            out.append(f'<text x="{ML - 6}" y="{yy + 4:.1f}" class="tick" text-anchor="end">{html_escape(_num(v))}</text>')
            if self.y2_max is not None:
                v2 = self.y2_max * i / n
                out.append(f'<text x="{W - MR + 6}" y="{yy + 4:.1f}" class="tick y2">{html_escape(f"${v2:.4g}")}</text>')
        for x, label in x_ticks:
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MT + self.plot_h:.1f}" y2="{MT + self.plot_h + 4:.1f}" class="axis"/>')
            out.append(f'<text x="{x:.1f}" y="{MT + self.plot_h + 18:.1f}" class="tick" text-anchor="middle">{html_escape(label)}</text>')
        if self.y_label:
            out.append(f'<text x="14" y="{MT + self.plot_h / 2:.1f}" class="axis-label" '
                       f'transform="rotate(-90 14 {MT + self.plot_h / 2:.1f})" text-anchor="middle">{html_escape(self.y_label)}</text>')
        if self.y2_label:
            x2 = W - 10
            out.append(f'<text x="{x2}" y="{MT + self.plot_h / 2:.1f}" class="axis-label y2" '
                       f'transform="rotate(90 {x2} {MT + self.plot_h / 2:.1f})" text-anchor="middle">{html_escape(self.y2_label)}</text>')
        return "".join(out)

    def svg(self, x_ticks: Sequence[tuple[float, str]], title: str) -> str:
        legend = "".join(
            f'<span class="legend-item" data-series="{html_escape(s)}"><i style="background:{c}"></i>{html_escape(label)}</span>'
            for s, label, c in self.legend)
        return (f'<figure class="chart" data-chart="{html_escape(self.chart)}"><figcaption>{html_escape(title)}</figcaption>'
                f'<div class="legend">{legend}</div>'
                f'<svg class="chart-svg" data-chart="{html_escape(self.chart)}" viewBox="0 0 {W} {H}" '
                f'width="100%" role="img" aria-label="{html_escape(title)}" xmlns="http://www.w3.org/2000/svg">'
                f'{self.axes(x_ticks)}{"".join(self.body)}</svg></figure>')


def _time_axis(start: datetime, end: datetime) -> tuple[Any, list[tuple[float, str]]]:
    t0, t1 = start.timestamp(), max(end.timestamp(), start.timestamp() + 1)
    span = t1 - t0

    def x(t: datetime) -> float:
        return ML + (W - ML - MR) * (t.timestamp() - t0) / span

    step = nice_step(span, 6)
    first = math.ceil(t0 / step) * step
    ticks = []
    k = first
    while k <= t1:
        when = datetime.fromtimestamp(k, tz=UTC)
        ticks.append((x(when), _time_label(when, span)))
        k += step
    return x, ticks


def chart_queue(d: ReportData) -> str:
    """Queue depth (solid) and running (dashed) per lane over time."""
    peak = max([max(q, run) for pts in d.depth.values() for _, q, run in pts] + [1])
    p = Plot("queue", peak, y_label="tasks")
    first = min((pts[0][0] for pts in d.depth.values()), default=d.start)
    x, ticks = _time_axis(first, d.now)
    for i, (name, pts) in enumerate(sorted(d.depth.items())):
        color = PALETTE[i % len(PALETTE)]
        for kind, idx, dash in (("queued", 1, ""), ("running", 2, ' stroke-dasharray="5 3"')):
            values = [(t, q if idx == 1 else run) for t, q, run in pts]
            coords = " ".join(f"{x(t):.1f},{p.y(v):.1f}" for t, v in values)
            p.body.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.8"{dash} '
                          f'data-series="{html_escape(name)}" data-kind="{kind}"/>')
            for t, v in values:
                p.body.append(f'<circle cx="{x(t):.1f}" cy="{p.y(v):.1f}" r="1.6" fill="{color}" '
                              f'data-series="{html_escape(name)}" data-kind="{kind}" data-t="{utc_iso(t)}" data-v="{v}">'
                              f'<title>{html_escape(name)} {kind} at {utc_iso(t)}: {v}</title></circle>')
        last = pts[-1]
        p.body.append(f'<text x="{x(last[0]) - 4:.1f}" y="{p.y(last[1]) - 5:.1f}" class="end-label" '
                      f'text-anchor="end" fill="{color}" data-series="{html_escape(name)}" data-end="queued">{last[1]}</text>')
        p.legend.append((name, f"{name}: queued ━ running ╌", color))
    return p.svg(ticks, "Queue depth (solid) and running (dashed) per lane — from the journal")


def _stacked_bars(p: Plot, x: Any, buckets: Sequence[datetime], step: int,
                  stacks: dict[datetime, dict[str, int]], names: list[str], colors: dict[str, str],
                  kind: str) -> None:
    width = max(1.0, (x(buckets[0] + timedelta(seconds=step)) - x(buckets[0])) * 0.8) if buckets else 1.0
    for b in buckets:
        base = 0
        for name in names:
            v = stacks.get(b, {}).get(name, 0)
            if not v:
                continue
            y0, y1 = p.y(base), p.y(base + v)
            p.body.append(f'<rect x="{x(b) + width * 0.1:.1f}" y="{y1:.1f}" width="{width:.1f}" '
                          f'height="{max(y0 - y1, 0.5):.1f}" fill="{colors[name]}" data-series="{html_escape(name)}" '
                          f'data-kind="{kind}" data-t="{utc_iso(b)}" data-v="{v}">'
                          f'<title>{html_escape(name)} {utc_iso(b)}: {v} {kind}</title></rect>')
            base += v


def chart_throughput(d: ReportData) -> str:
    names = sorted({n for per in d.throughput.values() for n in per if per[n]})
    colors = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(sorted(set(names) | set(d.depth)))}
    peak = max([sum(per.values()) for per in d.throughput.values()] + [1])
    p = Plot("throughput", peak, y_label=f"completed per {fmt_secs(d.bar_step)}")
    buckets = sorted(d.throughput)
    origin = bucket_floor(d.start, d.bar_step)
    x, ticks = _time_axis(origin, d.now + timedelta(seconds=d.bar_step))
    _stacked_bars(p, x, buckets, d.bar_step, d.throughput, names, colors, "completed")
    total = {n: sum(per.get(n, 0) for per in d.throughput.values()) for n in names}
    for n in names:
        p.legend.append((n, f"{n}: {total[n]}", colors[n]))
    return p.svg(ticks, f"Throughput per lane — tasks (or stages) completed per {fmt_secs(d.bar_step)}")


def histogram_bins(values: list[float], n: int = 16) -> list[tuple[float, float, int]]:
    """Bins over the values: log-spaced when they span more than a decade, else even."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [(lo, hi, len(values))]
    if lo > 0 and hi / lo > 10:
        edges = [lo * (hi / lo) ** (i / n) for i in range(n + 1)]
    else:
        edges = [lo + (hi - lo) * i / n for i in range(n + 1)]
    counts = [0] * n
    for v in values:
        i = min(int(next((k for k in range(n) if v < edges[k + 1]), n - 1)), n - 1)
        counts[i] += 1
    return [(edges[i], edges[i + 1], counts[i]) for i in range(n)]


def _percentile(values: list[float], q: float) -> float | None:
    """percentile_cont, as the views compute it."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def chart_wallclock(d: ReportData) -> str:
    values = [v for vs in d.wallclock.values() for v in vs]
    bins = histogram_bins(values)
    p = Plot("wallclock", max([c for _, _, c in bins] + [1]), y_label="stages completed")
    n = max(len(bins), 1)
    bw = p.plot_w / n
    ticks = []
    for i, (lo, hi, c) in enumerate(bins):
        x0 = ML + i * bw
        if c:
            p.body.append(f'<rect x="{x0 + 1:.1f}" y="{p.y(c):.1f}" width="{bw - 2:.1f}" '
                          f'height="{p.y(0) - p.y(c):.1f}" fill="#2f6fd0" data-series="stages" '
                          f'data-lo="{lo:.3f}" data-hi="{hi:.3f}" data-v="{c}">'
                          f'<title>{fmt_secs(lo)} – {fmt_secs(hi)}: {c}</title></rect>')
        if i % max(1, n // 8) == 0:
            ticks.append((x0, fmt_secs(lo)))
    if bins:
        ticks.append((ML + n * bw, fmt_secs(bins[-1][1])))
        for name, q, color in (("p50", 0.5, "#2a9d5b"), ("p95", 0.95, "#c23b5a")):
            v = _percentile(values, q)
            assert v is not None
            idx = next((i for i, (lo, hi, _) in enumerate(bins) if lo <= v <= hi), len(bins) - 1)
            lo, hi, _ = bins[idx]
            frac = 0.5 if hi <= lo else (v - lo) / (hi - lo)
            xx = ML + (idx + frac) * bw
            p.body.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{MT}" y2="{MT + p.plot_h}" stroke="{color}" '
                          f'stroke-width="1.5" stroke-dasharray="4 3" data-marker="{name}" data-v="{v:.1f}"/>')
            right = xx > W - MR - 90  # near the right edge: the label goes left of its line
            p.body.append(f'<text x="{xx - 4 if right else xx + 4:.1f}" y="{MT + 12 + (14 if name == "p95" else 0)}" '
                          f'class="marker" fill="{color}" text-anchor="{"end" if right else "start"}">'
                          f'{name} {fmt_secs(v)}</text>')
            p.legend.append((name, f"{name} {fmt_secs(v)}", color))
    p.legend.insert(0, ("stages", f"{len(values)} stages", "#2f6fd0"))
    return p.svg(ticks, "Wall-clock distribution — first claim in the lane → finish, of the stages completed")


def chart_usage(d: ReportData) -> str:
    kinds = list(TOKEN_COLORS)
    days = [row["day"] for row in d.usage]
    peak = max([sum(int(row[k]) for k in kinds) for row in d.usage] + [1])
    cost_peak = max([float(row["cost_usd"]) for row in d.usage] + [0.0001])
    p = Plot("usage", peak, y_label="tokens", y2_max=cost_peak, y2_label="cost (USD)", integer=True)
    n = max(len(days), 1)
    bw = p.plot_w / n
    bar = min(bw * 0.7, 56.0)
    ticks = []
    cost_pts = []
    for i, row in enumerate(d.usage):
        x0 = ML + i * bw
        base = 0
        for k in kinds:
            v = int(row[k])
            if v:
                p.body.append(f'<rect x="{x0 + (bw - bar) / 2:.1f}" y="{p.y(base + v):.1f}" width="{bar:.1f}" '
                              f'height="{max(p.y(base) - p.y(base + v), 0.5):.1f}" fill="{TOKEN_COLORS[k]}" '
                              f'data-series="{k}" data-day="{row["day"]}" data-v="{v}">'
                              f'<title>{row["day"]} {TOKEN_LABELS[k]}: {v:,}</title></rect>')
            base += v
        p.body.append(f'<text x="{x0 + bw / 2:.1f}" y="{p.y(base) - 4:.1f}" class="bar-label" text-anchor="middle" '
                      f'data-day="{row["day"]}" data-total="{base}">{fmt_num(base)}</text>')
        cost = float(row["cost_usd"])
        cost_pts.append((x0 + bw / 2, p.y2(cost), cost, row["day"]))
        if n <= 16 or i % math.ceil(n / 16) == 0:
            ticks.append((x0 + bw / 2, str(row["day"])))
    if cost_pts:
        p.body.append('<polyline points="' + " ".join(f"{cx:.1f},{cy:.1f}" for cx, cy, _, _ in cost_pts)
                      + '" fill="none" stroke="#c23b5a" stroke-width="2" data-series="cost"/>')
        for cx, cy, cost, day in cost_pts:
            p.body.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3.5" fill="#c23b5a" data-series="cost" '
                          f'data-day="{day}" data-v="{cost:.6f}"><title>{day} cost: ${cost:.4f}</title></circle>')
    for k in kinds:
        p.legend.append((k, TOKEN_LABELS[k], TOKEN_COLORS[k]))
    p.legend.append(("cost", "cost (right axis)", "#c23b5a"))
    return p.svg(ticks, "Tokens by kind (bars) and cost (line) per UTC day — modelUsage sums")


def chart_repairs(d: ReportData) -> str:
    reasons = sorted({r for per in d.repairs.values() for r in per})
    colors = {r: PALETTE[(i + 3) % len(PALETTE)] for i, r in enumerate(reasons)}
    peak = max([sum(per.values()) for per in d.repairs.values()] + [1])
    p = Plot("repairs", peak, y_label=f"repairs per {fmt_secs(d.bar_step)}")
    origin = bucket_floor(d.start, d.bar_step)
    x, ticks = _time_axis(origin, d.now + timedelta(seconds=d.bar_step))
    _stacked_bars(p, x, sorted(d.repairs), d.bar_step, d.repairs, reasons, colors, "repairs")
    for r in reasons:
        p.legend.append((r, f"{r}: {sum(per.get(r, 0) for per in d.repairs.values())}", colors[r]))
    if not reasons:
        p.body.append(f'<text x="{W / 2}" y="{H / 2}" class="empty" text-anchor="middle">no repairs in this window</text>')
    return p.svg(ticks, "Repairs over time — evaporated claims the monitor released, by reason")


def sparkline(values: Sequence[float], *, name: str, title: str, color: str = PALETTE[0],
              width: int = 120, height: int = 28) -> str:
    """A small SVG line of ``values`` (oldest first) from 0 to their peak, with a dot on the last
    one: the console's lanes and pools (monitor/web), drawn here with the report's charts."""
    top, _ = nice_ticks(max([*values, 1]), integer=True)
    n = max(len(values) - 1, 1)
    pad = 2.0

    def xy(i: int, v: float) -> tuple[float, float]:
        return pad + (width - 2 * pad) * i / n, height - pad - (height - 2 * pad) * v / top

    pts = [xy(i, v) for i, v in enumerate(values)]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
    dot = f'<circle cx="{pts[-1][0]:.1f}" cy="{pts[-1][1]:.1f}" r="2" fill="{color}"/>' if pts else ""
    data = " ".join(f"{v:g}" for v in values)
    return (f'<svg class="spark" data-series="{html_escape(name)}" data-values="{html_escape(data)}" '
            f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
            f'aria-label="{html_escape(title)}" xmlns="http://www.w3.org/2000/svg"><title>{html_escape(title)}</title>'
            f'<line x1="{pad}" x2="{width - pad}" y1="{height - pad}" y2="{height - pad}" class="grid"/>'
            f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="1.5"/>{dot}</svg>')
