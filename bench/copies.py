"""Copies of a SQL function less one part each, made from its live definition: what
bench/complete_parts.py and bench/enqueue_many.py time the function against. A part is the text
of the definition that a copy replaces; a part whose text is no longer there is an error naming
it (``DefinitionChanged``), so that no copy is timed that is not what its name says."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

Edits = Sequence[tuple[str, str]]


class DefinitionChanged(Exception):
    pass


def definition(conn: psycopg.Connection[Any], signature: str) -> str:
    """The function's CREATE statement as the database holds it (``fleet.complete(bigint,uuid,jsonb)``)."""
    row = conn.execute("select pg_get_functiondef(%s::regprocedure)", (signature,)).fetchone()
    assert row is not None
    return str(row[0])


def function_copies(conn: psycopg.Connection[Any], signature: str, copies: Mapping[str, Edits | None],
                    prefix: str) -> dict[str, str]:
    """Create the copies in the database, ``<prefix><n>``, each the function with its (text,
    replacement) pairs applied (None: the function itself); returns name -> the function to call."""
    name = signature.split("(", 1)[0]
    source, head = definition(conn, signature), f"CREATE OR REPLACE FUNCTION {name}("
    if head not in source:
        raise DefinitionChanged(f"pg_get_functiondef no longer starts with {head!r}")
    out: dict[str, str] = {}
    for i, (label, edits) in enumerate(copies.items()):
        if edits is None:
            out[label] = name
            continue
        fn = f"{prefix}{i}"
        text = source.replace(head, f"CREATE FUNCTION {fn}(")
        for old, new in edits:
            if old not in text:
                raise DefinitionChanged(f"{label}: {name} no longer holds {old[:40]!r}")
            text = text.replace(old, new)
        conn.execute(text)
        out[label] = fn
    return out
