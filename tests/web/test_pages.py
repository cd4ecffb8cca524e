"""Every page of the console, served for real (uvicorn, httpx), with the data of a real database
on both back-ends: a task that ran in a real shift, and the queues a person acts on."""

from __future__ import annotations

import re

from fleetkit import Fleet

from web.world import build


def rows_of(html: str, attr: str) -> list[str]:
    return re.findall(rf'<tr {attr}="([^"]+)"', html)


def test_every_page_renders_with_the_data(fleet: Fleet, console) -> None:
    ids = build(fleet)
    web = console()
    with web.client() as c:
        home = c.get("/")
        assert home.status_code == 200, home.text
        assert rows_of(home.text, "data-lane") == ["other", "work"]
        assert rows_of(home.text, "data-pool") == ["max"]
        assert rows_of(home.text, "data-window") == ["max/five_hour"]  # fleet.pool_windows
        work = home.text.split('data-lane="work"')[1].split("</tr>")[0]
        # the view's figures: one stage done in the last 24 h, a sparkline of it per hour
        assert re.search(r'data-col="done">1<', work), work
        assert 'class="spark" data-series="work"' in work
        assert home.headers["content-security-policy"].startswith("default-src 'self'")
        assert "lf_console" in home.headers["set-cookie"] and "samesite=strict" in home.headers["set-cookie"].lower()

        tasks = c.get("/tasks").text
        assert set(rows_of(tasks, "data-task")) == {str(i) for i in ids.values()}
        assert rows_of(c.get("/tasks", params={"lane": "other"}).text, "data-task") == [
            str(ids["waiting"]), str(ids["doomed"]), str(ids["gated"])]
        assert rows_of(c.get("/tasks", params={"state": "review"}).text, "data-task") == [str(ids["reviewed"])]
        assert rows_of(c.get("/tasks", params={"q": "oome"}).text, "data-task") == [str(ids["doomed"])]
        assert rows_of(c.get("/tasks", params={"key": "waiting", "lane": "other"}).text, "data-task") == [
            str(ids["waiting"])]
        bad = c.get("/tasks", params={"state": "sleeping"})
        assert bad.status_code == 400 and "state &#39;sleeping&#39; is not a task state" in bad.text

        page = c.get(f"/tasks/{ids['reviewed']}").text
        assert 'data-state="review"' in page
        [run] = fleet.runs(ids["reviewed"])
        assert f'data-run="{run["id"]}"' in page and "m-small" in page and "mechanical" in page
        assert run["input_tokens"] > 0
        for kind in ("enqueued", "claimed", "completed"):
            assert f'data-kind="{kind}"' in page
        assert "data-log>" in page, "the log of the finished run is under the fleet's workspaces: shown"
        assert "Approve" in page and "Reject" in page
        assert fleet.task(ids["reviewed"])["checkpoint"] is not None and "Checkpoint (#" in page
        assert c.get("/tasks/987654").status_code == 404

        queues = c.get("/queues").text
        review = queues.split('id="review"')[1].split('id="blocked"')[0]
        blocked = queues.split('id="blocked"')[1].split('id="dead"')[0]
        dead = queues.split('id="dead"')[1].split('id="attention"')[0]
        assert rows_of(review, "data-task") == [str(ids["reviewed"])]
        assert rows_of(blocked, "data-task") == [str(ids["gated"])] and "no tests ran" in blocked
        assert rows_of(dead, "data-task") == [str(ids["doomed"])] and "boom" in dead
        assert 'data-action="resume"' in blocked and 'data-action="retry"' in dead

        assert "no batches" in c.get("/batches").text
        history = c.get("/history", params={"window": "1h"}).text
        assert re.search(r'data-figure="tasks">4<', history), history
        assert c.get("/history", params={"window": "soon"}).status_code == 400


def test_the_console_serves_metrics_with_the_pools_windows(fleet: Fleet, console) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    build(fleet)
    web = console()
    with web.client() as c:
        got = c.get("/metrics")
    assert got.status_code == 200, got.text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(got.text) for s in f.samples}
    used = fleet.sql("select utilization from fleet.pool_windows where pool = 'max'")[0]["utilization"]
    assert samples[("lanefleet_pool_window_utilization", (("pool", "max"), ("window", "five_hour")))] == float(used)
    ready = fleet.sql("select count(*) as n from fleet.tasks where lane = 'work' and state = 'queued' and run_at <= now()")
    assert samples[("lanefleet_tasks_ready", (("lane", "work"),))] == ready[0]["n"]
