"""Fixtures of the console tests: a fleet of two lanes on either back-end, and a real console
(uvicorn in a thread of the test, on a free loopback port) reading it through the store a host
would use — the database itself, or Supabase's API with an operator key."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fleetkit import Backend, Fleet

from monitor.web.app import Console, server
from monitor.web.auth import Access
from web.world import PROFILES, lane

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@pytest.fixture
def fleet(backend: Backend, tmp_path: Path) -> Iterator[Fleet]:
    """Lanes ``work`` (its completed tasks wait in review) and ``other``."""
    f = Fleet(backend, tmp_path, {"work": lane(review=True), "other": lane()}, tables=PROFILES)
    yield f
    f.close()


@dataclass
class Running:
    """A console being served: ``url``, and ``client()`` for a browser-like httpx session."""

    url: str
    access: Access
    console: Console

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, follow_redirects=False)


def csrf_of(html: str) -> str:
    found = CSRF.search(html)
    assert found, "the page has no form with a CSRF token"
    return found.group(1)


def serve(console: Console) -> Iterator[Running]:
    srv = server(console, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert thread.is_alive(), "the console did not start"
        assert time.monotonic() < deadline, "the console did not start in 20 s"
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield Running(f"http://127.0.0.1:{port}", console.access, console)
    finally:
        srv.should_exit = True
        thread.join(10)


@pytest.fixture
def console(fleet: Fleet) -> Iterator[Callable[..., Running]]:
    """``console(**access)``: a console of ``fleet`` (on supabase: with the operator key, as on a
    host of [fleet] store = "supabase"); ``host_key=None`` makes every person bring a key."""
    started: list[Iterator[Running]] = []

    def start(*, host_key: bool = True, **kw: Any) -> Running:
        backend = fleet.backend
        access = Access(backend=backend.name, loopback=kw.pop("loopback", True), **kw)
        if backend.rest:
            assert backend.stack is not None
            access.rest = (backend.stack.url, backend.stack.anon_key)
            access.host_store = fleet.monitor_store if host_key else None  # type: ignore[assignment]
        else:
            access.host_store = fleet.direct
        con = Console(access=access, workspaces=fleet.workspaces, log_roots=[fleet.workspaces], refresh_seconds=0.5)
        it = serve(con)
        started.append(it)
        return next(it)

    yield start
    for it in started:
        next(it, None)


@pytest.fixture(scope="session")
def browser():  # -> playwright Browser
    from web.browser import launch

    yield from launch()
