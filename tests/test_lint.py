"""Pyflakes' rules over the code (ruff, the test extra): an undefined name in code that only
a GPU runs, or an import a merge left twice, fails here on any machine."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers import tool

ROOT = Path(__file__).resolve().parents[1]
CODE = ("wire", "server", "client", "apps", "benchmarks", "scripts")


def test_the_code_passes_pyflakes_rules():
    ruff = tool("ruff", "pip install ruff (the test extra)")
    done = subprocess.run([ruff, "check", "--no-cache", "--select", "F", "--output-format",
                           "concise", *CODE], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_tests_define_every_name_they_use():
    ruff = tool("ruff", "pip install ruff (the test extra)")
    done = subprocess.run([ruff, "check", "--no-cache", "--select", "F821,F401",
                           "--output-format", "concise", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
