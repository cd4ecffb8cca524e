"""The console's ASGI app (Starlette): the routes, the session cookie, CSRF and Origin checks on
every POST, the templates (autoescaped Jinja2), and ``serve`` (uvicorn).

Every GET page is whole HTML; its live parts (``data-live`` elements) are refreshed every few
seconds by static/console.js, which fetches the same URL and swaps those parts in, without a
reload. Reads and actions run in Starlette's thread pool: the stores are synchronous.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import uvicorn
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from monitor.web import pages
from monitor.web.actions import ACTIONS, act
from monitor.web.auth import COOKIE, Access, Visitor, same_origin
from monitor.web.reads import STATES, snapshot
from worker.errors import DatabaseUnavailable, FleetError, UnknownTask
from worker.tables import fmt_cost, fmt_num, fmt_secs, fmt_share

HERE = Path(__file__).parent
REFRESH_SECONDS = 3
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


@dataclass
class Console:
    """What the app needs: who may use it, and where this host keeps the logs it may show."""

    access: Access
    workspaces: Path
    log_roots: list[Path] = field(default_factory=list)
    refresh_seconds: float = REFRESH_SECONDS


def _ago(value: Any, now: datetime | None = None) -> str:
    t = pages.as_time(value)
    if t is None:
        return "—"
    return fmt_secs(((now or datetime.now(UTC)) - t).total_seconds()) + " ago"


def _when(value: Any) -> str:
    t = pages.as_time(value)
    return "—" if t is None else t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, default=str, ensure_ascii=False)


def environment() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))
    env.filters.update(secs=fmt_secs, num=fmt_num, cost=fmt_cost, share=fmt_share, ago=_ago, when=_when,
                       pretty=_json)
    return env


def _safe_next(value: Any, default: str = "/") -> str:
    """A redirect target that stays on this console (a path, never //host or a scheme)."""
    text = str(value or "")
    return text if text.startswith("/") and not text.startswith("//") and "\\" not in text else default


def make_app(console: Console) -> Starlette:
    access = console.access
    env = environment()

    def visitor_of(request: Request) -> tuple[Visitor, bool]:
        return access.visitor(request.cookies.get(COOKIE))

    def finish(response: Response, v: Visitor, fresh: bool) -> Response:
        if fresh:
            response.set_cookie(COOKIE, v.sid, httponly=True, samesite="strict", path="/")
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["Cache-Control"] = "no-store"
        return response

    def render(request: Request, v: Visitor, fresh: bool, name: str, ctx: dict[str, Any],
               status: int = 200) -> Response:
        flash, v.flash = v.flash, []
        body = env.get_template(name).render(
            request=request, v=v, csrf=v.csrf, read_only=access.read_only, flash=flash, actions=ACTIONS,
            states=STATES, refresh_ms=int(console.refresh_seconds * 1000), backend=access.backend,
            login_required=access.login_required, path=request.url.path,
            here=request.url.path + (f"?{request.url.query}" if request.url.query else ""), **ctx)
        return finish(HTMLResponse(body, status_code=status), v, fresh)

    def page(name: str, build: Callable[..., dict[str, Any]]) -> Callable[[Request], Response]:
        """A GET page: the visitor's reads, in one snapshot, rendered by template ``name``."""
        def endpoint(request: Request) -> Response:
            v, fresh = visitor_of(request)
            if not access.may_look(v):
                target = quote(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
                return finish(RedirectResponse(f"/login?next={target}", status_code=303), v, fresh)
            try:
                with snapshot(access.store_of(v)) as s:
                    ctx = build(s, request)
            except UnknownTask as exc:
                return render(request, v, fresh, "error.html", {"message": str(exc)}, 404)
            except DatabaseUnavailable as exc:
                return render(request, v, fresh, "error.html", {"message": str(exc)}, 503)
            except FleetError as exc:
                return render(request, v, fresh, "error.html", {"message": str(exc)}, 400)
            return render(request, v, fresh, name, ctx)
        return endpoint

    def refuse(v: Visitor, fresh: bool, why: str, status: int = 403) -> Response:
        return finish(PlainTextResponse(f"refused: {why}\n", status_code=status), v, fresh)

    async def checked_form(request: Request) -> tuple[Visitor, bool, Any, Response | None]:
        """The POST's form, or the refusal: another origin, or no (or a wrong) CSRF token."""
        v, fresh = visitor_of(request)
        form = await request.form()
        if not same_origin(request.headers.get("origin"), request.headers.get("host")):
            return v, fresh, form, refuse(v, fresh, "the request came from another origin")
        if fresh or not access.csrf_ok(v, form.get("csrf")):  # type: ignore[arg-type]
            return v, fresh, form, refuse(v, fresh, "no valid CSRF token (reload the page and try again)")
        return v, fresh, form, None

    async def action(request: Request) -> Response:
        if access.read_only:
            v, fresh = visitor_of(request)
            return refuse(v, fresh, "this console is read-only (fleet web --read-only)")
        v, fresh, form, refused = await checked_form(request)
        if refused is not None:
            return refused
        if not access.may_look(v):
            return refuse(v, fresh, "log in first")
        name, target = request.path_params["name"], int(request.path_params["target"])
        note = form.get("note")
        try:
            message = await run_in_threadpool(act, access.store_of(v), name, target,
                                              note if isinstance(note, str) else None)
            v.flash.append(("ok", message))
        except FleetError as exc:
            v.flash.append(("error", f"{ACTIONS[name].function if name in ACTIONS else name}({target}): {exc}"))
        return finish(RedirectResponse(_safe_next(form.get("next")), status_code=303), v, fresh)

    def login_page(request: Request) -> Response:
        v, fresh = visitor_of(request)
        return render(request, v, fresh, "login.html", {"next": _safe_next(request.query_params.get("next"))})

    async def login(request: Request) -> Response:
        v, fresh, form, refused = await checked_form(request)
        if refused is not None:
            return refused
        secret = form.get("secret")
        try:
            who = await run_in_threadpool(access.login, v, secret if isinstance(secret, str) else "")
        except FleetError as exc:
            v.flash.append(("error", str(exc)))
            return render(request, v, fresh, "login.html", {"next": _safe_next(form.get("next"))}, 403)
        v.flash.append(("ok", f"logged in ({who})"))
        return finish(RedirectResponse(_safe_next(form.get("next")), status_code=303), v, fresh)

    async def logout(request: Request) -> Response:
        v, _fresh, _form, refused = await checked_form(request)
        if refused is not None:
            return refused
        access.logout(v)
        return RedirectResponse("/login", status_code=303)

    def metrics(request: Request) -> Response:
        """``/metrics``, the Prometheus exposition (monitor.metrics); it reads with the host's store,
        so only where no login is needed (loopback) or with the console token. 503 with one line
        when the store cannot be read."""
        from monitor.metrics import MetricsUnavailable, metrics_payload

        bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if access.login_required and not access.token_ok(bearer):
            return PlainTextResponse("refused: /metrics needs the console token as a Bearer token\n", 401)
        assert access.host_store is not None
        try:
            body, content_type = metrics_payload(access.host_store)
        except MetricsUnavailable as exc:
            return PlainTextResponse(f"{exc}\n", 503)
        return Response(body, media_type=content_type)

    def health(_request: Request) -> Response:
        return PlainTextResponse("ok\n")

    def filters_of(request: Request) -> pages.Filters:
        return pages.Filters.of(request.query_params)

    @asynccontextmanager
    async def lifespan(_app: Starlette):  # type: ignore[no-untyped-def]
        yield
        access.close()

    routes = [
        Route("/", page("lanes.html", lambda s, _r: pages.lanes_page(s))),
        Route("/tasks", page("tasks.html", lambda s, r: pages.tasks_page(s, filters_of(r)))),
        Route("/tasks/{task:int}", page("task.html", lambda s, r: pages.task_page(
            s, r.path_params["task"], console.workspaces, console.log_roots))),
        Route("/queues", page("queues.html", lambda s, _r: pages.queues_page(s))),
        Route("/batches", page("batches.html", lambda s, _r: pages.batches_page(s))),
        Route("/batches/{batch:int}", page("batch.html", lambda s, r: pages.batch_page(s, r.path_params["batch"]))),
        Route("/history", page("history.html", lambda s, r: pages.history_page(
            s, r.query_params.get("window") or "24h"))),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/act/{name}/{target:int}", action, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/healthz", health),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def server(console: Console, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server of the console (``port`` 0: a free one; ``server.servers`` tells which)."""
    config = uvicorn.Config(make_app(console), host=host, port=port, log_level="warning",
                            access_log=False, lifespan="on", server_header=False)
    return uvicorn.Server(config)
