"""Debian's chromium driven by Playwright (``executable_path``: Playwright's own browser download is
not available here), installed with apt-get when it is missing and we are root, as in CI."""

from __future__ import annotations

from collections.abc import Iterator

from chromiumkit import chromium_path as chromium_of
from playwright.sync_api import Browser, sync_playwright


def chromium_path() -> str:
    return chromium_of("the console's browser tests")


def launch() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-quic"])
        try:
            yield browser
        finally:
            browser.close()
