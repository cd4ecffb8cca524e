"""The console's actions and its access rules, through real HTTP against a real console: each POST
calls the store's method (the CLI's SQL function) and says what it answered; without the CSRF
token, from another origin, or on a read-only console it is refused and changes nothing; a
lane-scoped key sees and acts on its own lanes only; a non-loopback bind needs a credential."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest
from fleetkit import ROOT, Fleet, one_line

from web.conftest import csrf_of
from web.world import build


def post(c: httpx.Client, path: str, csrf: str | None, **form: Any) -> httpx.Response:
    data = {**form, **({"csrf": csrf} if csrf is not None else {})}
    return c.post(path, data=data)


def flash_after(c: httpx.Client, r: httpx.Response) -> str:
    assert r.status_code == 303, r.text
    page = c.get(r.headers["location"]).text
    return page.split('data-flash="', 1)[1].split("</p>", 1)[0]


def states(fleet: Fleet) -> dict[str, str]:
    return {r["key"]: r["state"] for r in fleet.sql("select key, state from fleet.tasks")}


def test_approve_reject_resume_and_retry_through_posts_change_the_database(fleet: Fleet, console) -> None:
    ids = build(fleet)
    second = fleet.enqueue("work", "second", {"steps": 1, "sleep": 0.02})
    fleet.run_shift("work", max_tasks=1)
    assert fleet.task(second)["state"] == "review"
    web = console()
    with web.client() as c:
        csrf = csrf_of(c.get("/queues").text)
        said = flash_after(c, post(c, f"/act/approve/{ids['reviewed']}", csrf, note="looks right", next="/queues"))
        assert said.startswith('ok"') and f"fleet.review_approve({ids['reviewed']}) answered: done" in said
        assert fleet.task(ids["reviewed"])["state"] == "done"

        empty = flash_after(c, post(c, f"/act/reject/{second}", csrf, note="  ", next="/queues"))
        assert "reject needs a note" in empty and fleet.task(second)["state"] == "review"
        said = flash_after(c, post(c, f"/act/reject/{second}", csrf, note="keep the API", next="/queues"))
        assert f"fleet.review_reject({second}) answered: queued" in said
        assert fleet.task(second)["state"] == "queued"

        said = flash_after(c, post(c, f"/act/resume/{ids['gated']}", csrf, next="/queues"))
        assert f"fleet.resume({ids['gated']}) answered: queued" in said
        assert fleet.task(ids["gated"])["state"] == "queued"
        said = flash_after(c, post(c, f"/act/retry/{ids['doomed']}", csrf, next="/queues"))
        assert f"fleet.retry({ids['doomed']}) answered: queued" in said
        assert fleet.task(ids["doomed"])["state"] == "queued"

        # a wrong state is the function's refusal, shown as it is, and changes nothing
        before = states(fleet)
        said = flash_after(c, post(c, f"/act/resume/{ids['waiting']}", csrf, next="/queues"))
        assert said.startswith('error"') and f"fleet.resume({ids['waiting']})" in said
        assert states(fleet) == before
        # an unsafe `next` never leaves the console
        r = post(c, f"/act/cancel/{ids['waiting']}", csrf, next="//evil.example/")
        assert r.headers["location"] == "/" and fleet.task(ids["waiting"])["state"] == "cancelled"


def test_a_post_without_the_csrf_token_or_from_another_origin_is_refused(fleet: Fleet, console) -> None:
    ids = build(fleet)
    web = console()
    before = states(fleet)
    with web.client() as c:
        csrf = csrf_of(c.get("/queues").text)
        for token in (None, "", "forged" + csrf[6:]):
            r = post(c, f"/act/approve/{ids['reviewed']}", token)
            assert r.status_code == 403 and "CSRF" in r.text
        r = c.post(f"/act/approve/{ids['reviewed']}", data={"csrf": csrf}, headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and "another origin" in r.text
    with web.client() as stranger:  # another browser: no session, so no token of its own
        r = post(stranger, f"/act/approve/{ids['reviewed']}", csrf)
        assert r.status_code == 403
    assert states(fleet) == before


def test_a_read_only_console_shows_no_forms_and_refuses_posts(fleet: Fleet, console) -> None:
    ids = build(fleet)
    web = console(read_only=True)
    before = states(fleet)
    with web.client() as c:
        page = c.get("/queues").text
        assert 'data-action="' not in page and "read-only" in page
        csrf = csrf_of(c.get("/login").text)
        r = post(c, f"/act/approve/{ids['reviewed']}", csrf)
        assert r.status_code == 403 and "read-only" in r.text
    assert states(fleet) == before


# the console token is the Postgres back-end's credential; over Supabase each person's key (below)
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_a_console_token_guards_a_console_beyond_loopback(fleet: Fleet, console) -> None:
    ids = build(fleet)
    web = console(loopback=False, token="a-console-token-of-this-test")
    with web.client() as c:
        r = c.get("/queues")
        assert r.status_code == 303 and r.headers["location"].startswith("/login")
        csrf = csrf_of(c.get("/login").text)
        assert post(c, f"/act/approve/{ids['reviewed']}", csrf).status_code == 403
        assert post(c, "/login", csrf, secret="wrong").status_code == 403
        assert c.get("/queues").status_code == 303
        ok = post(c, "/login", csrf, secret="a-console-token-of-this-test", next="/queues")
        assert ok.status_code == 303 and ok.headers["location"] == "/queues"
        assert c.get("/queues").status_code == 200
        assert c.get("/metrics").status_code == 401  # a scrape brings the token as a Bearer token
    assert fleet.task(ids["reviewed"])["state"] == "review"


# keys are the Supabase back-end's (on Postgres one console token works every lane)
@pytest.mark.parametrize("backend", ["supabase"], indirect=True)
def test_a_lane_scoped_key_sees_and_acts_on_its_lanes_only(fleet: Fleet, console) -> None:
    ids = build(fleet)
    web = console(host_key=False)
    other_key = fleet.backend.key("operator", ["other"])
    worker_key = fleet.backend.key("worker", ["other"])
    before = states(fleet)
    with web.client() as c:
        assert c.get("/").headers["location"].startswith("/login")
        csrf = csrf_of(c.get("/login").text)
        refused = post(c, "/login", csrf, secret=worker_key)
        assert refused.status_code == 403 and "needs an operator key" in refused.text
        assert post(c, "/login", csrf, secret="not.a.key").status_code == 403
        assert post(c, "/login", csrf, secret=other_key).status_code == 303

        home = c.get("/").text
        assert 'data-lane="other"' in home and 'data-lane="work"' not in home
        tasks = c.get("/tasks").text
        assert f'data-task="{ids["reviewed"]}"' not in tasks and f'data-task="{ids["gated"]}"' in tasks
        assert c.get(f"/tasks/{ids['reviewed']}").status_code == 404  # as if it did not exist
        assert f'data-task="{ids["reviewed"]}"' not in c.get("/queues").text
        # a direct request for another lane's task: the SQL function's own check refuses it
        said = flash_after(c, post(c, f"/act/approve/{ids['reviewed']}", csrf, next="/queues"))
        assert said.startswith('error"') and "unknown task" in said.lower()
        assert states(fleet) == before
        # and on its own lane it acts
        said = flash_after(c, post(c, f"/act/resume/{ids['gated']}", csrf, next="/queues"))
        assert "answered: queued" in said and fleet.task(ids["gated"])["state"] == "queued"


def test_a_non_loopback_bind_without_a_credential_refuses_to_start(fleet: Fleet) -> None:
    env = fleet.env("operator")
    if fleet.backend.rest:
        env["CONSOLE_TOKEN"] = "sixteen-chars-at-least"
        line = one_line(fleet.cli("web", "--bind", "0.0.0.0:0", "--token-env", "CONSOLE_TOKEN", env=env))
        assert "--token-env is for the Postgres back-end" in line
        return
    line = one_line(fleet.cli("web", "--bind", "0.0.0.0:0", env=env, timeout=60))
    assert "needs a credential: --token-env NAME" in line
    assert "--bind 'nowhere' is not HOST:PORT" in one_line(fleet.cli("web", "--bind", "nowhere"))
    assert "is not set" in one_line(fleet.cli("web", "--bind", "0.0.0.0:0", "--token-env", "NO_SUCH_VAR_X"))
    listed = subprocess.run([sys.executable, "-m", "monitor.cli", "--help"], cwd=ROOT, capture_output=True,
                            text=True).stdout
    assert "│ web " in listed and "The live console" in listed


def test_fleet_web_serves_the_fleet_of_its_config(fleet: Fleet) -> None:
    """`fleet web` itself, as a host runs it: the config's store (Supabase's API with the host's
    operator key on the supabase back-end), on a free loopback port, stopped by its pid."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    task = fleet.enqueue("other", "served", {})
    proc = subprocess.Popen([sys.executable, "-m", "monitor.cli", "web", "--bind", f"127.0.0.1:{port}"],
                            cwd=ROOT, env=fleet.env("operator"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "fleet web did not answer in 60 s"
            time.sleep(0.2)
        page = httpx.get(f"http://127.0.0.1:{port}/tasks", params={"lane": "other"}, timeout=30)
        assert page.status_code == 200 and f'data-task="{task}"' in page.text
        assert fleet.backend.name in page.text.split('class="who"', 1)[1][:100]  # the store it reads
    finally:
        proc.terminate()
        proc.wait(20)
