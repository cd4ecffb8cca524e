"""The console in a real headless Chromium (Debian's, driven by Playwright) against a real
database with real shifts: the lanes page follows the fleet without a reload, approving a review
in the page moves the task to done, and every page fits 1280 and 390 px wide screens (screenshots
kept under the test's tmp folder)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from fleetkit import ROOT, Fleet

from web.world import QUICK, build

WIDTHS = (1280, 390)


def test_the_lanes_page_updates_when_a_task_finishes(fleet: Fleet, console, browser) -> None:
    web = console()
    page = browser.new_page()
    page.goto(web.url + "/")
    done = page.locator('tr[data-lane="other"] td[data-col="done"]')
    assert done.inner_text() == "0"
    page.evaluate("window.__sameDocument = 'yes'")

    task = fleet.enqueue("other", "finishes", {"steps": 2, "sleep": 0.3})
    shift = threading.Thread(target=fleet.run_shift, args=("other",), kwargs={"max_tasks": 1})
    shift.start()
    # running, then done: each seen by the page's own refresh
    page.wait_for_function("""() => document.querySelector('tr[data-lane="other"] td[data-col="running"]')
                              .textContent.trim() === '1'""", timeout=20000)
    page.wait_for_function("""() => document.querySelector('tr[data-lane="other"] td[data-col="done"]')
                              .textContent.trim() === '1'""", timeout=30000)
    shift.join(30)
    assert fleet.task(task)["state"] == "done"
    assert page.evaluate("window.__sameDocument") == "yes", "the page was reloaded"
    assert int(page.evaluate("document.documentElement.dataset.refreshes")) >= 2
    assert page.evaluate("document.documentElement.dataset.refreshError || ''") == ""
    page.close()


def test_approving_a_review_in_the_page_moves_the_task_to_done(fleet: Fleet, console, browser) -> None:
    task = fleet.enqueue("work", "to-approve", QUICK)
    fleet.run_shift("work", max_tasks=1)
    assert fleet.task(task)["state"] == "review"
    web = console()
    page = browser.new_page()
    page.goto(web.url + "/queues")
    form = page.locator(f'form[data-action="approve"][data-target="{task}"]')
    form.locator('input[name="note"]').fill("reads well")
    form.locator("button").click()
    # (the post, its redirect and the page it lands on: over the Supabase stack on a loaded machine,
    # more than the default 30 s was seen)
    page.wait_for_selector('[data-flash="ok"]', timeout=90_000)
    assert f"fleet.review_approve({task}) answered: done" in page.locator('[data-flash="ok"]').inner_text()
    assert fleet.task(task)["state"] == "done"
    assert fleet.task(task)["finished_at"] is not None
    assert f'data-task="{task}"' not in page.locator("#queues").inner_html(), "it left the review queue"
    page.close()


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_every_page_fits_wide_and_narrow_screens(fleet: Fleet, console, browser, tmp_path: Path) -> None:
    ids = build(fleet)
    web = console()
    paths = ["/", "/tasks", f"/tasks/{ids['reviewed']}", "/queues", "/batches", "/history", "/login"]
    shots = tmp_path / "screenshots"
    shots.mkdir()
    for width in WIDTHS:
        page = browser.new_page(viewport={"width": width, "height": 900})
        for path in paths:
            page.goto(web.url + path)
            page.wait_for_load_state("networkidle")
            scroll, inner = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            name = (path.strip("/").replace("/", "-") or "lanes") + f"-{width}.png"
            page.screenshot(path=str(shots / name), full_page=True)
            assert scroll <= inner, f"{path} at {width} px overflows: {scroll} > {inner} (see {shots / name})"
        page.close()
    assert len(list(shots.glob("*.png"))) == len(paths) * len(WIDTHS)
    if os.environ.get("LANEFLEET_DOCS_SCREENSHOT"):  # the README's picture: made again on purpose only
        shutil.copy(shots / "queues-1280.png", ROOT / "docs" / "console.png")
