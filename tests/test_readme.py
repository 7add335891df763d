"""The README keeps up with the code: its configuration table is generated from the
dataclasses, every Python block runs against a real server, every `duelq` command line
and DUELQ_ variable it shows exists, and it stays a user's page."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path

import pytest

from duelq.apps.cli import COMMANDS, build_parser, field_docs, flag_name
from duelq.server.core.config import LearnerConfig
from duelq.server.server import ServerOptions

from conftest import SMALL

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
DEFAULT_TARGET = "localhost:50051"


def shown(default) -> str:
    if isinstance(default, dict):
        return ",".join(f"{k}={v}" for k, v in default.items())
    return '""' if default == "" else str(default)


def configuration_rows() -> list[str]:
    """docs/configuration.md's table rows, as the dataclasses give them."""
    rows = []
    for cls in (LearnerConfig, ServerOptions):
        docs = field_docs(cls, code="`")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            meaning = docs.get(f.name, "").replace("|", "\\|")
            rows.append(f"| `{flag_name(f.name)}` | `{shown(default)}` | {meaning} |")
    return rows


def test_the_configuration_table_is_the_generated_one():
    table = [line for line in CONFIGURATION.splitlines() if re.match(r"^\| `--[a-z0-9-]+` \|", line)]
    expected = configuration_rows()
    assert table == expected, "regenerate docs/configuration.md's rows:\n" + "\n".join(expected)


def test_quick_start_commands_are_make_targets():
    quick = README.split("## Quick start", 1)[1].split("##", 1)[0]
    targets = re.findall(r"^make (\w+)", quick, re.M)
    assert targets == ["demo", "test"]
    for target in targets:
        assert re.search(rf"^{target}:", MAKEFILE, re.M), target


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.M | re.S)


def test_every_duelq_command_line_parses_and_every_variable_is_a_flag():
    parser = build_parser()
    lines = [line.split("#", 1)[0].strip() for block in code_blocks("bash")
             for line in block.replace("\\\n", " ").splitlines()]
    commands = [shlex.split(line)[1:] for line in lines if line.startswith("duelq ")]
    assert len(commands) >= 4
    for argv in commands:
        if "--help" not in argv:
            assert isinstance(parser.parse_args(argv), argparse.Namespace), argv
    helps = []
    for argv in ([], *([command] for command in COMMANDS)):
        with contextlib.redirect_stdout(io.StringIO()) as text, pytest.raises(SystemExit):
            parser.parse_args([*argv, "--help"])
        helps.append(text.getvalue())
    read = set(re.findall(r"\bDUELQ_[A-Z0-9_]+\b", "".join(helps).replace("\n", "")))
    named = set(re.findall(r"\bDUELQ_[A-Z0-9_]+\b", README)) - {"DUELQ_GIT"}
    assert named - read == set(), "the README names variables no flag reads"


@pytest.mark.parametrize("number", range(len(code_blocks("python"))))
def test_every_python_block_runs_against_a_server(number, make_server):
    """Each block as written, in a fresh namespace, with the server's address for
    localhost:50051 (the default port may be taken on a test machine), whose replay buffer
    is on for the server-side replay's block."""
    block = code_blocks("python")[number]
    assert DEFAULT_TARGET in block
    server = make_server(dataclasses.replace(SMALL, replay_capacity=1024))
    before = server.learner.step_count
    code = compile(block.replace(DEFAULT_TARGET, server.target),
                   f"README.md, python block {number + 1}", "exec")
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__readme__"})
    assert server.learner.step_count > before, "the block trained nothing"


def test_it_is_a_page_for_users():
    assert len(README.splitlines()) <= 250
    for word in (r"\b[Rr]ound \d", r"\b[Ii]ssue \d", "shared/", "DESIGN.md", r"\bseeds?/"):
        assert not re.search(word, README), word   # no history, nothing outside the repo
    assert not re.search(r"(?<![\w.])/(work|home|tmp)/", README)


def test_relative_links_of_the_readme_and_docs_point_into_the_repository():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path = (page.parent / target).resolve()
            assert path.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
            assert path.exists(), f"{page.name} links to a missing file: {target}"
