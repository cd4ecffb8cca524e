"""Hosting shifts: launch them as subprocesses, never past a lane's ``max_shifts``, stop them cleanly.

Used by ``fleet run`` (APScheduler: each lane's cron expression launches a shift, the monitor
runs on its interval) and by ``fleet up`` (keep a shift on every lane that has work). A shift is
a separate process, so one that crashes takes nothing else down, and the monitor repairs its
work. On stop every shift gets SIGTERM — it hands off and closes its session — and whatever has
not exited after its grace is killed, by pid, only the processes this host started.

A lane has ``max_shifts`` slots on a host, one lock file each (:func:`slot_lock`, in
``<home>/cron`` by default): a launched shift holds its slot's ``flock`` for as long as it lives
(the kernel lets go when it exits, however it exits), the one the ``flock -n`` guards of
``fleet crontab`` take. So two ``fleet run`` in one directory, or one beside its crontab, never
run more than ``max_shifts`` of a lane between them.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from worker.config import FleetConfig, cron_trigger, supabase_setting
from worker.errors import ConfigError

log = structlog.get_logger("lanefleet.host")


@dataclass
class ShiftLauncher:
    cfg: FleetConfig
    env: dict[str, str]
    extra_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    #: where the lane's slot locks are (:func:`slot_lock`); None: only this launcher's count
    lock_dir: Path | None = None
    running: dict[str, list[subprocess.Popen[bytes]]] = field(default_factory=dict)
    launched: dict[str, int] = field(default_factory=dict)
    max_seen: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def command(self, lane: str, extra: list[str] | None = None) -> list[str]:
        return [sys.executable, "-m", "monitor.cli", "shift", "--lane", lane, *self.extra_args, *(extra or [])]

    def reap(self) -> None:
        with self._lock:
            for lane, procs in self.running.items():
                self.running[lane] = [p for p in procs if p.poll() is None]

    def count(self, lane: str) -> int:
        self.reap()
        return len(self.running.get(lane, []))

    def launch(self, lane: str, extra: list[str] | None = None) -> subprocess.Popen[bytes] | None:
        """Start a shift of ``lane`` unless it already runs ``max_shifts`` of them."""
        limit = self.cfg.lane(lane).max_shifts
        self.reap()
        with self._lock:
            procs = self.running.setdefault(lane, [])
            if len(procs) >= limit:
                log.info("shift not launched: lane at max_shifts", lane=lane, max_shifts=limit)
                return None
            slot = None if self.lock_dir is None else self._take_slot(self.lock_dir, lane, limit)
            if self.lock_dir is not None and slot is None:
                log.info("shift not launched: the lane's max_shifts slots on this host are held by shifts "
                         "another launcher started", lane=lane, max_shifts=limit, lock_dir=str(self.lock_dir))
                return None
            out = subprocess.DEVNULL  # (an int too: only a log opened here is closed below)
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                # its owner's alone: a shift's errors may name hosts, users and paths of the fleet's
                out = os.open(self.log_dir / f"shift-{lane}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                os.fchmod(out, 0o600)  # (one an older lanefleet made)
            try:
                # the shift inherits its slot's lock and holds it until it exits
                proc = subprocess.Popen(self.command(lane, extra), env=self.env, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=out, pass_fds=() if slot is None else (slot,))
            finally:
                if out != subprocess.DEVNULL:
                    os.close(out)
                if slot is not None:
                    os.close(slot)  # this process's copy: the lock stays the shift's
            procs.append(proc)
            self.launched[lane] = self.launched.get(lane, 0) + 1
            self.max_seen[lane] = max(self.max_seen.get(lane, 0), len(procs))
        log.info("shift launched", lane=lane, pid=proc.pid)
        return proc

    @staticmethod
    def _take_slot(folder: Path, lane: str, limit: int) -> int | None:
        """A descriptor holding the lock of a free slot of ``lane`` in ``folder``; None when all
        ``limit`` are held."""
        # its owner's alone, as the crontab's lines make it: the crontab's logs go here too, and
        # `mkdir -p -m 700` leaves the mode of a folder that exists as it is
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for i in range(limit):
            fd = os.open(slot_lock(folder, lane, i), os.O_RDONLY | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return fd
        return None

    def stop_all(self, grace: float | None = None) -> None:
        """SIGTERM every shift (they hand off), then SIGKILL what outlives the grace."""
        self.reap()
        procs = [p for ps in self.running.values() for p in ps]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        if grace is None:
            grace = max((lane.grace_seconds for lane in self.cfg.lanes.values()), default=10.0) + 10.0
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("shift did not stop in time; killing it", pid=p.pid)
                p.kill()
                p.wait()
        self.reap()


def slot_lock(lock_dir: Path, lane: str, slot: int) -> Path:
    """The lock file of a lane's shift slot ``slot`` (0 … max_shifts - 1) in ``lock_dir``."""
    return lock_dir / f"shift-{lane}-{slot}.lock"


def default_lock_dir(cfg: FleetConfig) -> Path:
    """Where the slot locks (and the crontab's logs) of this config's host are: ``[fleet] cron_dir``,
    else ``<home>/cron``. One folder for every launcher, so that they share the lanes' slots."""
    folder = cfg.fleet.cron_dir
    return (cfg.path(folder) if folder is not None else cfg.path(cfg.fleet.home) / "cron").resolve()


def shift_env(cfg: FleetConfig, url: str | None, config_path: Path | None) -> dict[str, str]:
    """The environment of a launched shift: the same database and config as this host.

    ``url`` None: the Supabase store, whose settings come from the config and the environment; the
    shift then gets the host's worker key (``[supabase] worker_key`` or FLEET_WORKER_KEY) as its
    fleet key, since this host's own key is an operator's (its monitor passes repair other
    sessions' tasks, which no worker key may do)."""
    env = dict(os.environ)
    if url is not None:
        env["DATABASE_URL"] = url
    else:
        env["FLEET_SUPABASE__KEY"] = worker_key(cfg, env)
    if config_path is not None:
        env["FLEET_CONFIG"] = str(config_path.resolve())
    elif cfg.source is not None:
        env["FLEET_CONFIG"] = str(cfg.source)
    return env


def worker_key(cfg: FleetConfig, environ: Mapping[str, str]) -> str:
    """The worker key a host hands the shifts it launches on the Supabase store; a clear error when
    there is none or it is not a worker's."""
    key = supabase_setting(cfg, "worker_key", environ)
    if not key:
        raise ConfigError("`fleet run` on the supabase store needs [supabase] worker_key (or FLEET_WORKER_KEY): "
                          "the worker key its shifts use; [supabase] key (or FLEET_KEY) is the operator key of its monitor",
                          "mint one with `fleet keys mint --role worker --lane L ...`")
    role = _role(key, environ)
    if role != "fleet_worker":
        raise ConfigError(f"[supabase] worker_key (or FLEET_WORKER_KEY) is a key for role {role!r}, not fleet_worker",
                          "mint one with `fleet keys mint --role worker --lane L ...`")
    return key


def require_operator_key(cfg: FleetConfig, environ: Mapping[str, str], command: str) -> None:
    """On the supabase store, a monitor (``fleet monitor``, ``fleet run``'s) works with an operator
    key: its repair pass is fleet-wide, which a worker key may not call. Said before anything
    runs, rather than after a first pass that repaired and then failed."""
    key = supabase_setting(cfg, "key", environ)
    if cfg.fleet.store != "supabase" or not key:
        return  # (no key: the store says what is missing)
    role = _role(key, environ)
    if role not in ("fleet_operator", "service_role"):
        raise ConfigError(f"`{command}` on the supabase store needs an operator key as [supabase] key (or FLEET_KEY): "
                          f"its monitor's repair pass is fleet-wide; this is a key for role {role!r}",
                          "mint one with `fleet keys mint --role operator`")


def _role(key: str, environ: Mapping[str, str]) -> Any:
    from worker.store.keys import describe_key

    return describe_key(key, environ).get("role")


#: flock's exit code when the lock is held (EX_TEMPFAIL), told apart from a shift's own exit codes
SLOT_HELD = 75


def crontab_lines(cfg: FleetConfig, *, fleet_bin: str, workdir: Path, config: Path | None,
                  lock_dir: Path) -> list[str]:
    """System crontab lines equivalent to ``fleet run``: a shift per lane, the monitor each minute.

    ``flock -n`` keeps a lane from running more shifts than it may: one lock file per shift slot,
    tried in turn (``max_shifts`` of them), the ones a :class:`ShiftLauncher` takes; the next slot
    is tried only when one is held (exit code :data:`SLOT_HELD`), not after a shift that failed.
    Each line makes ``lock_dir`` (its owner's alone: the logs name hosts, users and paths) first:
    cron would not run a line whose log's folder is missing.
    """
    cfg_arg = f" --config {shlex.quote(str(config.resolve()))}" if config else ""
    folder = shlex.quote(str(lock_dir))
    prelude = f"mkdir -p -m 700 {folder} && cd {shlex.quote(str(workdir.resolve()))} && "
    lines = ["# lanefleet: generated by `fleet crontab`", "SHELL=/bin/bash"]
    for name, lane in sorted(cfg.lanes.items()):
        if not lane.cron:
            lines.append(f"# lane {name}: no cron expression, not scheduled")
            continue
        fields = lane.cron.split()
        if len(fields) == 6:
            lines.append(f"# lane {name}: cron has a seconds field ({lane.cron}); cron runs it each minute")
            fields = fields[1:]
        locks = f" || [ $? -ne {SLOT_HELD} ] || ".join(
            f"flock -n -E {SLOT_HELD} {shlex.quote(str(slot_lock(lock_dir, name, i)))} "
            f"{shlex.quote(fleet_bin)}{cfg_arg} shift --lane {shlex.quote(name)}"
            for i in range(lane.max_shifts)
        )
        command = f"{prelude}{{ {locks}; }} >> {shlex.quote(str(lock_dir / f'shift-{name}.log'))} 2>&1"
        lines.append(f"{' '.join(fields)} {cron_escaped(command)}")
    command = (f"{prelude}flock -n {shlex.quote(str(lock_dir / 'monitor.lock'))} "
               f"{shlex.quote(fleet_bin)}{cfg_arg} monitor --once >> {shlex.quote(str(lock_dir / 'monitor.log'))} 2>&1")
    lines.append(f"{monitor_schedule(cfg.fleet.monitor_every)} {cron_escaped(command)}")
    return lines


def cron_escaped(command: str) -> str:
    """``command`` as a crontab line says it: cron turns an unescaped ``%`` into a newline (and
    passes ``\\%`` on as ``%``), so a path with one would cut the command short."""
    return command.replace("%", "\\%")


def monitor_schedule(seconds: float) -> str:
    """Cron fields for a monitor every ``seconds``: cron's unit is the minute (less is rounded up
    to a minute), and a step in the minute field cannot exceed an hour (``*/120`` would run hourly)."""
    minutes = max(1, round(seconds / 60))
    if minutes < 60:
        return f"*/{minutes} * * * *"
    hours = max(1, round(minutes / 60))
    if hours < 24:
        return f"0 */{hours} * * *"
    days = max(1, round(hours / 24))
    return "0 0 * * *" if days == 1 else f"0 0 */{days} * *"


def validate_schedules(cfg: FleetConfig) -> None:
    for lane in cfg.lanes.values():
        if lane.cron:
            cron_trigger(lane.cron)
