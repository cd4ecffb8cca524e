"""A database URL as lanefleet shows and checks it: every message about a database names it, and
never with its password.
"""

from __future__ import annotations

import re

import psycopg
from psycopg.conninfo import conninfo_to_dict

from worker.errors import ConfigError, one_line

# a URL's user:password@ and a password=... parameter (of a URL's query or of a key=value string)
_URL_PASSWORD = re.compile(r"^(?P<head>[a-z]+://[^/@:]*):[^/@]*@", re.IGNORECASE)
_PARAM_PASSWORD = re.compile(r"(?P<head>(?:^|[?&\s])password\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^&\s]*)",
                             re.IGNORECASE)


def redact(url: str) -> str:
    """``url`` with any password taken out (``postgresql://user@host/db``)."""
    return _PARAM_PASSWORD.sub(r"\g<head>***", _URL_PASSWORD.sub(r"\g<head>@", url.strip()))


def check_url(url: str, origin: str) -> str:
    """``url`` if libpq can read it; else a :class:`ConfigError` naming where it came from
    (``origin``: an environment variable, or the config file's ``database.url``)."""
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        reason = one_line(str(exc))
        raise ConfigError(f"{origin}: {redact(url)!r} is not a database URL: {reason}",
                          "e.g. postgresql://user@127.0.0.1:5432/fleet") from None
    return url
