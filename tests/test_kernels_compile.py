"""Every kernels/*.cu (and the benchmark's seed baseline) compiles for sm_90 with nvcc.

Runs on CPU machines; skipped where nvcc is absent.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from duelq.server.core.replay import tree_levels

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
NVCC = shutil.which("nvcc")
SIZES = [(128, 11, 16), (64, 2, 16), (256, 18, 16), (100, 7, 8), (4096, 1024, 4)]

#: Kernels compiled per configuration.
SIZED = sorted(p for p in KERNELS.glob("*.cu") if '#include "dueling_common.cuh"' in p.read_text())

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")


def replay_defines(capacity: int) -> tuple[str, ...]:
    """What server/core/cuda_replay.py adds for kernels/replay.cu."""
    return (f"-DCAPACITY={capacity}", f"-DTREE_DEPTH={len(tree_levels(capacity)) - 1}",
            "--fmad=false")


#: Defines a kernel needs besides the sizes.
EXTRA = {"replay.cu": replay_defines(1000)}


def nvcc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([NVCC, "-arch=sm_90", f"-I{KERNELS}", *args],
                          capture_output=True, text=True, timeout=300)


def test_there_are_kernels():
    assert {p.name for p in SIZED} >= {"learner_step.cu", "action_entropy.cu", "replay.cu"}


@pytest.mark.parametrize("cu", sorted(KERNELS.glob("*.cu")), ids=lambda p: p.name)
@pytest.mark.parametrize("H,N,R", SIZES, ids=lambda v: str(v))
def test_ptx_compiles(cu, H, N, R, tmp_path):
    out = tmp_path / "k.ptx"
    run = nvcc("--ptx", f"-DHIDDEN_DIM={H}", f"-DN_ACTIONS={N}", f"-DROW_TILE={R}",
               *EXTRA.get(cu.name, ()), "-o", str(out), str(cu))
    assert run.returncode == 0, run.stderr
    assert "warning" not in run.stderr.lower(), run.stderr
    assert ".entry" in out.read_text()


@pytest.mark.parametrize("features", [1, 2], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("H,N,R", [(128, 11, 16), (100, 7, 8)], ids=lambda v: str(v))
def test_16_bit_feature_variants_compile_without_spills(features, H, N, R, tmp_path):
    run = nvcc("-cubin", "-Xptxas", "-v", f"-DHIDDEN_DIM={H}", f"-DN_ACTIONS={N}",
               f"-DROW_TILE={R}", f"-DFEATURES={features}", "-o", str(tmp_path / "k.cubin"),
               str(KERNELS / "learner_step.cu"))
    assert run.returncode == 0, run.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    assert spills and all(s == ("0", "0") for s in spills), run.stderr


def test_seed_baseline_compiles(tmp_path):
    run = nvcc("--ptx", "-o", str(tmp_path / "seed.ptx"),
               str(ROOT / "benchmarks" / "seed_action_entropy.cu"))
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("cu", SIZED, ids=lambda p: p.name)
def test_sizes_are_not_hard_coded(cu, tmp_path):
    run = nvcc("--ptx", "-o", str(tmp_path / "k.ptx"), str(cu))
    assert run.returncode != 0 and "HIDDEN_DIM" in run.stderr


@pytest.mark.parametrize("cu", sorted(KERNELS.glob("*.cu")), ids=lambda p: p.name)
def test_default_sizes_do_not_spill(cu, tmp_path):
    run = nvcc("-cubin", "-Xptxas", "-v", "-DHIDDEN_DIM=128", "-DN_ACTIONS=11",
               *EXTRA.get(cu.name, ()), "-o", str(tmp_path / "k.cubin"), str(cu))
    assert run.returncode == 0, run.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    assert spills and all(s == ("0", "0") for s in spills), run.stderr


@pytest.mark.parametrize("features", [0, 1, 2], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("H, capacity", [(128, 10 ** 6), (127, 1), (100, 33), (4096, 1 << 30)],
                         ids=lambda v: str(v))
def test_replay_variants_compile_without_spills(features, H, capacity, tmp_path):
    run = nvcc("-cubin", "-Xptxas", "-v", f"-DHIDDEN_DIM={H}", "-DN_ACTIONS=11",
               f"-DFEATURES={features}", *replay_defines(capacity),
               "-o", str(tmp_path / "k.cubin"), str(KERNELS / "replay.cu"))
    assert run.returncode == 0, run.stderr
    assert "warning" not in run.stderr.lower(), run.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    assert spills and all(s == ("0", "0") for s in spills), run.stderr
    # No local arrays either (the tree update's 32 child sums stay in registers).
    frames = re.findall(r"(\d+) bytes stack frame", run.stderr)
    assert frames and all(f == "0" for f in frames), run.stderr


def test_replay_needs_its_capacity(tmp_path):
    run = nvcc("--ptx", "-DHIDDEN_DIM=128", "-DN_ACTIONS=11", "-o", str(tmp_path / "k.ptx"),
               str(KERNELS / "replay.cu"))
    assert run.returncode != 0 and "CAPACITY" in run.stderr
