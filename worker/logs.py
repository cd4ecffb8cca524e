"""One log stream per process: lanefleet's structlog events, the libraries' ``logging`` records and
Python's ``warnings``, all through one renderer on stderr.

:func:`configure_logging` is what a long-running ``fleet`` process (a shift, ``fleet run``, the
monitor) calls first. Everything goes through a single ``logging`` handler on the root logger whose
formatter is structlog's ``ProcessorFormatter``: structlog events arrive wrapped by
``wrap_for_formatter``, every other record (psycopg_pool's "error connecting in 'lanefleet'", httpx,
apscheduler, ``warnings.warn`` by way of ``logging.captureWarnings``) through ``foreign_pre_chain``.
So a shift's stderr is one JSON object per line whatever wrote it, each with ``event``, ``level``,
``timestamp`` and ``logger`` (``lanefleet.shift``, ``psycopg.pool``, ``py.warnings``, ...), and
an exception as an ``exception`` field rather than a traceback across lines. One handler, one lock:
lines written from different threads (the pool's workers, the guard's) never interleave.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

#: the level of the libraries' loggers when FLEET_LOG_LEVEL is unset: their warnings and errors,
#: not httpx's line per request nor apscheduler's per job
LIBRARY_LEVEL = logging.WARNING
#: the logger every lanefleet structlog logger is under (``lanefleet.shift``, ``lanefleet.host``)
OWN_LOGGER = "lanefleet"


class _Stderr:
    """sys.stderr as it is at each write, not as it was when logging was configured: a stream that
    was replaced since (rich's Live redirects it while it draws, pytest captures it) still gets
    the lines."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class _Handler(logging.StreamHandler[_Stderr]):
    """The handler :func:`configure_logging` installs (its class finds it again). It passes
    lanefleet's records and the libraries' from ``library_level`` up: a library that sets its own
    logger's level (psycopg sets ``psycopg`` to WARNING) is still held to a higher one."""

    def __init__(self, library_level: int) -> None:
        super().__init__(_Stderr())
        self.library_level = library_level

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == OWN_LOGGER or record.name.startswith(OWN_LOGGER + ".")
        return (own or record.levelno >= self.library_level) and bool(super().filter(record))


def _tidy_warning(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """``warnings.formatwarning`` ends its text with a newline: drop it from the event."""
    record = event_dict.get("_record")
    if record is not None and record.name == "py.warnings" and isinstance(event_dict.get("event"), str):
        event_dict["event"] = event_dict["event"].rstrip()
    return event_dict


def library_level(environ: Mapping[str, str] | None = None) -> int | None:
    """FLEET_LOG_LEVEL as a ``logging`` level (a name such as ``info`` or a number); WARNING when
    unset; None when it is set to something that is neither."""
    raw = (os.environ if environ is None else environ).get("FLEET_LOG_LEVEL", "").strip()
    if not raw:
        return LIBRARY_LEVEL
    if raw.isdigit():
        return int(raw)
    return logging.getLevelNamesMapping().get(raw.upper())


def configure_logging(json_logs: bool | None = None, *, own_level: int = logging.DEBUG) -> None:
    """Route structlog, ``logging`` and ``warnings`` to stderr through one structlog renderer.

    ``json_logs``: one JSON object per line (True), structlog's readable console lines (False),
    or JSON unless stderr is a terminal (None).

    Levels: lanefleet's own loggers (``lanefleet.*``) pass everything from ``own_level`` up (by
    default every level, as the shift always logged); every other logger, meaning the libraries,
    from WARNING up, or from the level the environment variable ``FLEET_LOG_LEVEL`` names
    (``debug``, ``info``, ``warning``, ``error``, ``critical`` or a number; e.g.
    ``FLEET_LOG_LEVEL=info`` shows httpx's request lines and psycopg_pool's pool events). A
    FLEET_LOG_LEVEL that names no level is logged as a warning and WARNING is used.

    Idempotent: a second call replaces the handler the first one installed (with the new format)
    rather than adding another, so no line is ever written twice.
    """
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: list[Processor]
    if json_logs:
        renderer = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:  # the console renderer prints an exception itself, readably (not its frames' locals,
        # which hold database URLs and keys)
        renderer = [structlog.dev.ConsoleRenderer(
            exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False))]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    level = library_level()
    handler = _Handler(LIBRARY_LEVEL if level is None else level)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _tidy_warning],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    # the levels the records are made from (the handler drops the rest of a library's): psycopg's
    # own logger too, which it would set to WARNING, so that FLEET_LOG_LEVEL=info shows its pool's
    for name in ("", "psycopg"):
        logging.getLogger(name).setLevel(handler.library_level)
    logging.getLogger(OWN_LOGGER).setLevel(own_level)
    logging.captureWarnings(True)
    if level is None:
        log: Any = structlog.get_logger(f"{OWN_LOGGER}.logs")
        log.warning("FLEET_LOG_LEVEL names no level; the libraries log from WARNING up",
                    value=os.environ.get("FLEET_LOG_LEVEL"))
