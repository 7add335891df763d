"""server/core/native.c built and loaded without a GPU: the build, its cache, its failures,
the block totals against NumPy's sums (bit for bit), its calls against a stand-in driver,
and the structs shared with C laid out as the C compiler lays them out.  The driver calls
themselves are tested on the GPU (tests/test_cuda.py)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from duelq.kernels import source as kernel_source
from duelq.server.core import native
from duelq.server.core.native import NativeUnavailable

pytestmark = pytest.mark.skipif(shutil.which(native.compiler()[0]) is None,
                                reason=f"no C compiler ({native.compiler()[0]})")


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DUELQ_CACHE_DIR", str(tmp_path))
    return tmp_path


def numpy_totals(parts: np.ndarray) -> list[float]:
    """The block totals' specification: rows added in block order in float64, row 1
    squared."""
    wide = parts.astype(np.float64)
    wide[1] *= wide[1]
    return wide.cumsum(axis=1)[:, -1].tolist()


def c_totals(lib: native.Native, parts: np.ndarray) -> list[float]:
    parts = np.ascontiguousarray(parts, np.float32)
    totals = (ctypes.c_double * 5)()
    lib.block_totals(parts.ctypes.data, parts.shape[1], 1, ctypes.addressof(totals))
    return totals[:]


def test_block_totals_by_hand(cache):
    lib = native.load(cuda=False)
    parts = np.array([[1, 1], [3, 4], [0.5, 0.25], [1, 2], [1, 0]], np.float32)
    assert c_totals(lib, parts) == [2.0, 25.0, 0.75, 3.0, 1.0]


@pytest.mark.parametrize("blocks", [1, 2, 7, 66, 132])
def test_block_totals_match_numpy_bit_for_bit(cache, blocks):
    """Random partials spanning many magnitudes, where the order and width of the adds
    show in the last bits; flags of 1.0 and 0.0; inf and NaN pass through as in NumPy."""
    lib = native.load(cuda=False)
    rng = np.random.default_rng(blocks)
    for _ in range(20):
        parts = (rng.standard_normal((5, blocks)) * 10.0 ** rng.integers(-6, 7, (5, blocks))
                 ).astype(np.float32)
        parts[[0, 4]] = rng.random((2, blocks)) < 0.9
        got, want = c_totals(lib, parts), numpy_totals(parts)
        assert np.array(got).tobytes() == np.array(want).tobytes()
    parts[2, blocks // 2], parts[3, 0] = np.inf, np.nan
    got, want = np.array(c_totals(lib, parts)), np.array(numpy_totals(parts))
    np.testing.assert_array_equal(got, want)


def test_block_totals_of_a_run_are_each_steps(cache):
    """A replay run's partials [steps][5][G] give each step's totals, as one step's call
    would."""
    lib = native.load(cuda=False)
    rng = np.random.default_rng(5)
    parts = rng.standard_normal((3, 5, 66)).astype(np.float32)
    totals = np.empty((3, 5))
    lib.block_totals(parts.ctypes.data, 66, 3, totals.ctypes.data)
    for step in range(3):
        assert totals[step].tobytes() == np.array(c_totals(lib, parts[step])).tobytes()
        assert totals[step].tolist() == numpy_totals(parts[step])


def test_fast_math_in_cc_does_not_change_the_totals(cache, monkeypatch):
    """FLAGS come after $CC's own flags and turn fast math (reassociation: vectorized,
    reordered sums) back off, so the totals stay NumPy's to the bit."""
    avx2 = "avx2" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() \
        else False
    monkeypatch.setenv("CC", f"{native.compiler()[0]} -O3 -ffast-math -fvect-cost-model=unlimited"
                       + (" -mavx2" if avx2 else ""))
    lib = native.load(cuda=False)
    rng = np.random.default_rng(7)
    for _ in range(100):
        parts = (rng.standard_normal((5, 132)) * 10.0 ** rng.integers(-6, 7, (5, 132))
                 ).astype(np.float32)
        assert np.array(c_totals(lib, parts)).tobytes() == np.array(numpy_totals(parts)).tobytes()


def test_a_damaged_cached_library_is_built_again(cache):
    path = native.build()
    path.write_bytes(b"\x7fELF truncated")
    lib = native.load(cuda=False)
    assert lib.path == path and path.stat().st_size > 1000
    assert c_totals(lib, np.ones((5, 3), np.float32)) == [3.0] * 5


def test_no_home_for_the_cache_is_reported(monkeypatch):
    for name in ("DUELQ_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(native.Path, "home", staticmethod(no_home))
    with pytest.raises(NativeUnavailable, match="home directory"):
        native.load()


def test_the_build_is_cached_per_source_and_compiler(cache, monkeypatch):
    first = native.build()
    assert first.parent == cache and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp
    monkeypatch.setenv("CC", f"{native.compiler()[0]} -g")
    other = native.build()
    assert other != first and other.exists()
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, other.name])


def test_a_failing_compiler_is_reported(cache, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(NativeUnavailable, match="^false failed on native.c"):
        native.load()
    monkeypatch.setenv("CC", "no-such-compiler-duelq")
    with pytest.raises(NativeUnavailable, match="cannot build native.c with "
                                                "no-such-compiler-duelq"):
        native.load()
    assert list(cache.iterdir()) == []   # nothing half-built is left


def test_an_unwritable_cache_is_reported(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DUELQ_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(NativeUnavailable, match="cannot build native.c"):
        native.load()


def test_without_libcuda_init_says_so(cache):
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(NativeUnavailable, match="libcuda.so.1 cannot be loaded"):
            native.load()
    else:
        native.load()   # a machine with a driver: every entry point resolves


FAKE_DRIVER = r"""
#include <string.h>
static int syncs;
int cuMemcpyHtoDAsync_v2(void) { return 0; }
int cuMemcpyDtoHAsync_v2(void *dst, unsigned long long src, size_t n, void *stream) {
    memcpy(dst, (const void *)src, n);   /* "device" addresses are host ones here */
    return 0;
}
int cuMemsetD32Async(unsigned long long dst, unsigned value, size_t n, void *stream) {
    for (size_t i = 0; i < n; ++i) ((unsigned *)dst)[i] = value;
    return 0;
}
int records, waits_for[8], waits;   /* events recorded; events waited for, in order */
int cuEventRecord(void *event, void *stream) { ++records; return 0; }
int cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
    if (waits < 8) waits_for[waits] = (int)(long)event;
    ++waits;
    return 0;
}
int cuStreamSynchronize(void) { return ++syncs == 2 ? 700 : 0; }   /* the second fails */
int cuEventSynchronize(void *event) { return event == (void *)9 ? 0 : 400; }

/* Each launch's function, blocks and first 256 bytes of its one argument struct. */
int launches, fail_at = -1;
void *launched_fn[64];
unsigned launched_blocks[64];
unsigned char launched_args[64][256];
static int record(void *fn, unsigned blocks, void **params) {
    if (launches == fail_at) return 719;
    launched_fn[launches] = fn, launched_blocks[launches] = blocks;
    memcpy(launched_args[launches], params[0], 256);
    ++launches;
    return 0;
}
int cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void *stream, void **params, void **extra) {
    return record(fn, gx, params);
}
int cuLaunchCooperativeKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz, unsigned smem, void *stream,
                              void **params) {
    return record(fn, gx, params);
}
"""

FAKE_STEPS = """
import ctypes
from duelq.server.core import native
lib = native.load()
parts = (ctypes.c_float * 5)(1, 2, 3, 4, 1)        # one block's partials
args = ctypes.create_string_buffer(256)              # learner_step's argument struct
params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
upload = native.UploadCall(copied=5, read=6)
step = native.StepCall(blocks=1, parts=ctypes.addressof(parts), params=ctypes.addressof(params))
assert lib.copy(ctypes.addressof(upload), 0, 0, 0) == 0
fake = ctypes.CDLL("libcuda.so.1")
waited = (ctypes.c_int * 8).in_dll(fake, "waits_for")
assert ctypes.c_int.in_dll(fake, "waits").value == 1 and waited[0] == 6   # the last reader
step.wait = 1                                   # an upload to wait for
assert lib.step(ctypes.addressof(step)) == 0
assert step.totals[:] == [1.0, 4.0, 3.0, 4.0, 1.0]
step.wait = None                                # staged on the stream: no wait
assert lib.step(ctypes.addressof(step)) == 700  # the failed sync's status
print("ok")
"""


def _fake_driver(tmp_path) -> dict:
    """The environment that loads FAKE_DRIVER as libcuda.so.1 (built in ``tmp_path``)."""
    source = tmp_path / "fake_cuda.c"
    source.write_text(FAKE_DRIVER)
    subprocess.run([*native.compiler(), "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"),
                    str(source)], check=True)
    return {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}


def _run_script(script: str, env: dict) -> None:
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_copy_and_step_against_a_stand_in_driver(cache, tmp_path):
    """The library against a stand-in libcuda.so.1 (no GPU here): a copy and a step succeed,
    the block totals come back, and a step whose sync fails returns the driver's status."""
    _run_script(FAKE_STEPS, _fake_driver(tmp_path))


FAKE_RUN = """
import ctypes
from duelq.server.core import native
lib, fake = native.load(), ctypes.CDLL("libcuda.so.1")
space = [ctypes.create_string_buffer(512) for _ in range(3)]   # room for a 256-byte snapshot
sample, step, commit = (kind.from_buffer(b) for kind, b in zip(
    (native.SampleArgs, native.StepArgs, native.CommitArgs), space))
params = [(ctypes.c_void_p * 1)(ctypes.addressof(a)) for a in (sample, step, commit)]
report = (ctypes.c_double * 4)()       # the device's report: control words, then stats
report_host = (ctypes.c_double * 4)()
ctypes.memset(report, 0xFF, 8)          # control words the run must zero first
report[1] = 2.5
steps = (native.ReplayStepCall * 3)(*[native.ReplayStepCall(
    draw=10 + j, mark=100 + j, beta=0.4 + j / 8, step_size=j + 0.5, sqrt_bc2=j + 0.25,
    epoch=7 + 2 * j, barrier=30 + 2 * j, update_target=j == 1) for j in range(3)])
f = native.field_address
call = native.ReplayRunCall(
    sample=1, step=2, commit=3, sample_blocks=4, step_blocks=5, commit_blocks=6, threads=256,
    sample_params=ctypes.addressof(params[0]), step_params=ctypes.addressof(params[1]),
    commit_params=ctypes.addressof(params[2]), sample_draw=f(sample, "draw"),
    sample_mark=f(sample, "mark"), sample_beta=f(sample, "beta"),
    step_size=f(step, "step_size"), step_sqrt_bc2=f(step, "sqrt_bc2"),
    step_epoch=f(step, "epoch"), step_update_target=f(step, "update_target"),
    commit_mark=f(commit, "mark"), commit_barrier=f(commit, "barrier"),
    commit_stats_row=f(commit, "stats_row"), steps=ctypes.addressof(steps), count=3,
    report=ctypes.addressof(report_host), report_device=ctypes.addressof(report),
    report_bytes=ctypes.sizeof(report), done=9)
assert lib.replay_run(ctypes.addressof(call)) == 0
assert ctypes.c_int.in_dll(fake, "records").value == 1   # the run's done event
assert lib.replay_wait(ctypes.addressof(call)) == 0     # waits for event 9
assert ctypes.c_int.in_dll(fake, "launches").value == 9
fns = (ctypes.c_void_p * 64).in_dll(fake, "launched_fn")
blocks = (ctypes.c_uint * 64).in_dll(fake, "launched_blocks")
snaps = (ctypes.c_ubyte * 256 * 64).in_dll(fake, "launched_args")
assert [fns[i] for i in range(9)] == [1, 2, 3] * 3
assert [blocks[i] for i in range(9)] == [4, 5, 6] * 3
for j in range(3):   # each launch saw its own step's values
    s = native.SampleArgs.from_buffer_copy(bytes(snaps[3 * j]))
    t = native.StepArgs.from_buffer_copy(bytes(snaps[3 * j + 1]))
    c = native.CommitArgs.from_buffer_copy(bytes(snaps[3 * j + 2]))
    assert (s.draw, s.mark, s.beta) == (10 + j, 100 + j, 0.4 + j / 8)
    assert (t.epoch, t.update_target) == (7 + 2 * j, j == 1)
    assert (t.step_size, t.sqrt_bc2) == (j + 0.5, j + 0.25)
    assert (c.mark, c.barrier, c.stats_row) == (100 + j, 30 + 2 * j, j)
assert bytes(report_host)[:8] == bytes(8) and report_host[1] == 2.5   # zeroed, copied back
ctypes.c_int.in_dll(fake, "fail_at").value = 13   # the second run's fifth launch fails:
report_host[1] = 0
assert lib.replay_run(ctypes.addressof(call)) == 719   # its status; the report still comes
assert ctypes.c_int.in_dll(fake, "launches").value == 13
assert report_host[1] == 2.5 and ctypes.c_int.in_dll(fake, "records").value == 2
print("ok")
"""


def test_a_replay_run_against_a_stand_in_driver(cache, tmp_path):
    """A run of three replay steps (no GPU here): nine launches in order, each argument
    struct holding its own step's values when launched; the report zeroed, then copied
    back and its event recorded and waited for; a failed launch ends the run and its
    status is returned, the report still copied back."""
    _run_script(FAKE_RUN, _fake_driver(tmp_path))


@pytest.mark.parametrize("source, name, ctype", [
    (native.SOURCE.read_text(), "duelq_upload", native.UploadCall),
    (native.SOURCE.read_text(), "duelq_step", native.StepCall),
    (native.SOURCE.read_text(), "duelq_replay_step", native.ReplayStepCall),
    (native.SOURCE.read_text(), "duelq_replay_run", native.ReplayRunCall),
    (kernel_source("learner_step.cu"), "StepArgs", native.StepArgs),
    (kernel_source("replay.cu"), "SampleArgs", native.SampleArgs),
    (kernel_source("replay.cu"), "CommitArgs", native.CommitArgs),
    (kernel_source("replay.cu"), "InsertArgs", native.InsertArgs),
    (kernel_source("replay.cu"), "CheckArgs", native.CheckArgs),
], ids=["duelq_upload", "duelq_step", "duelq_replay_step", "duelq_replay_run", "StepArgs",
        "SampleArgs", "CommitArgs", "InsertArgs", "CheckArgs"])
def test_ctypes_structs_lay_out_as_the_c_compiler_does(source, name, ctype, tmp_path):
    """Each struct that crosses into C is read from its C source; the C compiler, given the
    same text, puts every field at the offset ctypes does, and the sizes agree."""
    prelude = ("#include <stddef.h>\n#include <stdio.h>\ntypedef void *CUstream, *CUevent, "
               "*CUfunction;\ntypedef unsigned long long CUdeviceptr, tagged_t;\n"
               "typedef unsigned short unit_t;\n")
    body = native.struct_text(source, name)
    fields = [f for f, _ in ctype._fields_]
    prints = "".join(f'printf("%zu\\n", offsetof(struct {name}, {f}));' for f in fields)
    program = (f"{prelude}struct {name} {{{body}}};\nint main(void) {{ {prints} "
               f'printf("%zu\\n", sizeof(struct {name})); return 0; }}\n')
    (tmp_path / "layout.c").write_text(program)
    subprocess.run([*native.compiler(), "-o", str(tmp_path / "layout"), str(tmp_path / "layout.c")],
                   check=True)
    got = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                         check=True).stdout.split()
    want = [getattr(ctype, f).offset for f in fields] + [ctypes.sizeof(ctype)]
    assert [int(x) for x in got] == want


def test_struct_fields_reads_c_declarations():
    text = "struct s { const float *a, b; unsigned long long c[3]; int **d; /* e */ };"
    assert [(f, t) for f, t in native.struct_fields(text, "s")] == [
        ("a", ctypes.c_void_p), ("b", ctypes.c_float), ("c", ctypes.c_ulonglong * 3),
        ("d", ctypes.c_void_p)]


def test_the_stream_copy_copies_every_length_and_alignment(cache):
    copy = native.load(cuda=False).stream_copy
    rng = np.random.default_rng(9)
    source = rng.integers(0, 256, 70_000, np.uint8).tobytes()
    for n in (0, 1, 15, 16, 17, 63, 64, 65, 127, 129, 1000, 65_536 + 13):
        for at in (0, 1, 7, 15, 16):           # the target's alignment
            for offset in (0, 3, 64):          # where in the source
                target = np.full(n + 64, 0xEE, np.uint8)
                copy(target.ctypes.data + at, source, offset, n)
                assert target[at:at + n].tobytes() == source[offset:offset + n], (n, at, offset)
                assert (target[:at] == 0xEE).all() and (target[at + n:] == 0xEE).all()
