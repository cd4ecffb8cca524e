"""Real network partitions for tests: namespaces the test makes, a wire between, a relay to PostgreSQL.

A :class:`PartitionHost` is a machine on the other side of a network from the database, built by
the test itself (issue #18) out of kernel parts, loopback and its own addresses only:

    root namespace                 wire namespace               host namespace
    relay on <root_ip>:<port>      bridge br0                   the test's processes
      lf<pid>-<n>r  ═══ veth ═══ toroot ┘ └ tohost ═══ veth ═══ lf<pid>-<n>n  <ns_ip>

- the host: a network namespace (``lf-<pid>-<n>``) with ``lo`` up; the wire: another one
  (``lf-<pid>-<n>w``) whose bridge joins a veth to the root namespace and a veth to the host.
  The two ends carry the two addresses of a private /30 (10.213.x.y, else 10.187.x.y, else
  169.254.213.z) that overlaps no address or route of the machine, chosen under a file lock
  (pytest-xdist workers make hosts at the same moment), with permanent neighbour entries both
  ways (a long cut must not end in an ARP failure, which the kernel reports to the sender as
  "no route to host");
- a TCP relay in the root namespace (an asyncio loop in a thread) listening on the root-side
  address and forwarding to the PostgreSQL server, which listens on loopback only: from inside
  the host the database is ``<root_ip>:<relay port>`` (:meth:`PartitionHost.url`);
- :meth:`PartitionHost.popen` runs a process inside the host (``ip netns exec``), in a process
  group of its own; :meth:`PartitionHost.close` kills those groups, stops the relay and deletes
  the veths and both namespaces. Nothing else is ever touched: no other namespace, link, process
  or address.

Why: a partition is not a refused connection. When a network path breaks, the peer says nothing —
no RST, no FIN; a new connection's SYN goes unanswered, a query in flight never returns, TCP
retransmits with growing back-off, and only timeouts tell. :meth:`PartitionHost.cut` makes that
happen in the kernel: the wire drops every frame it would forward, either way, with
``tc qdisc ... netem loss 100%`` on both of its ports where the kernel has netem, else with a
``pfifo limit 0`` qdisc (a queue that holds nothing; this project's CI kernel has no netem).
:meth:`PartitionHost.heal` removes them and TCP carries on where it stopped, at its next
retransmission (after a long cut that can be seconds later, as on a real network).

Why the wire: a drop must happen between the two machines, not in the sender's own stack. A qdisc
on the sender's own veth drops the packet in front of its TCP, which then knows ("local
congestion"): it retries every 0.5 s instead of backing off, and after 15 such tries (~8 s) it
aborts the connection with ETIMEDOUT — nothing like a partition, where a connection survives for
minutes (tcp_retries2). Frames the wire's bridge drops were sent, as far as either end knows.

Where no qdisc can be made, the relay stops forwarding instead (``cut_method == "relay"``; a new
connection then completes its TCP handshake with the relay's kernel but gets no byte back).
:meth:`PartitionHost.delay_replies` holds the server's bytes in the relay for a while
(protocol-unaware: every reply on every connection is late), to delay one chosen answer in flight.

Needs root and iproute2 (``ip``, ``tc``; the kernel's veth and bridge). Where namespaces cannot be
made, :func:`open_host` raises :class:`NamespaceUnavailable` and :func:`host_or_skip` (the
``partition_host`` fixture) skips the test saying why — or fails it when
``LANEFLEET_REQUIRE_NETNS`` is set (for CI, where a silent skip would hide a broken harness).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, urlencode

import pytest
from psycopg.conninfo import conninfo_to_dict

IP = "ip"  # iproute2's binaries (module attributes, so a test can put a failing stand-in here)
TC = "tc"

# where the /30s come from, in order; each pool is scanned from a point that depends on the pid
POOLS = [ipaddress.IPv4Network(n) for n in ("10.213.0.0/16", "10.187.0.0/16", "169.254.213.0/24")]
# the two ways to drop every frame on the wire, best first
QDISCS = {"netem": ["netem", "loss", "100%"], "pfifo-limit-0": ["pfifo", "limit", "0"]}
# the wire namespace's two ports (on its bridge), toward the host and toward the root namespace
WIRE_TO_HOST, WIRE_TO_ROOT = "tohost", "toroot"
# held while a /30 is chosen and its root-side address added (xdist workers make hosts at once)
LOCK = Path("/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()) / "lanefleet-netns.lock"

_numbers = itertools.count()
_cut_method: str | None = None  # what this kernel supports, probed once per process


class NamespaceUnavailable(RuntimeError):
    """This machine does not let the test make a network namespace (the message says why)."""


class HarnessError(RuntimeError):
    """An ``ip``/``tc`` command of the harness failed (a bug or a broken machine, never a skip)."""


class _NameTaken(Exception):
    """The namespace or link name exists already (someone else's): try the next number."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and cp.returncode != 0:
        raise HarnessError(f"`{' '.join(argv)}` failed (exit {cp.returncode}): {cp.stderr.strip()}")
    return cp


def netns_names() -> set[str]:
    """The names of the machine's named network namespaces (``ip netns list``)."""
    out = _run(IP, "netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def link_exists(name: str) -> bool:
    """Whether a link of that name exists in the root namespace."""
    return _run(IP, "link", "show", "dev", name, check=False).returncode == 0


def networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network of an address or a route (any table) of the root namespace."""
    nets: list[ipaddress.IPv4Network] = []
    for link in json.loads(_run(IP, "-j", "-4", "addr", "show").stdout or "[]"):
        for info in link.get("addr_info", []):
            for key in ("local", "address"):
                if key in info:
                    nets.append(ipaddress.IPv4Network(f"{info[key]}/{info['prefixlen']}", strict=False))
    for route in json.loads(_run(IP, "-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst")
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(dst, strict=False))
    return nets


def free_slash30(used: Sequence[ipaddress.IPv4Network], seed: int) -> ipaddress.IPv4Network:
    """A /30 of :data:`POOLS` that overlaps none of ``used``."""
    for pool in POOLS:
        count = pool.num_addresses // 4
        for i in range(count):
            net = ipaddress.IPv4Network((int(pool.network_address) + 4 * ((seed + i) % count), 30))
            if not any(net.overlaps(u) for u in used):
                return net
    raise HarnessError(f"no free /30 in {', '.join(map(str, POOLS))}")


@contextlib.contextmanager
def _allocation_lock() -> Iterator[None]:
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Lines:
    """The lines of a child's text pipe, read by a thread of their own, so that a test can wait
    for the next one with a timeout (``next`` gives None if none came in time, "" at the end)."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        with contextlib.suppress(ValueError, OSError):  # the pipe closed under us
            for line in stream:
                self._lines.put(line)
        self._lines.put("")

    def next(self, timeout: float) -> str | None:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return None


# -- the relay


class Relay:
    """TCP from ``listen_host``:``port`` (an ephemeral port) to ``target`` — ``(host, port)`` or a
    Unix socket path — on an asyncio loop of its own thread. ``delay_replies`` holds target→client
    bytes; ``hold``/``release`` stop and restart forwarding both ways (the fallback cut)."""

    def __init__(self, listen_host: str, target: tuple[str, int] | str) -> None:
        self.listen_host = listen_host
        self.target = target
        self.port = 0
        self.accepted = 0  # connections accepted so far (a kernel cut keeps new ones from arriving)
        self._delay = 0.0
        self._trap: tuple[bytes, float] | None = None  # (what a client sends, how long its answer waits)
        self.trapped = 0  # answers delayed by a trap so far
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"relay-{listen_host}")
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._flowing: asyncio.Event | None = None

    def start(self) -> Relay:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self) -> asyncio.Server:
        self._flowing = asyncio.Event()
        self._flowing.set()
        return await asyncio.start_server(self._accept, self.listen_host, 0)

    def delay_replies(self, seconds: float) -> None:
        """From now on, each chunk the target sends is forwarded ``seconds`` after it arrived
        (0: at once; chunks already held keep their time; order is kept)."""
        if seconds < 0:
            raise ValueError("a delay is never negative")
        self._delay = float(seconds)

    def delay_answer_to(self, pattern: bytes, seconds: float) -> None:
        """Once: on the connection whose client next sends bytes holding ``pattern`` (a query's
        text, e.g. ``b"fleet.lease_held("``), what the server sends back is held until ``seconds``
        after that request passed — one chosen call's answer delayed in flight, every other
        connection untouched (the protocol-aware delay of issue #18)."""
        if seconds < 0:
            raise ValueError("a delay is never negative")
        self._trap = (pattern, float(seconds))

    def hold(self) -> None:
        """Forward nothing either way, and connect new clients to nothing, until :meth:`release`."""
        assert self._flowing is not None
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def release(self) -> None:
        assert self._flowing is not None
        self._loop.call_soon_threadsafe(self._flowing.set)

    def close(self) -> None:
        """Stop listening, drop every connection, stop the loop and its thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None and self._flowing is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            await self._flowing.wait()
            if isinstance(self.target, str):
                ur, upstream = await asyncio.open_unix_connection(self.target)
            else:
                ur, upstream = await asyncio.open_connection(*self.target)
            self._writers.add(upstream)
            hold_until = [0.0]  # loop time before which this connection's answers wait (a trap)
            pumps = {asyncio.create_task(self._up(reader, upstream, hold_until)),
                     asyncio.create_task(self._down(ur, writer, hold_until))}
            try:
                _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
                if pending:  # one side broke: the other end learns it by its socket's closing
                    for p in pending:
                        p.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
            finally:
                for p in pumps:
                    p.cancel()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (writer, upstream):
                if w is not None:
                    w.transport.abort()
                    self._writers.discard(w)
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _up(self, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter,
                  hold_until: list[float]) -> None:
        assert self._flowing is not None
        loop = asyncio.get_running_loop()
        while data := await reader.read(65536):
            if (trap := self._trap) is not None and trap[0] in data:
                self._trap = None
                self.trapped += 1
                hold_until[0] = loop.time() + trap[1]
            await self._flowing.wait()
            upstream.write(data)
            await upstream.drain()
        if upstream.can_write_eof():
            upstream.write_eof()

    async def _down(self, upstream: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    hold_until: list[float]) -> None:
        assert self._flowing is not None
        loop = asyncio.get_running_loop()
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def forward() -> None:
            assert self._flowing is not None
            while True:
                at, data = await held.get()
                if not data:
                    break
                if (wait := at - loop.time()) > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        sender = asyncio.create_task(forward())
        try:
            while data := await upstream.read(65536):
                held.put_nowait((max(loop.time() + self._delay, hold_until[0]), data))
            held.put_nowait((0.0, b""))
            await sender
        finally:
            sender.cancel()


# -- the host


class PartitionHost:
    """A network namespace behind a wire (a namespace with a bridge) from the root namespace, and
    a relay to the database at ``target_url`` (a libpq URL of the server as the root namespace
    reaches it). Use as a context manager, or :meth:`open` and (always) :meth:`close`."""

    def __init__(self, target_url: str) -> None:
        self.target_url = target_url
        params = conninfo_to_dict(target_url)
        host = str(params.get("host") or "127.0.0.1").split(",")[0]
        port = int(str(params.get("port") or 5432).split(",")[0])
        self._target: tuple[str, int] | str = (
            os.path.join(host, f".s.PGSQL.{port}") if host.startswith("/") else (host, port))
        self._params = params
        self.name = self.wire = self.root_if = self.ns_if = ""
        self.root_ip = self.ns_ip = ""
        self.net: ipaddress.IPv4Network | None = None
        self.relay: Relay | None = None
        self.cut_method = ""
        self.is_cut = False
        self.processes: list[subprocess.Popen[Any]] = []
        self._undo: list[tuple[str, ...]] = []  # what to run, last first, to unmake what was made

    # -- life

    def __enter__(self) -> PartitionHost:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> PartitionHost:
        """Make the namespaces, the veths, the addresses and the relay. Raises
        :class:`NamespaceUnavailable` if this machine allows no namespace (nothing is left behind
        by a failed open)."""
        if os.geteuid() != 0:
            raise NamespaceUnavailable(f"making a network namespace needs root (euid {os.geteuid()})")
        try:
            for _ in range(100):
                try:
                    self._make(next(_numbers))
                    break
                except _NameTaken:
                    self._unmake()
            else:
                raise HarnessError("100 namespace or link names taken in a row")
            self.relay = Relay(self.root_ip, self._target).start()
            self.cut_method = self._probe_cut()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self, n: int) -> None:
        pid = os.getpid()
        self.name, self.wire = f"lf-{pid}-{n}", f"lf-{pid}-{n}w"
        self.root_if, self.ns_if = f"lf{pid}-{n}r", f"lf{pid}-{n}n"
        try:
            cp = _run(IP, "netns", "add", self.name, check=False)
        except FileNotFoundError as e:
            raise NamespaceUnavailable(f"iproute2 is not installed ({e})") from None
        if cp.returncode != 0:
            if "exists" in cp.stderr:
                raise _NameTaken
            raise NamespaceUnavailable(f"`ip netns add {self.name}`: {cp.stderr.strip()}")
        self._undo.append((IP, "netns", "del", self.name))
        self._add((IP, "netns", "add", self.wire), undo=(IP, "netns", "del", self.wire))
        ns, wire = (IP, "-n", self.name), (IP, "-n", self.wire)
        with _allocation_lock():
            net = free_slash30(networks_in_use(), seed=pid * 61 + n)
            self._add((IP, "link", "add", self.root_if, "type", "veth", "peer", "name", WIRE_TO_ROOT,
                       "netns", self.wire), undo=(IP, "link", "del", "dev", self.root_if))
            self.net = net
            self.root_ip, self.ns_ip = (str(a) for a in net.hosts())
            _run(IP, "addr", "add", f"{self.root_ip}/30", "dev", self.root_if)
        self._add((*wire, "link", "add", WIRE_TO_HOST, "type", "veth", "peer", "name", self.ns_if,
                   "netns", self.name), undo=(*wire, "link", "del", "dev", WIRE_TO_HOST))
        _run(*wire, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        for port in (WIRE_TO_ROOT, WIRE_TO_HOST):
            _run(*wire, "link", "set", port, "master", "br0")
            _run(*wire, "link", "set", port, "up")
        _run(*wire, "link", "set", "br0", "up")
        _run(IP, "link", "set", self.root_if, "up")
        _run(*ns, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
        _run(*ns, "link", "set", self.ns_if, "up")
        _run(*ns, "link", "set", "lo", "up")
        root_mac = Path(f"/sys/class/net/{self.root_if}/address").read_text().strip()
        ns_mac = json.loads(_run(*ns, "-j", "link", "show", "dev", self.ns_if).stdout)[0]["address"]
        _run(IP, "neigh", "replace", self.ns_ip, "lladdr", ns_mac, "dev", self.root_if, "nud", "permanent")
        _run(*ns, "neigh", "replace", self.root_ip, "lladdr", root_mac, "dev", self.ns_if, "nud", "permanent")

    def _add(self, argv: tuple[str, ...], undo: tuple[str, ...]) -> None:
        """Make something (a namespace, a veth) and remember how to unmake it."""
        cp = _run(*argv, check=False)
        if cp.returncode != 0:
            if "exists" in cp.stderr:
                raise _NameTaken
            raise HarnessError(f"`{' '.join(argv)}` failed: {cp.stderr.strip()}")
        self._undo.append(undo)

    def _probe_cut(self) -> str:
        global _cut_method
        if _cut_method is None:
            _cut_method = "relay"
            for method, spec in QDISCS.items():
                tc = (TC, "-n", self.wire, "qdisc")
                if _run(*tc, "add", "dev", WIRE_TO_HOST, "root", *spec, check=False).returncode == 0:
                    _run(*tc, "del", "dev", WIRE_TO_HOST, "root")
                    _cut_method = method
                    break
        return _cut_method

    def _unmake(self) -> None:
        while self._undo:
            _run(*self._undo.pop(), check=False)

    def close(self) -> None:
        """Kill the process groups this host started, stop the relay, delete the veths and both
        namespaces. Safe to call twice, or after a failed :meth:`open`."""
        for proc in self.processes:
            # SIGKILL the group before reaping its leader: while the leader is unreaped (or any
            # member lives) its pgid cannot belong to anyone else
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self.processes.clear()
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        self._unmake()
        self.is_cut = False

    # -- inside

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kw: Any) -> subprocess.Popen[Any]:
        """``argv`` inside the namespace (``ip netns exec``: same pid, a new process group), with
        ``env`` (default: this process's). Killed, with its group, at :meth:`close`."""
        if self.relay is None:
            raise HarnessError("the host is not open")
        kw["start_new_session"] = True
        proc = subprocess.Popen([IP, "netns", "exec", self.name, *argv],
                                env=dict(os.environ if env is None else env), **kw)
        self.processes.append(proc)
        return proc

    def python(self, code: str, *args: str, env: Mapping[str, str] | None = None,
               **kw: Any) -> subprocess.Popen[str]:
        """``python -u -c code args…`` inside the namespace, text pipes for stdin/out/err unless
        ``kw`` says otherwise."""
        for name in ("stdin", "stdout", "stderr"):
            kw.setdefault(name, subprocess.PIPE)
        kw.setdefault("text", True)
        return self.popen([sys.executable, "-u", "-c", code, *args], env=env, **kw)

    def sysctl(self, key: str, value: object) -> None:
        """Set a per-namespace sysctl inside the host, e.g. ``net.ipv4.tcp_retries2`` (the root
        namespace's stays as it is)."""
        path = "/proc/sys/" + key.replace(".", "/")
        _run(IP, "netns", "exec", self.name, "sh", "-c", 'printf "%s\\n" "$1" > "$2"', "sh", str(value), path)

    def url(self, dbname: str) -> str:
        """A libpq URL of database ``dbname`` as seen from inside the namespace (through the relay);
        the user, password and other parameters of ``target_url``."""
        assert self.relay is not None
        rest = {k: str(v) for k, v in self._params.items()
                if k not in ("host", "hostaddr", "port", "dbname", "user", "password")}
        auth = quote(str(self._params.get("user") or "postgres"), safe="")
        if self._params.get("password"):
            auth += ":" + quote(str(self._params["password"]), safe="")
        query = f"?{urlencode(rest)}" if rest else ""
        return f"postgresql://{auth}@{self.root_ip}:{self.relay.port}/{quote(dbname, safe='')}{query}"

    # -- the network between

    def cut(self) -> None:
        """A silent partition: the wire drops every frame either way (new connections get no
        answer, open ones hear nothing; no RST, no FIN) until :meth:`heal`."""
        if self.cut_method in QDISCS:
            spec = QDISCS[self.cut_method]
            for port in (WIRE_TO_HOST, WIRE_TO_ROOT):
                _run(TC, "-n", self.wire, "qdisc", "replace", "dev", port, "root", *spec)
        else:
            assert self.relay is not None
            self.relay.hold()
        self.is_cut = True

    def heal(self) -> None:
        """End a :meth:`cut` (not a :meth:`delay_replies`): packets flow again, TCP retransmits
        what was dropped. Harmless when not cut."""
        if self.cut_method in QDISCS:
            for port in (WIRE_TO_HOST, WIRE_TO_ROOT):
                _run(TC, "-n", self.wire, "qdisc", "del", "dev", port, "root", check=False)
        if self.relay is not None:
            self.relay.release()
        self.is_cut = False

    def delay_replies(self, seconds: float) -> None:
        """Hold the server's bytes ``seconds`` in the relay before forwarding them (0: stop)."""
        assert self.relay is not None
        self.relay.delay_replies(seconds)


def open_host(target_url: str) -> PartitionHost:
    """An open :class:`PartitionHost` (raises :class:`NamespaceUnavailable`)."""
    return PartitionHost(target_url).open()


@contextlib.contextmanager
def host_or_skip(target_url: str) -> Iterator[PartitionHost]:
    """What the ``partition_host`` fixture does: an open host, closed afterwards whatever happens;
    the test skipped (failed, with ``LANEFLEET_REQUIRE_NETNS`` set) where namespaces are not allowed."""
    try:
        host = open_host(target_url)
    except NamespaceUnavailable as e:
        reason = f"network namespaces are not allowed here: {e}"
        if os.environ.get("LANEFLEET_REQUIRE_NETNS"):
            pytest.fail(f"{reason} (and LANEFLEET_REQUIRE_NETNS is set)", pytrace=False)
        pytest.skip(reason)
    try:
        yield host
    finally:
        host.close()

