"""Every patch carries a DEP-3 header (https://dep-team.pages.debian.net/deps/dep3/) with DEP-3's
own keywords, plus the project's two fields: the wall it fixes and how to switch it off; and
every patch is the project's, by its maintainers' identity (not a local git identity that
`patches export` happened to find in a checkout)."""

import re
from pathlib import Path

import pytest

PATCHES = sorted((Path(__file__).resolve().parent.parent / "patches").glob("*/*.patch"))
ORIGIN = re.compile(r"^Origin: (upstream|backport|vendor|other), \S", re.M)
FORWARDED = re.compile(r"^Forwarded: (no|not-needed|yes|https?://\S+)$", re.M)
LAST_UPDATE = re.compile(r"^Last-Update: \d{4}-\d{2}-\d{2}$", re.M)
APPLIED = re.compile(r"^Applied-Upstream: (\S+, )?(commit:[0-9a-f]{40}|https?://\S+)", re.M)
AUTHOR = "From: flux2-24gb maintainers <maintainers@flux2-24gb.invalid>\n"


def header(path: Path) -> str:
    return path.read_text(encoding="utf-8").partition("\ndiff --git ")[0]


@pytest.mark.parametrize("path", PATCHES, ids=[f"{p.parent.name}/{p.name[:4]}" for p in PATCHES])
def test_dep3_fields(path):
    text = header(path)
    assert AUTHOR in text.splitlines(keepends=True)[:3], f"{path.name}: the author must be the line {AUTHOR!r}"
    for field in ("Description:", "Wall:", "Switch-off:"):
        assert re.search(rf"^{field} \S", text, re.M), f"{path.name} has no {field} line"
    assert ORIGIN.search(text), f"{path.name}: Origin must start with upstream, backport, vendor or other"
    assert FORWARDED.search(text), f"{path.name}: Forwarded must be no, not-needed, yes or a URL"
    assert LAST_UPDATE.search(text), f"{path.name}: Last-Update must be a YYYY-MM-DD date"
    if "Applied-Upstream:" in text:
        assert APPLIED.search(text), f"{path.name}: Applied-Upstream must name a commit or a URL"


def test_the_checker_refuses_the_old_fields(tmp_path):
    old = "Description: x\nWall: 1\nOrigin: this project (flux2-24gb launcher)\nForwarded: no\nSwitch-off: y\n"
    assert not ORIGIN.search(old) and FORWARDED.search(old) and not LAST_UPDATE.search(old)
