"""The operator console in a real browser (Debian's chromium) against the real stack:
etcd, a tpflex-controller process, simulated agents (tests/ui/stack.py)."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.ui.stack import JOB

pytestmark = pytest.mark.slow

CELLS = ".rack .cell"


def cell(page: Page, node: str, index: int):
    return page.locator(f'.rack .cell[data-gpu="{node}:{index}"]')


def replica(page: Page, index: int):
    return page.locator(f'[data-job="{JOB}"] li[data-replica="{index}"]')


def signed_in(stack, tabs, token: str) -> Page:
    page = tabs.open(stack.url, token)
    expect(page.locator(CELLS)).to_have_count(8)
    return page



def test_read_only_token_sees_the_cluster_and_no_actions(stack, tabs):
    page = signed_in(stack, tabs, stack.readonly_token)
    # the token's name (a bare token's: token-<sha256 prefix>) and its scope
    expect(page.locator("#scope")).to_have_text(re.compile(r"^token-[0-9a-f]{8}: read-only$"))
    expect(page.locator("#conn")).to_have_text("live")
    expect(replica(page, 0)).to_have_attribute("data-tp", "4")
    expect(page.locator('[data-count="GPUs"]')).to_have_text("8")
    # the cap in watts on hover, and keyboard navigation inside a rack's grid
    first = cell(page, stack.node(0), 0)
    first.hover()
    expect(page.locator("#tip")).to_contain_text(f"{stack.node(0)} GPU 0:")
    expect(page.locator("#tip")).to_contain_text(" W")
    first.focus()
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.dataset.gpu") == f"{stack.node(0)}:1"
    page.keyboard.press("Enter")
    expect(page.locator("#gpu-title")).to_have_text(f"GPU {stack.node(0)}:1")
    expect(page.locator('[data-fact="power cap"]')).to_contain_text(" W")
    # no action anywhere for a read-only token: no drain, no pin, no preview
    assert page.locator("[data-action]").count() == 0
    assert page.locator("#gpu-actions *").count() == 0
    assert page.locator(f'[data-job="{JOB}"] input').count() == 0


def test_wrong_token_gets_the_login_screen_not_data(stack, tabs):
    page = tabs.open(stack.url, "not-a-token-of-this-cluster")
    expect(page.locator("#login-error")).to_contain_text("not accepted")
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#console")).to_be_hidden()
    assert page.locator(".rack").count() == 0
    assert page.locator("#job-list *").count() == 0
    assert page.evaluate("sessionStorage.getItem('tpflex-console-token')") is None
    # and the data endpoints refuse it outright (the page shows nothing because it gets nothing)
    for headers in ({"Authorization": "Bearer not-a-token-of-this-cluster"}, {}):
        r = httpx.get(f"{stack.url}/v1/console/stream", headers=headers, timeout=5)
        assert r.status_code == 401, r.text
        assert "rack-0" not in r.text


def test_gpu_failure_turns_its_cell_failed_within_2s_and_the_degree_changes(stack, tabs):
    page = signed_in(stack, tabs, stack.readonly_token)
    node = stack.node(0)
    expect(cell(page, node, 2)).to_have_attribute("data-state", "healthy")
    expect(replica(page, 0)).to_have_attribute("data-tp", "4")
    generation = stack.plan()["generation"]
    start = time.monotonic()
    stack.inject(0, 2, "xid79")  # the agent reports XID 79 to etcd
    expect(cell(page, node, 2)).to_have_attribute("data-state", "failed", timeout=2000)
    assert time.monotonic() - start <= 2.0
    expect(replica(page, 0)).to_have_attribute("data-tp", "3", timeout=15000)
    plan = stack.wait_generation(generation + 1)
    assert plan["replicas"][0]["tp_degree"] == 3
    # the survivors of the rack are boosted: their cells say so, with the cap in watts
    boosted = page.locator('.rack[data-rack="rack-0"] .cell.boost')
    expect(boosted).to_have_count(3)
    caps = {(c["node"], c["index"]): c["cap_w"] for c in plan["power_caps"]}
    label = cell(page, node, 0).get_attribute("aria-label")
    assert f"cap {round(caps[(node, 0)])} W" in label
    expect(page.locator("#event-list li").first).to_contain_text("gpu_failed")


def test_admin_drains_a_gpu_from_the_page_and_the_committed_plan_shows_it(stack, tabs):
    page = signed_in(stack, tabs, stack.admin_token)
    expect(page.locator("#scope")).to_have_text(re.compile(r"^token-[0-9a-f]{8}: admin$"))
    node = stack.node(1)
    before = stack.plan()
    assert before["replicas"][1]["tp_degree"] == 4
    cell(page, node, 1).click()
    expect(page.locator("#gpu-title")).to_have_text(f"GPU {node}:1")
    page.click('[data-action="preview-drain"]')
    expect(page.locator("#gpu-preview [role=alert]")).to_contain_text("reason")  # required
    page.fill("#drain-reason", "flaky NVLink, ticket 42")
    page.click('[data-action="preview-drain"]')
    diff = page.locator(f'#gpu-preview [data-diff="{JOB}"]')
    expect(diff).to_contain_text("replica 1: tp degree 4 → 3")
    expect(diff).to_contain_text(f"{node}:1")
    assert stack.plan()["generation"] == before["generation"]  # a preview commits nothing
    page.click('[data-action="commit-drain"]')
    expect(page.locator('#gpu-preview [data-status="committed"]')).to_contain_text(
        f"{JOB} generation", timeout=15000)
    expect(cell(page, node, 1)).to_have_attribute("data-state", "drained")
    expect(replica(page, 1)).to_have_attribute("data-tp", "3")
    plan = stack.wait_generation(before["generation"] + 1)
    used = {(g["node"], g["index"]) for st in plan["replicas"][1]["stages"] for g in st["gpus"]}
    assert (node, 1) not in used and len(used) == 3
    gpu = httpx.get(f"{stack.url}/v1/nodes/{node}/gpus/1", timeout=5).json()
    assert gpu["state"] == "drained" and gpu["drain_reason"] == "flaky NVLink, ticket 42"
    # undrain from the page: the GPU comes back
    page.click('[data-action="undrain"]')
    expect(cell(page, node, 1)).to_have_attribute("data-state", "healthy", timeout=15000)


def test_admin_pins_a_degree_after_previewing_its_diff(stack, tabs):
    page = signed_in(stack, tabs, stack.admin_token)
    job = page.locator(f'[data-job="{JOB}"]')
    expect(replica(page, 1)).to_have_attribute("data-tp", "4", timeout=15000)
    generation = stack.plan()["generation"]
    job.locator("input").nth(0).fill("1")
    job.locator("input").nth(1).fill("2")
    job.locator('[data-action="preview-pin"]').click()
    expect(job.locator(".diff")).to_contain_text("replica 1: tp degree 4 → 2")
    assert stack.plan()["generation"] == generation  # a preview commits nothing
    job.locator('[data-action="commit-pin"]').click()
    expect(replica(page, 1)).to_have_attribute("data-tp", "2", timeout=15000)
    assert stack.wait_generation(generation + 1)["replicas"][1]["tp_degree"] == 2
    expect(job).to_contain_text("replica 1 → TP 2")
    job.locator('[data-action="clear-pins"]').click()
    expect(replica(page, 1)).to_have_attribute("data-tp", "4", timeout=15000)
    # an impossible pin is refused with the API's reason, nothing committed
    job.locator("input").nth(1).fill("9")
    job.locator('[data-action="preview-pin"]').click()
    expect(job.locator("[role=alert]")).to_contain_text("above the job's base TP degree 4")
