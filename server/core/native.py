"""The CUDA backend's per-step host calls in C (server/core/native.c), through ctypes.

The file is built with the host's C compiler on first use and cached by its hash (as CuPy
caches the kernels it compiles), under ``$DUELQ_CACHE_DIR`` or ``~/.cache/duelq``.  It needs
no CUDA header: it takes the driver's entry points from the libcuda already loaded.  Where
it cannot be built or loaded, :func:`load` raises :class:`NativeUnavailable` saying why.

Every struct that crosses into C is written once, in C: :func:`c_struct` reads its fields
from the source (native.c's call structs, learner_step.cu's ``StepArgs``) and makes the
ctypes twin (the replay kernels' argument structs too); tests/test_native.py compiles the
same text with the C compiler and checks that every offset and size agrees.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Callable

from duelq.kernels import source as kernel_source

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
#: The block totals must add exactly as NumPy does: no fused multiply-add, no reassociation
#: (these come after any flags in $CC, so they win).
FLAGS = ("-O2", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off")

#: C scalar types of the structs that cross into C → ctypes (any pointer: c_void_p).
C_TYPES = {
    "double": ctypes.c_double, "float": ctypes.c_float, "int": ctypes.c_int,
    "unsigned": ctypes.c_uint, "unsigned int": ctypes.c_uint, "size_t": ctypes.c_size_t,
    "unsigned long long": ctypes.c_ulonglong, "CUdeviceptr": ctypes.c_ulonglong,
    "CUstream": ctypes.c_void_p, "CUevent": ctypes.c_void_p, "CUfunction": ctypes.c_void_p,
}


def struct_text(text: str, name: str) -> str:
    """The body of ``struct name { ... };`` in C source ``text``, comments removed."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)
    found = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", text, flags=re.S)
    if found is None:
        raise ValueError(f"struct {name} is not in the source")
    return found.group(1)


def struct_fields(text: str, name: str) -> list[tuple[str, object]]:
    """(field, ctypes type) of ``struct name`` in C source ``text``, in order.  Each
    declaration is ``type a, b, c[n];`` with a type of :data:`C_TYPES` or a pointer."""
    fields = []
    for decl in struct_text(text, name).split(";"):
        decl = decl.replace("const ", "").replace("*", " * ").replace("[", " [")
        if not decl.strip():
            continue
        first, *more = decl.split(",")
        words = first.split()
        end = len(words) - 1 - (words[-1].startswith("["))   # the first declarator's name
        start = end
        while start > 0 and words[start - 1] == "*":
            start -= 1
        typ = " ".join(words[:start])
        for item in [" ".join(words[start:]), *more]:
            star, field, count = re.fullmatch(r"\s*((?:\*\s*)*)(\w+)\s*(?:\[\s*(\d+)\s*\])?\s*",
                                              item).groups()
            ctype = ctypes.c_void_p if star else C_TYPES[typ]
            fields.append((field, ctype * int(count) if count else ctype))
    return fields


def c_struct(text: str, name: str) -> type[ctypes.Structure]:
    """A ctypes.Structure with the fields of ``struct name`` in C source ``text``."""
    return type(name, (ctypes.Structure,), {"_fields_": struct_fields(text, name),
                                            "__doc__": f"``struct {name}``, read from C."})


def field_address(struct: ctypes.Structure, name: str) -> int:
    """The address of field ``name`` of ``struct`` (for C to write it in place)."""
    return ctypes.addressof(struct) + getattr(type(struct), name).offset


UploadCall = c_struct(SOURCE.read_text(), "duelq_upload")
StepCall = c_struct(SOURCE.read_text(), "duelq_step")
ReplayStepCall = c_struct(SOURCE.read_text(), "duelq_replay_step")
ReplayRunCall = c_struct(SOURCE.read_text(), "duelq_replay_run")
StepArgs = c_struct(kernel_source("learner_step.cu"), "StepArgs")
SampleArgs = c_struct(kernel_source("replay.cu"), "SampleArgs")
CommitArgs = c_struct(kernel_source("replay.cu"), "CommitArgs")
InsertArgs = c_struct(kernel_source("replay.cu"), "InsertArgs")
CheckArgs = c_struct(kernel_source("replay.cu"), "CheckArgs")


class NativeUnavailable(RuntimeError):
    """The C host calls cannot be used here (no compiler, no libcuda...): the reason."""


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
    """The shared library built from :data:`SOURCE` (compiled once per source, compiler,
    flags and machine; later calls find it in :func:`cache_dir`, unless ``again``)."""
    try:
        cc = compiler()
        flags = FLAGS
        tag = hashlib.sha256(SOURCE.read_bytes() + repr(
            (cc, flags, platform.machine())).encode()).hexdigest()[:16]
        lib = cache_dir() / f"duelq-native-{tag}.so"
    except (OSError, RuntimeError, ValueError) as exc:   # no source, no home, a bad $CC
        raise NativeUnavailable(f"cannot build {SOURCE.name}: {exc}") from exc
    if lib.exists() and not again:
        return lib
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            done = subprocess.run([*cc, *flags, "-o", str(out), str(SOURCE), "-ldl",
                                   "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise NativeUnavailable(f"{shlex.join(cc)} failed on {SOURCE.name}: "
                                        f"{done.stderr.strip()[-500:]}")
            out.replace(lib)   # atomic: a concurrent build leaves one whole file
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"cannot build {SOURCE.name} with {shlex.join(cc)}: "
                                f"{exc}") from exc
    return lib


class Native:
    """The built library's functions, typed; see server/core/native.c."""

    def __init__(self, path: Path):
        self.path = path
        self._cuda_ready = False
        keeps_gil = ctypes.PyDLL(str(path))      # calls of a few µs: no GIL hand-over
        releases_gil = ctypes.CDLL(str(path))    # the step waits for the device
        self.copy = keeps_gil.duelq_copy
        self.copy.argtypes = (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p,
                              ctypes.c_size_t)
        self.block_totals = keeps_gil.duelq_block_totals
        self.block_totals.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p)
        self.block_totals.restype = None
        self.stream_copy = keeps_gil.duelq_stream_copy   # (dst, src bytes, offset, n)
        self.stream_copy.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                     ctypes.c_size_t)
        self.stream_copy.restype = None
        self.step = releases_gil.duelq_step
        self.step.argtypes = (ctypes.c_void_p,)
        self.replay_run = releases_gil.duelq_replay_run   # 3 launches a step
        self.replay_run.argtypes = (ctypes.c_void_p,)
        self.replay_wait = releases_gil.duelq_replay_wait
        self.replay_wait.argtypes = (ctypes.c_void_p,)
        self._init = keeps_gil.duelq_init

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


_lock = threading.Lock()
_loaded: dict[Path, Native] = {}   # one Native per library file, shared by every backend


def load(*, cuda: bool = True) -> Native:
    """The C host calls, built if needed; with ``cuda``, its driver entry points resolved.
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
        log.info("relay buffers are written with plain copies: %s", exc)
        return None
