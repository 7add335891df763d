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


def test_every_knob_has_a_row_in_the_configuration_tables():
    rows = set(re.findall(r"^\| `(--[a-z0-9-]+)` \|", README, re.M))
    flags = {flag_name(f.name) for cls in (LearnerConfig, ServerOptions)
             for f in dataclasses.fields(cls)}
    assert flags - rows == set(), "missing from README"
    assert rows - flags == set(), "README lists flags that do not exist"


def test_quick_start_commands_are_make_targets():
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    for target in re.findall(r"^make (\w+)", quick, re.M):
        assert re.search(rf"^{target}:", MAKEFILE, re.M), target
