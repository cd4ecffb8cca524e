"""Who may look at the console and act in it.

The rules (README "The web console"):

* bound to loopback (127.0.0.0/8, ::1, localhost) by default: whoever reaches the port is the
  operator of this host, and the console reads and acts with the host's own store;
* any other address needs a credential. On the Postgres back-end a console token (``--token-env
  NAME``: the token is in that environment variable, never on the command line); without one the
  console refuses to start. Over Supabase's REST API each person logs in with their own operator
  key (``fleet keys mint --role operator [--lane L]``), and every read and action of their session
  goes through a store made with that key: row level security and the SQL functions' checks decide
  what a lane-scoped key sees and may do, not this module;
* every visitor has a session (a random id in an HttpOnly, SameSite=Strict cookie, kept in this
  process's memory) holding a CSRF token that each form carries; a POST without it, or from
  another origin, is refused and changes nothing.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jwt

from worker.errors import ConfigError, InvalidInput
from worker.store.postgres import PostgresStore
from worker.store.supabase import SupabaseStore

COOKIE = "lf_console"
SESSION_SECONDS = 12 * 3600
MAX_SESSIONS = 5000  # beyond it the oldest go first: a client that never keeps its cookie costs nothing lasting
Store = PostgresStore | SupabaseStore


def parse_bind(bind: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:8765`` for IPv6); InvalidInput naming --bind otherwise."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidInput(f"--bind {bind!r} is not HOST:PORT (e.g. 127.0.0.1:8765)")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


@dataclass
class Visitor:
    """One browser's session."""

    sid: str
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    authed: bool = False
    who: str = "this host"
    store: SupabaseStore | None = None  # a person's own store (their fleet key), over REST
    lanes: list[str] | None = None  # what their key says it may work (None: every lane)
    flash: list[tuple[str, str]] = field(default_factory=list)
    seen: float = field(default_factory=time.monotonic)


@dataclass
class Access:
    """How this console is reached and who may use it."""

    backend: str  # "postgres" | "supabase"
    loopback: bool
    read_only: bool = False
    token: str | None = None  # the console token (Postgres back-end)
    host_store: Store | None = None  # the host's own store (None: every person brings a key)
    rest: tuple[str, str] | None = None  # Supabase: (project URL, anon key), for the persons' stores
    sessions: dict[str, Visitor] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check_start(self) -> None:
        """ConfigError (one line) for a console that may not start as configured."""
        if self.backend == "supabase" and self.token is not None:
            raise ConfigError("--token-env is for the Postgres back-end: over Supabase each person logs in "
                              "with their own operator key")
        if not self.loopback and self.backend == "postgres" and not self.token:
            raise ConfigError("a console bound beyond loopback needs a credential: --token-env NAME "
                              "(a console token in that environment variable)",
                              "or bind 127.0.0.1 and reach it through an SSH tunnel")

    @property
    def login_required(self) -> bool:
        """Whether a visitor must log in before seeing anything."""
        return not self.loopback or self.token is not None or self.host_store is None

    # -- sessions

    def visitor(self, sid: str | None) -> tuple[Visitor, bool]:
        """The session of cookie ``sid`` (a new one, and True, when it has none or it expired)."""
        now = time.monotonic()
        with self._lock:
            for old in [k for k, v in self.sessions.items() if now - v.seen > SESSION_SECONDS]:
                self._drop(old)
            found = self.sessions.get(sid or "")
            if found is not None:
                found.seen = now
                return found, False
            if len(self.sessions) >= MAX_SESSIONS:
                for old in sorted(self.sessions, key=lambda k: self.sessions[k].seen)[:MAX_SESSIONS // 10]:
                    self._drop(old)
            fresh = Visitor(sid=secrets.token_urlsafe(32))
            self.sessions[fresh.sid] = fresh
            return fresh, True

    def _drop(self, sid: str) -> None:
        gone = self.sessions.pop(sid, None)
        if gone is not None and gone.store is not None:
            gone.store.close()

    def logout(self, v: Visitor) -> None:
        with self._lock:
            self._drop(v.sid)

    def close(self) -> None:
        with self._lock:
            for sid in list(self.sessions):
                self._drop(sid)

    def may_look(self, v: Visitor) -> bool:
        return v.authed or not self.login_required

    def store_of(self, v: Visitor) -> Store:
        """The store this visitor reads and acts through."""
        if v.store is not None:
            return v.store
        assert self.host_store is not None and self.may_look(v)
        return self.host_store

    # -- logging in

    def login(self, v: Visitor, secret: str) -> str:
        """Log ``v`` in with a console token (Postgres) or a fleet key (Supabase); who they are,
        or InvalidInput saying why not."""
        secret = secret.strip()
        if not secret:
            raise InvalidInput("give the console token or your fleet key")
        if self.backend == "postgres":
            if not self.token_ok(secret):
                raise InvalidInput("that is not this console's token")
            v.authed, v.who = True, "console token"
            return v.who
        try:
            claims: dict[str, Any] = jwt.decode(secret, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise InvalidInput("that is not a fleet key (a JWT from `fleet keys mint`)") from None
        if claims.get("role") != "fleet_operator":
            raise InvalidInput(f"the console needs an operator key; this one is for {claims.get('role')!r}")
        assert self.rest is not None
        store = SupabaseStore(self.rest[0], self.rest[1], secret, attempts=2)
        try:
            store.lane_names()  # the API checks the signature and the expiry: refused here, or never
        except Exception as exc:
            store.close()
            raise InvalidInput(f"the API refused the key: {exc}") from None
        lanes = claims.get("fleet_lanes")
        with self._lock:
            if v.store is not None:
                v.store.close()
            v.store, v.authed = store, True
            v.lanes = [lanes] if isinstance(lanes, str) else lanes if isinstance(lanes, list) else None
            v.who = "operator key" + (f" for lanes {', '.join(map(str, v.lanes))}" if v.lanes else "")
        return v.who

    def token_ok(self, given: str | None) -> bool:
        """``given`` is this console's token (Postgres back-end; there is none over Supabase)."""
        return bool(self.token and given) and hmac.compare_digest(str(given).encode(), str(self.token).encode())

    # -- CSRF

    @staticmethod
    def csrf_ok(v: Visitor, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(str(given).encode(), v.csrf.encode())


def same_origin(origin: str | None, host: str | None) -> bool:
    """A POST's Origin (when the browser sends one) names this console's own host and port."""
    if origin is None:
        return True  # then the CSRF token alone decides
    if origin == "null" or host is None:
        return False
    return origin.split("://", 1)[-1].rstrip("/") == host
