"""The partition harness itself (tests/partition/netns.py): that its namespace reaches PostgreSQL
only through the relay, that a cut is silent (a new connection times out instead of being refused,
a query in flight hears nothing) and heals, that the drops happen on the wire and not in the
sender's own stack (whose TCP would know and give up), that a reply can be delayed, that teardown
leaves nothing behind but touches nothing it did not make, and that the fixture skips saying why
where namespaces are not allowed. Each test waits 5 s at most."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import dbname_of
from psycopg.conninfo import conninfo_to_dict

from partition import netns
from partition.netns import Lines, PartitionHost, host_or_skip, link_exists, netns_names

# connects with a 2 s connect_timeout (psycopg's least), runs select 1; prints "<seconds> <outcome>"
CONNECT = """
import sys, time, psycopg
t = time.monotonic()
try:
    with psycopg.connect(sys.argv[1], connect_timeout=2) as c:
        out = f"select {c.execute('select 1').fetchone()[0]}"
except psycopg.OperationalError as e:
    out = f"failed: {e}"
print(f"{time.monotonic() - t:.3f} {out}")
"""

# one connection kept open: "ready", then for each line read, select 1 and "result 1 <seconds>"
SESSION = """
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1], connect_timeout=3, autocommit=True)
print("ready")
for _ in sys.stdin:
    t = time.monotonic()
    v = conn.execute("select 1").fetchone()[0]
    print(f"result {v} {time.monotonic() - t:.3f}")
"""

# what the namespace's loopback says on the server's port (nothing of the root namespace is there)
LOOPBACK = """
import socket, sys
s = socket.socket()
s.settimeout(3)
try:
    s.connect(("127.0.0.1", int(sys.argv[1])))
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""


def connect(host: PartitionHost, url: str) -> tuple[float, str]:
    out, err = host.python(CONNECT, url).communicate(timeout=20)
    assert out, err
    seconds, outcome = out.strip().split(" ", 1)
    return float(seconds), outcome


class Session:
    """A SESSION child inside ``host``."""

    def __init__(self, host: PartitionHost, url: str) -> None:
        self.proc = host.python(SESSION, url)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.lines = Lines(self.proc.stdout)
        ready = self.lines.next(15)
        assert ready == "ready\n", f"{ready!r}; {self.stderr()}"

    def stderr(self) -> str:
        """The child's stderr if it has ended (reading a live one's could block)."""
        if self.proc.poll() is None or self.proc.stderr is None:
            return "still running"
        return f"exit {self.proc.returncode}: {self.proc.stderr.read().strip()}"

    def send(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("q\n")
        self.proc.stdin.flush()

    def result(self, timeout: float) -> float | None:
        """The seconds the query took, or None if no answer came within ``timeout``."""
        line = self.lines.next(timeout)
        if line is None:
            return None
        if not line:
            self.proc.wait(5)
            raise AssertionError(f"the session's connection died ({self.stderr()})")
        assert line.startswith("result 1 "), f"{line!r}; {self.stderr()}"
        return float(line.split()[2])

    def query(self, timeout: float = 10) -> float:
        self.send()
        seconds = self.result(timeout)
        assert seconds is not None, f"select 1 did not return within {timeout} s"
        return seconds


def qdiscs(host: PartitionHost) -> dict[str, str]:
    """The qdiscs of the wire's two ports and of the two ends' own veths."""
    def show(*where: str) -> str:
        return netns._run(netns.TC, *where[:-1], "qdisc", "show", "dev", where[-1]).stdout.strip()
    return {"tohost": show("-n", host.wire, netns.WIRE_TO_HOST),
            "toroot": show("-n", host.wire, netns.WIRE_TO_ROOT),
            "root end": show(host.root_if), "host end": show("-n", host.name, host.ns_if)}


def test_the_namespace_reaches_postgres_through_the_relay_only(partition_host: PartitionHost,
                                                               pg_server: str) -> None:
    h = partition_host
    assert h.name == f"lf-{os.getpid()}-{h.name.rsplit('-', 1)[1]}" and h.name in netns_names()
    assert link_exists(h.root_if)
    assert h.net is not None and h.net.prefixlen == 30 and h.net.is_private
    assert {h.root_ip, h.ns_ip} == {str(a) for a in h.net.hosts()}
    # the kernel's own routes of its address (local, broadcast) lie inside it; nothing else may touch it
    clashes = [n for n in netns.networks_in_use() if n.overlaps(h.net) and not n.subnet_of(h.net)]
    assert not clashes, f"{h.net} overlaps {clashes}"

    seconds, outcome = connect(h, h.url(dbname_of(pg_server)))
    assert outcome == "select 1" and seconds < 2
    assert h.relay is not None and h.relay.accepted == 1
    # lo is up inside (else: "network unreachable") and the server's loopback is not there
    port = str(conninfo_to_dict(pg_server).get("port") or 5432)
    out, _ = h.python(LOOPBACK, port).communicate(timeout=10)
    assert out.strip() == "ConnectionRefusedError"


def test_cut_is_silent_and_heal_resumes(partition_host: PartitionHost, pg_server: str) -> None:
    h = partition_host
    assert h.relay is not None
    print(f"cut method: {h.cut_method}")
    url = h.url(dbname_of(pg_server))
    session = Session(h, url)
    assert session.query() < 1
    accepted = h.relay.accepted

    h.cut()
    if h.cut_method in netns.QDISCS:  # on the wire, not on either end's own veth
        kind = netns.QDISCS[h.cut_method][0]
        q = qdiscs(h)
        assert f"qdisc {kind}" in q["tohost"] and f"qdisc {kind}" in q["toroot"], q
        assert kind not in q["root end"] and kind not in q["host end"], q
    session.send()  # a query in flight through the cut
    sent = time.monotonic()
    seconds, outcome = connect(h, url)  # meanwhile, a new connection
    assert outcome.startswith("failed:") and "timeout" in outcome, outcome
    assert "refused" not in outcome and "reset" not in outcome, outcome
    assert seconds >= 1.9, f"the attempt ended after {seconds} s: not by its timeout"
    if h.cut_method in netns.QDISCS:
        assert h.relay.accepted == accepted, "a SYN crossed the cut"
    assert session.result(0.1) is None, "the query returned through the cut"
    assert session.proc.poll() is None, "the open connection broke (it should hear nothing)"
    assert time.monotonic() - sent >= 2

    h.heal()
    assert not any("netem" in q or "pfifo" in q for q in qdiscs(h).values()), qdiscs(h)
    held = session.result(10)  # the same query, on the same connection: TCP carried on
    assert held is not None, "the query in flight did not come back after heal()"
    assert held >= 2
    seconds, outcome = connect(h, url)
    assert outcome == "select 1" and seconds < 2
    assert session.query() < 1


def test_a_connection_outlives_a_cut_that_kills_an_own_stack_drop(partition_host: PartitionHost,
                                                                  pg_server: str) -> None:
    """The drops are on the wire, not in front of the sender's TCP. A drop in the sender's own
    stack tells its TCP, which then probes every 0.5 s and aborts with ETIMEDOUT after
    tcp_retries2 probes (15: ~8 s); a real partition only holds TCP back, and it backs off for
    tcp_retries2 exponential rounds (15: ~15 min). With tcp_retries2 = 5 in the host (to keep the
    test short) the first gives up after ~3 s, the second after 12.6 s: a 5 s cut tells them apart."""
    h = partition_host
    h.sysctl("net.ipv4.tcp_retries2", 5)
    session = Session(h, h.url(dbname_of(pg_server)))
    assert session.query() < 1
    h.cut()
    session.send()
    assert session.result(5) is None, "the query returned through the cut"
    assert session.proc.poll() is None


def test_delay_replies_holds_an_answer_in_flight(partition_host: PartitionHost, pg_server: str) -> None:
    h = partition_host
    session = Session(h, h.url(dbname_of(pg_server)))
    assert session.query() < 1
    h.delay_replies(3)
    seconds = session.query(timeout=10)
    assert 3 <= seconds < 5, seconds
    h.delay_replies(0)
    assert session.query() < 1


def test_delay_answer_to_holds_one_chosen_answer_only(partition_host: PartitionHost, pg_server: str) -> None:
    h = partition_host
    assert h.relay is not None
    trapped, other = (Session(h, h.url(dbname_of(pg_server))) for _ in range(2))
    h.relay.delay_answer_to(b"select 1", 2.5)
    trapped.send()  # the first to send it is the one held
    deadline = time.monotonic() + 5
    while h.relay.trapped == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time_other = other.query()  # meanwhile, another connection's same call is untouched
    seconds = trapped.result(10)
    assert seconds is not None and 2.5 <= seconds < 4.5, seconds
    assert time_other < 1 and h.relay.trapped == 1
    assert trapped.query() < 1, "a trap holds one answer, not the connection's next ones"


def test_teardown_removes_what_it_made_and_nothing_else(pg_server: str) -> None:
    url_db = dbname_of(pg_server)
    with host_or_skip(pg_server) as other:
        with pytest.raises(RuntimeError, match="the test failed"), host_or_skip(pg_server) as h:
            # a process group of two inside: sh, and a sleep it started in the background
            sh = h.popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
            assert sh.stdout is not None
            grandchild = int(sh.stdout.readline())
            h.cut()
            h.delay_replies(1)
            assert {h.name, h.wire} <= netns_names() and link_exists(h.root_if)
            assert h.net is not None and other.net is not None and not h.net.overlaps(other.net)
            relay_port = h.relay.port if h.relay else 0
            raise RuntimeError("the test failed")
        assert sh.returncode == -9
        status = Path(f"/proc/{grandchild}/status")
        assert not status.exists() or "State:\tZ" in status.read_text(), "the sleep outlived teardown"
        assert h.name not in netns_names() and h.wire not in netns_names()
        assert not link_exists(h.root_if)
        assert not any(n.overlaps(h.net) for n in netns.networks_in_use()), "its address is still there"
        assert relay_port and h.relay is None
        # the other host is untouched and still works
        assert {other.name, other.wire} <= netns_names() and link_exists(other.root_if)
        assert connect(other, other.url(url_db))[1] == "select 1"
    assert not {other.name, other.wire} & netns_names() and not link_exists(other.root_if)


def test_skips_saying_why_where_namespaces_are_not_allowed(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           pg_server: str) -> None:
    fake = tmp_path / "ip"  # an `ip` as a container without CAP_SYS_ADMIN answers
    fake.write_text("#!/bin/sh\necho 'mount --make-shared /run/netns failed: Operation not permitted' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(netns, "IP", str(fake))
    monkeypatch.delenv("LANEFLEET_REQUIRE_NETNS", raising=False)
    with pytest.raises(pytest.skip.Exception,
                       match=r"^network namespaces are not allowed here: `ip netns add lf-\d+-\d+`: "
                             r"mount --make-shared /run/netns failed: Operation not permitted$"):
        with host_or_skip(pg_server):
            pytest.fail("the body ran")
    monkeypatch.setenv("LANEFLEET_REQUIRE_NETNS", "1")
    with pytest.raises(pytest.fail.Exception, match="LANEFLEET_REQUIRE_NETNS is set"):
        with host_or_skip(pg_server):
            pass
    monkeypatch.delenv("LANEFLEET_REQUIRE_NETNS")
    monkeypatch.setattr(netns, "IP", "/nonexistent/ip")
    with pytest.raises(pytest.skip.Exception, match="iproute2 is not installed"):
        with host_or_skip(pg_server):
            pass
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match=r"needs root \(euid 1000\)"):
        with host_or_skip(pg_server):
            pass


def test_a_slash30_overlaps_nothing_in_use() -> None:
    net = ipaddress.IPv4Network
    assert netns.free_slash30([], seed=0) == net("10.213.0.0/30")
    assert netns.free_slash30([], seed=5) == net("10.213.0.20/30")
    assert netns.free_slash30([net("10.213.0.20/31")], seed=5) == net("10.213.0.24/30")
    assert netns.free_slash30([net("10.213.0.0/16")], seed=1) == net("10.187.0.4/30")
    assert netns.free_slash30([net("10.0.0.0/8")], seed=0) == net("169.254.213.0/30")
    with pytest.raises(netns.HarnessError, match="no free /30"):
        netns.free_slash30([net("0.0.0.0/0")], seed=0)
