"""What a shift sends to the database, made storable.

Much of it comes from its agents, which are untrusted: the end of a log (a failure's error, a
hand-off's snapshot, a gate's evidence), ``.fleet/checkpoint.json``, ``.fleet/attention.json``, a
route's note, what an agent CLI's stream said (its model, its session, its summary). PostgreSQL
stores no NUL character in text or jsonb, JSON has no NaN or infinity, and UTF-8 has no lone
surrogate (``json.loads`` makes one of ``"\\ud800"``). A value with one of them was refused with
an error that ended the shift: every other agent stopped, and at SIGTERM the session was left open
(found by a review, 2026-12-04). :class:`StorableStore` makes every argument of every call storable
on its way (:func:`storable`): a NUL or a lone surrogate becomes U+FFFD, a NaN or an infinity
becomes null. A value the database still refuses (a checkpoint of ``null``) is the caller's to
report, as an error of the task, never of the shift.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from worker.store.protocol import Store

REPLACEMENT = "\ufffd"


def storable(value: Any) -> Any:
    """``value`` with every string, dict key, list, tuple and dataclass field inside it storable."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {(_text(k) if isinstance(k, str) else k): storable(v) for k, v in value.items()}
    if type(value) in (list, tuple):  # (a named tuple is left as it is)
        return type(value)(storable(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: storable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value


def _text(s: str) -> str:
    if "\x00" in s:
        s = s.replace("\x00", REPLACEMENT)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: the pairs become their characters, the rest U+FFFD
        s = s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return s


class StorableStore:
    """``store``, with every call's arguments made :func:`storable` first. Attributes that are not
    methods (its pool, its name) are the store's own."""

    def __init__(self, store: Store) -> None:
        self.inner = store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            return attr(*(storable(a) for a in args), **{k: storable(v) for k, v in kwargs.items()})

        return call
