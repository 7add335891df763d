"""The README's configuration tables and quick start keep up with the code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from duelq.server.cli import flag_name
from duelq.server.config import LearnerConfig
from duelq.server.server import ServerOptions

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
MAKEFILE = (Path(__file__).resolve().parents[1] / "Makefile").read_text()


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
