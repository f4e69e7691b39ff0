"""The README and docs/ link only files that exist inside the repository."""

from __future__ import annotations

import re

from tests.deploy.tools import REPO

LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_and_docs_link_only_files_inside_the_repository():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    bad = []
    for doc in docs:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(REPO.resolve()) or not path.exists():
                bad.append(f"{doc.relative_to(REPO)}: {target}")
    assert bad == []
