"""``github_stand_in()``: a started GitHubStandIn for one test, whose traffic must keep to GitHub's
OpenAPI description: at exit it raises AssertionError listing ``.problems``, if any.

The integrator registers a pytest fixture from it (tests/conftest.py), e.g.::

    @pytest.fixture
    def github() -> Iterator[GitHubStandIn]:
        with github_stand_in() as gh:
            yield gh
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .stand_in import GitHubStandIn


def problems_report(gh: GitHubStandIn) -> str:
    shown = gh.problems[:40]
    more = len(gh.problems) - len(shown)
    return (f"{len(gh.problems)} request(s) or response(s) broke GitHub's OpenAPI description:\n  "
            + "\n  ".join(shown) + (f"\n  … and {more} more" if more > 0 else ""))


@contextmanager
def github_stand_in(**options: Any) -> Iterator[GitHubStandIn]:
    """A started stand-in (``options`` go to GitHubStandIn), stopped at exit; then its problems,
    if any, fail the test (when the block itself raised, they are added to that error as a note)."""
    gh = GitHubStandIn(**options).start()
    try:
        yield gh
    except BaseException as exc:
        gh.stop()
        if gh.problems:
            exc.add_note(problems_report(gh))
        raise
    gh.stop()
    if gh.problems:
        raise AssertionError(problems_report(gh))
