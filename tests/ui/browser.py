"""Debian's chromium driven by Playwright for Python (Playwright's own browser download is
not reachable here): one helper for the browser tests, ``bench/ui.py`` and
``make screenshot``."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from playwright.sync_api import BrowserContext, Page, sync_playwright

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


@contextmanager
def chromium(viewport: dict | None = None, **options) -> Iterator[BrowserContext]:
    """A headless chromium with a fresh user-data-dir, removed on exit; ``options`` go to
    Playwright's ``launch_persistent_context`` (e.g. ``bypass_csp=True`` for a measurement
    that evaluates script in the page, which the console's CSP forbids)."""
    profile = tempfile.mkdtemp(prefix="tpflex-chromium-")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=FLAGS,
                viewport=viewport or {"width": 1400, "height": 900}, **options,
            )
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def open_console(context: BrowserContext, base_url: str, token: str | None) -> Page:
    """A new tab on ``/ui``; with ``token`` it signs in through the login form."""
    page = context.new_page()
    page.goto(base_url + "/ui")
    if token is not None:
        page.fill("#token", token)
        page.click("#login button[type=submit]")
    return page


def preload_token(page: Page, token: str) -> None:
    """Put ``token`` in the tab's session storage before the page loads (what a sign-in
    leaves there), so that a measurement starts at navigation, not at typing."""
    page.add_init_script(f"sessionStorage.setItem('tpflex-console-token', {token!r});")
