"""One real stack and one headless chromium per module (starting them is the slow part)."""

from __future__ import annotations

import pytest

from tests.ui.browser import chromium, open_console
from tests.ui.stack import console_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with console_stack(tmp_path_factory.mktemp("console")) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    with chromium() as context:
        yield context


class Tabs:
    """Console tabs opened by one test (each tab has its own session storage)."""

    def __init__(self, context) -> None:
        self.context = context
        self.opened = []

    def open(self, base_url: str, token: str | None):
        page = open_console(self.context, base_url, token)
        self.opened.append(page)
        return page


@pytest.fixture
def tabs(browser):
    t = Tabs(browser)
    yield t
    for page in t.opened:
        page.close()
