"""``make screenshot``: the console of a small real stack (etcd, a controller process, a
simulated agent per rack) with a failed GPU, a boosted rack, a drained and a slow GPU,
written as a PNG (``python -m tests.ui.screenshot docs/img/console.png``)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx
from playwright.sync_api import expect

from tests.ui.browser import chromium, open_console
from tests.ui.stack import console_stack


def main(out: str) -> int:
    with console_stack(Path(tempfile.mkdtemp(prefix="tpflex-screenshot-")), racks=6, gpus=8) as stack:
        generation = stack.plan()["generation"]
        stack.inject(1, 5, "xid79")  # rack-1 runs at TP 7, its survivors boosted
        stack.inject(3, 2, "slow", slow_factor=0.8)  # a degraded GPU
        r = httpx.post(f"{stack.url}/v1/nodes/{stack.node(4)}/gpus/6/drain",
                       headers=stack.cluster.rest_headers(), json={"reason": "RMA ticket 4711"}, timeout=10)
        r.raise_for_status()
        stack.wait_generation(generation + 2)
        with chromium({"width": 1400, "height": 820}) as context:
            page = open_console(context, stack.url, stack.admin_token)
            expect(page.locator(".rack .cell")).to_have_count(48)
            expect(page.locator('.rack[data-rack="rack-4"] .cell[data-state="drained"]')).to_have_count(1)
            cell = page.locator(f'.rack .cell[data-gpu="{stack.node(1)}:4"]')
            cell.click()
            cell.hover()
            page.fill("#drain-reason", "ECC errors rising")
            page.click('[data-action="preview-drain"]')
            expect(page.locator("#gpu-preview .diff")).to_be_visible()
            cell.hover()
            page.screenshot(path=out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/img/console.png"))
