"""The README's configuration tables and quick start keep up with the code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from duelq.apps.cli import flag_name
from duelq.server.core.config import LearnerConfig
from duelq.server.server import ServerOptions

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def shown(default) -> str:
    if isinstance(default, dict):
        return ",".join(f"{k}={v}" for k, v in default.items())
    return '""' if default == "" else str(default)


def test_every_knob_has_a_row_with_its_default_in_the_configuration_tables():
    rows = dict(re.findall(r"^\| `(--[a-z0-9-]+)` \| `([^`]*)` \|", README, re.M))
    flags = {flag_name(f.name): shown(f.default if f.default is not dataclasses.MISSING
                                      else f.default_factory())
             for cls in (LearnerConfig, ServerOptions) for f in dataclasses.fields(cls)}
    assert flags.keys() - rows.keys() == set(), "missing from README"
    assert rows.keys() - flags.keys() == set(), "README lists flags that do not exist"
    assert {f: d for f, d in rows.items() if flags[f] != d} == {}, "README defaults are stale"


def test_quick_start_commands_are_make_targets():
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    for target in re.findall(r"^make (\w+)", quick, re.M):
        assert re.search(rf"^{target}:", MAKEFILE, re.M), target


def test_every_python_block_of_the_readme_compiles():
    blocks = re.findall(r"^```python\n(.*?)^```", README, re.M | re.S)
    assert blocks, "the README shows no Python"
    for number, block in enumerate(blocks, 1):
        compile(block, f"README.md, python block {number}", "exec")


def test_relative_links_of_the_readme_and_docs_point_into_the_repository():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path = (page.parent / target).resolve()
            assert path.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
            assert path.exists(), f"{page.name} links to a missing file: {target}"
