"""The CUDA backend's per-step host calls in C (server/native.c), through ctypes.

The file is built with the host's C compiler on first use and cached by its hash (as CuPy
caches the kernels it compiles), under ``$DUELQ_CACHE_DIR`` or ``~/.cache/duelq``.  It needs
no CUDA header: it takes the driver's entry points from the libcuda already loaded.  Where
it cannot be built or loaded, :func:`load` raises :class:`NativeUnavailable` saying why, and
the backend makes the same calls from Python.

Why C: a step from Python crossed CuPy's wrappers eight times and released the GIL each
time; in the running server the learner process's two relay threads contend for that GIL.
Here an upload is one call that keeps the GIL (a few µs of driver calls), and a step one
call that releases it while it waits for the device.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

log = logging.getLogger(__name__)

#: Compiled into one library: the driver calls, and the relay's fast lane (server/lane.py).
SOURCES = (Path(__file__).with_name("native.c"), Path(__file__).with_name("lane.c"))
#: The block totals must add exactly as NumPy does: no fused multiply-add, no reassociation
#: (these come after any flags in $CC, so they win).
FLAGS = ("-O2", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off")
#: The driver's entry points native.c calls, in its order (``Native.call_times``' keys).
DRIVER_CALLS = ("cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuLaunchKernel",
                "cuLaunchCooperativeKernel", "cuEventRecord", "cuStreamWaitEvent",
                "cuStreamSynchronize", "cuEventSynchronize")
LANE_UPLOADS, LANE_SHAPES = 8, 16   # server/lane.c's UPLOADS and SHAPES
_defines: tuple[str, ...] = ()   # -DDUELQ_TIME_CALLS after time_calls()


def time_calls() -> None:
    """From here on, build and load the library with a clock around every driver call
    (``Native.call_times``; benchmarks/relay_path.py --driver-calls).  Process-wide; a
    backend built before keeps the library it has."""
    global _defines
    _defines = ("-DDUELQ_TIME_CALLS",)


class NativeUnavailable(RuntimeError):
    """The C host path cannot be used here (no compiler, no libcuda...): the reason."""


class UploadCall(ctypes.Structure):
    """Mirror of ``struct duelq_upload`` in server/native.c."""

    _fields_ = [("message", ctypes.c_ulonglong), ("unpack", ctypes.c_void_p),
                ("blocks", ctypes.c_uint), ("threads", ctypes.c_uint),
                ("params", ctypes.c_void_p), ("stream", ctypes.c_void_p),
                ("copied", ctypes.c_void_p)]


class StepCall(ctypes.Structure):
    """Mirror of ``struct duelq_step`` in server/native.c."""

    _fields_ = [("fn", ctypes.c_void_p), ("blocks", ctypes.c_uint), ("threads", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("params", ctypes.c_void_p),
                ("stream", ctypes.c_void_p), ("wait", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("out_device", ctypes.c_ulonglong),
                ("out_bytes", ctypes.c_size_t), ("parts", ctypes.c_void_p),
                ("totals", ctypes.c_double * 5), ("synced_s", ctypes.c_double)]


class StepArgs(ctypes.Structure):
    """Mirror of ``struct StepArgs`` in kernels/learner_step.cu (and ``struct step_args`` in
    server/lane.c), field for field (``inputs`` is the C field ``in``)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "state", "next", "isv", "isv_next", "observed", "observed_next", "inputs", "out",
        "part_grad", "part_sq", "part_counts", "grad", "arrivals")] + [
        ("max_norm", ctypes.c_double),
        ("epoch", ctypes.c_uint),
    ] + [(name, ctypes.c_int) for name in (
        "batch", "rows_per_block", "has_weights", "double_dqn", "adam", "update_target",
        "isv_size", "entropy_slot")] + [(name, ctypes.c_float) for name in (
        "kappa", "priority_eps", "lr", "beta1", "beta2", "adam_eps", "step_size", "sqrt_bc2",
        "tau", "ent_alpha", "ent_keep")]


class LaneEngine(ctypes.Structure):
    """Mirror of ``struct duelq_cuda_engine`` in server/lane.c: the relay's fast lane's CUDA
    engine, filled in by ``CudaBackend.lane_enter``."""

    _fields_ = [("args", ctypes.c_void_p * 2), ("params", ctypes.c_void_p * 2),
                ("call", ctypes.c_void_p), ("out_host", ctypes.c_void_p),
                ("out_device", ctypes.c_ulonglong), ("out_words", ctypes.c_size_t),
                ("uploads", ctypes.c_void_p * LANE_UPLOADS),
                ("upload_device", ctypes.c_ulonglong * LANE_UPLOADS),
                ("upload_words", ctypes.c_size_t * LANE_UPLOADS)] + [
        (name, ctypes.c_uint * LANE_SHAPES) for name in (
            "shape_rows", "shape_kind", "shape_blocks", "shape_rows_per_block", "shape_smem")] + [
        ("shape_fn", ctypes.c_void_p * LANE_SHAPES), ("shapes", ctypes.c_uint),
        ("hidden", ctypes.c_uint), ("entropy", ctypes.c_int), ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
        ("target_period", ctypes.c_ulonglong), ("step", ctypes.c_ulonglong),
        ("epoch", ctypes.c_uint), ("cur", ctypes.c_int), ("synced_s", ctypes.c_double)]


def cache_dir() -> Path:
    """Where built libraries are kept: $DUELQ_CACHE_DIR, else $XDG_CACHE_HOME/duelq, else
    ~/.cache/duelq."""
    if os.environ.get("DUELQ_CACHE_DIR"):
        return Path(os.environ["DUELQ_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "duelq"


def compiler() -> list[str]:
    """The C compiler's command: $CC, else ``cc`` where it is on PATH, else the one Python
    was built with (often a build machine's path elsewhere)."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    if shutil.which("cc") is not None:
        return ["cc"]
    return shlex.split(sysconfig.get_config_var("CC") or "cc")


def build(*, again: bool = False) -> Path:
    """The shared library built from :data:`SOURCES` (compiled once per source, compiler,
    flags and machine; later calls find it in :func:`cache_dir`, unless ``again``)."""
    try:
        cc = compiler()
        flags = FLAGS + _defines
        tag = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + repr(
            (cc, flags, platform.machine())).encode()).hexdigest()[:16]
        lib = cache_dir() / f"duelq-native-{tag}.so"
    except (OSError, RuntimeError, ValueError) as exc:   # no source, no home, a bad $CC
        raise NativeUnavailable(f"cannot build {_names()}: {exc}") from exc
    if lib.exists() and not again:
        return lib
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            done = subprocess.run([*cc, *flags, "-o", str(out), *map(str, SOURCES), "-ldl",
                                   "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise NativeUnavailable(f"{shlex.join(cc)} failed on {_names()}: "
                                        f"{done.stderr.strip()[-500:]}")
            out.replace(lib)   # atomic: a concurrent build leaves one whole file
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"cannot build {_names()} with {shlex.join(cc)}: "
                                f"{exc}") from exc
    return lib


def _names() -> str:
    return " and ".join(s.name for s in SOURCES)


class Native:
    """The built library's functions, typed; see server/native.c."""

    def __init__(self, path: Path):
        self.path = path
        self._cuda_ready = False
        keeps_gil = ctypes.PyDLL(str(path))      # calls of a few µs: no GIL hand-over
        releases_gil = ctypes.CDLL(str(path))    # the step waits for the device
        self.upload = keeps_gil.duelq_upload
        self.upload.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        self.copy = keeps_gil.duelq_copy
        self.copy.argtypes = (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p,
                              ctypes.c_size_t)
        self.block_totals = keeps_gil.duelq_block_totals
        self.block_totals.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
        self.block_totals.restype = None
        self.stream_copy = keeps_gil.duelq_stream_copy   # (dst, src bytes, offset, n)
        self.stream_copy.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                     ctypes.c_size_t)
        self.stream_copy.restype = None
        self.step = releases_gil.duelq_step
        self.step.argtypes = (ctypes.c_void_p,)
        self.lane = _lane_functions(keeps_gil, releases_gil)
        self._init = keeps_gil.duelq_init
        self._call_times = keeps_gil.duelq_call_times
        self._call_times.argtypes = (ctypes.c_void_p, ctypes.c_void_p)

    def call_times(self) -> dict[str, tuple[float, int]] | None:
        """{entry point: (seconds, calls)} summed over every call so far, where the library
        was built after :func:`time_calls`; else None."""
        n = len(DRIVER_CALLS)
        seconds, counts = (ctypes.c_double * n)(), (ctypes.c_ulonglong * n)()
        if not self._call_times(seconds, counts):
            return None
        return {name: (seconds[i], counts[i]) for i, name in enumerate(DRIVER_CALLS)}

    def init_cuda(self) -> None:
        """Resolve the CUDA driver's entry points (libcuda.so.1), once per library."""
        with _lock:
            if self._cuda_ready:
                return
            missing = self._init()
            if missing:
                raise NativeUnavailable("libcuda.so.1 cannot be loaded" if missing < 0 else
                                        f"libcuda.so.1 lacks driver entry point #{missing}")
            self._cuda_ready = True


def _lane_functions(keeps_gil: ctypes.PyDLL, releases_gil: ctypes.CDLL) -> SimpleNamespace:
    """server/lane.c's functions, typed (``pump`` lets the GIL go: it waits for frames, and
    calls back into Python with a Python engine)."""
    vp, size, size_p = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)
    signatures = {
        "new": (vp, (size, size, size)), "free": (None, (vp,)),
        "set_engine": (None, (vp, vp)), "use_cuda": (None, (vp, vp, ctypes.c_int)),
        "set_log_limit": (None, (vp, size)),
        "front": (ctypes.c_int, (vp, ctypes.c_int, ctypes.c_int, vp, size, ctypes.c_uint)),
        "stream": (ctypes.c_int, (vp, ctypes.c_int, ctypes.c_uint32, ctypes.c_int)),
        "actor": (ctypes.c_int, (vp, ctypes.c_char_p, size, ctypes.c_uint64)),
        "forget_actors": (None, (vp,)),
        "log": (vp, (vp, size_p)), "handed": (vp, (vp, size_p)),
        "unread": (vp, (vp, ctypes.c_int, size_p)),
        "answered": (ctypes.c_ulonglong, (vp, ctypes.c_int)), "closed": (ctypes.c_int, (vp,)),
        "stopped_at": (ctypes.c_int, (vp,)),
        "feed": (ctypes.c_int, (vp, ctypes.c_int, ctypes.c_char_p, size)),
        "miss": (ctypes.c_int, (vp, ctypes.c_uint * 4)), "settle": (None, (vp, ctypes.c_int)),
        "encode": (size, (vp, vp, ctypes.c_uint, ctypes.c_uint64, ctypes.c_char_p, size)),
        "encoded_max": (size, (ctypes.c_uint, size)), "layouts": (None, (size * 12,)),
    }
    functions = SimpleNamespace()
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(keeps_gil, f"duelq_lane_{name}")
        fn.restype, fn.argtypes = restype, argtypes
        setattr(functions, name, fn)
    functions.pump = releases_gil.duelq_lane_pump
    functions.pump.argtypes = (vp, ctypes.c_int, ctypes.c_int, ctypes.c_double)
    return functions


_lock = threading.Lock()
_loaded: dict[Path, Native] = {}   # one Native per library file, shared by every backend


def load(*, cuda: bool = True) -> Native:
    """The C host path, built if needed; with ``cuda``, its driver entry points resolved.
    A cached library that does not load (a truncated file, say) is built again once.
    Raises :class:`NativeUnavailable` with the reason where it cannot be used."""
    path = build()
    with _lock:
        native = _loaded.get(path)
        if native is None:
            try:
                native = Native(path)
            except OSError:
                path = build(again=True)
                try:
                    native = Native(path)
                except OSError as exc:
                    raise NativeUnavailable(f"cannot load {path}: {exc}") from exc
            native = _loaded[path] = native
    if cuda:
        native.init_cuda()
    return native


def stream_copy() -> Callable[[int, bytes, int, int], None] | None:
    """``duelq_stream_copy(dst address, src bytes, offset, n)``: copies ``src[offset:offset +
    n]`` to ``dst`` with non-temporal stores (holding the GIL); None where the library cannot
    be built or loaded here (the reason is logged)."""
    try:
        return load(cuda=False).stream_copy
    except NativeUnavailable as exc:
        log.info("relay slots are written with plain copies: %s", exc)
        return None
