"""Checkpoints: the whole learner state on disk, written atomically, read back strictly.

One checkpoint is one ``ckpt-{step:012d}.safetensors`` file.  The arrays (θ, θ⁻,
the Adam moments, the ISV values and its observed flags as uint8) are safetensors
tensors; the rest is JSON in the safetensors header metadata (key ``duelq``:
format version, step, config, creation time, backend), next to a SHA-256
(key ``duelq.sha256``) over that JSON and every tensor's name, dtype, shape and
bytes.  Optional *extras* (opaque byte blobs the server saves with the state,
such as its idempotency records) are uint8 tensors ``extra.<name>``, covered by
the same digest, so they are as atomic and as checked as the state itself.  Why safetensors: loading parses a small JSON header and copies raw bytes,
so, unlike pickle (``np.save`` of objects, ``torch.save``), reading a file never
executes code; the data can be memory-mapped without copies; it is well kept
(Hugging Face) and language-neutral, so any tool can inspect a checkpoint.

Writing: temp file in the same directory, flush, fsync, ``os.replace`` to the
final name, fsync of the directory, then prune to the newest ``keep``.  A crash
leaves at most a stray ``.ckpt-*.tmp`` file, which readers ignore and the next
save deletes; a final name never holds a partial file.  One writer per directory.

Reading is strict: a corrupt file, another format version or a config that
differs is refused with :class:`CheckpointError`, never replaced by fresh state or
an older file.  Every config field must match unless the caller allows it to
change; only fields in :data:`TUNABLE_FIELDS` may be allowed.  Fields outside that
set (hidden_dim, n_actions, isv_size, isv_slots, optimizer; replay_capacity,
replay_dtype and replay_alpha, which fix a saved replay buffer's shapes and leaves) fix
the tensors' shapes or meaning, so resuming across a change in them would be meaningless.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import safetensors
import safetensors.numpy

from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import InvalidArgument, LearnerError
from duelq.server.core.state import LearnerState
from duelq.wire.types import PARAM_NAMES, Params

#: Bumped whenever the file layout changes; ``format_version`` is the one key
#: every version keeps, so a mismatch is reported as such.
FORMAT_VERSION = 2

#: Config fields a resume may be allowed to change (opt-in, per field): they steer
#: future steps but do not change the meaning of the stored tensors.
TUNABLE_FIELDS = frozenset({
    "lr", "beta1", "beta2", "adam_eps", "huber_kappa", "double_dqn", "max_grad_norm",
    "tau", "target_update_period", "priority_eps", "step_entropy_slot",
    "step_entropy_alpha", "seed", "replay_beta", "replay_beta_steps", "replay_batch_size",
    "replay_min_size", "replay_ratio", "replay_seed",
})

META_KEY = "duelq"
DIGEST_KEY = "duelq.sha256"
GROUPS = ("params", "target", "adam_m", "adam_v")
_NAME = re.compile(r"ckpt-(\d{12,})\.safetensors")
_TMP_PREFIX, _TMP_SUFFIX = ".ckpt-", ".tmp"
_EXTRA_PREFIX = "extra."
_EXTRA_NAME = re.compile(r"[a-z0-9_]{1,64}")
_save_lock = threading.Lock()

log = logging.getLogger(__name__)


class CheckpointError(LearnerError):
    """A checkpoint could not be written or was refused; names the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"checkpoint {path}: {problem}")
        self.path = Path(path)
        self.problem = problem


def checkpoint_name(step: int) -> str:
    """The final file name of the checkpoint at ``step``."""
    return f"ckpt-{step:012d}.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    """One verified checkpoint: the state, its extras, where it was read from, and the
    configuration it was written under."""

    state: LearnerState
    extras: dict[str, bytes]
    path: Path
    config: LearnerConfig


def _check_keep(keep: object) -> None:
    """How many checkpoints to keep: an integer ≥ 1, else :class:`InvalidArgument`."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InvalidArgument("keep", f"must be an integer ≥ 1, got {keep!r}")


def save_checkpoint(directory: str | os.PathLike, state: LearnerState, config: LearnerConfig,
                    *, keep: int = 3, backend: str | None = None,
                    extras: Mapping[str, bytes] | None = None) -> Path:
    """Write ``state`` atomically to ``directory``, prune to the newest ``keep``; return the path.

    ``extras`` maps names (``[a-z0-9_]``, ≤ 64 characters) to byte blobs stored
    in the same file.  A checkpoint of the same step is replaced.  Refuses to
    write below the newest step already there (it would be ignored on resume),
    and a state that does not fit ``config``.  Write failures raise
    :class:`CheckpointError`, leaving no file.
    """
    _check_keep(keep)
    directory = Path(directory)
    path = directory / checkpoint_name(state.step)
    tensors = _state_tensors(state, config, path)
    for name, blob in (extras or {}).items():
        if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name):
            raise InvalidArgument("extras", f"name {name!r} must match {_EXTRA_NAME.pattern}")
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise InvalidArgument("extras", f"{name!r} must be bytes, got {type(blob).__name__}")
        tensors[_EXTRA_PREFIX + name] = np.frombuffer(bytes(blob), np.uint8)
    info = {"format_version": FORMAT_VERSION, "step": state.step, "config": config.to_dict(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    if backend is not None:
        info["backend"] = backend
    data = _encode(tensors, info)

    with _save_lock:
        directory.mkdir(parents=True, exist_ok=True)
        existing = _checkpoints(directory)
        if existing and existing[-1][0] > state.step:
            raise CheckpointError(path, f"refusing to write step {state.step}: the directory "
                                        f"already holds a newer one, {existing[-1][1].name}")
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(directory)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise CheckpointError(path, f"write failed: {exc}") from exc
            raise
        try:
            for _, old in _checkpoints(directory)[:-keep]:
                old.unlink(missing_ok=True)
            for stray in directory.glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}"):
                stray.unlink(missing_ok=True)
        except OSError as exc:
            raise CheckpointError(path, f"saved, but pruning failed: {exc}") from exc
    return path


def changed_fields(stored: LearnerConfig, config: LearnerConfig) -> list[str]:
    """The names of the fields in which ``config`` differs from ``stored``, in field order."""
    return [f.name for f in fields(LearnerConfig)
            if getattr(stored, f.name) != getattr(config, f.name)]


def read_latest(directory: str | os.PathLike, config: LearnerConfig, *,
                allow_changes: Iterable[str] = ()) -> Checkpoint | None:
    """The newest checkpoint in ``directory`` (the highest step); None if there is none.

    If it is invalid this raises :class:`CheckpointError`; it never falls back to an
    older file.  A missing directory holds none.
    """
    found = _checkpoints(Path(directory))
    if not found:
        return None
    return read_checkpoint(found[-1][1], config, allow_changes=allow_changes)


def read_checkpoint(path: str | os.PathLike, config: LearnerConfig, *,
                    allow_changes: Iterable[str] = ()) -> Checkpoint:
    """Read and verify one checkpoint for a learner configured as ``config``.

    ``allow_changes`` names fields of :data:`TUNABLE_FIELDS` that may differ from
    the stored config; any other difference raises :class:`CheckpointError`.
    """
    allowed = set(allow_changes)
    if not allowed <= TUNABLE_FIELDS:
        raise InvalidArgument("allow_changes", f"{sorted(allowed - TUNABLE_FIELDS)} may not "
                              f"change on resume; tunable: {sorted(TUNABLE_FIELDS)}")
    path = Path(path)

    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(path, problem)

    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except safetensors.SafetensorError as exc:
        raise refuse(f"not a readable safetensors file, truncated or corrupt ({exc})") from exc
    except OSError as exc:
        raise refuse(f"cannot read: {exc}") from exc
    if META_KEY not in meta or DIGEST_KEY not in meta:
        raise refuse(f"no {META_KEY!r} metadata; not a duelq checkpoint")
    try:
        info = json.loads(meta[META_KEY])
    except ValueError as exc:
        raise refuse(f"metadata is not valid JSON ({exc})") from exc
    version = info.get("format_version") if isinstance(info, dict) else None
    if version != FORMAT_VERSION:
        raise refuse(f"format version {version!r}; this build reads version {FORMAT_VERSION}")
    if _digest(meta[META_KEY], tensors) != meta[DIGEST_KEY]:
        raise refuse("SHA-256 mismatch: the file is corrupt (flipped bits or a partial write)")

    try:
        step, stored = info["step"], LearnerConfig.from_dict(info["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise refuse(f"metadata lacks a valid step or config ({exc})") from exc
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise refuse(f"step must be an integer ≥ 0, got {step!r}")
    refused = [name for name in changed_fields(stored, config) if name not in allowed]
    if refused:
        diff = "; ".join(f"{name}: checkpoint {getattr(stored, name)!r}, "
                         f"server {getattr(config, name)!r}" for name in refused)
        raise refuse(f"config mismatch ({diff})")
    extras = {name[len(_EXTRA_PREFIX):]: tensors.pop(name) for name in list(tensors)
              if name.startswith(_EXTRA_PREFIX)}
    for name, blob in extras.items():
        if blob.dtype != np.uint8 or blob.ndim != 1 or not _EXTRA_NAME.fullmatch(name):
            raise refuse(f"extra {name!r} is {blob.dtype}{list(blob.shape)}, expected a "
                         f"uint8 vector named like {_EXTRA_NAME.pattern}")
    problem = _layout_problem(tensors, config)
    if problem:
        raise refuse(problem)
    match = _NAME.fullmatch(path.name)
    if match and int(match.group(1)) != step:
        raise refuse(f"holds step {step}, but its name says step {int(match.group(1))}")
    observed = tensors["isv_observed"]
    if observed.max(initial=0) > 1:
        raise refuse("isv_observed holds values other than 0 and 1")

    def group(name: str) -> Params:
        return Params(*(tensors[f"{name}.{p}"] for p in PARAM_NAMES))

    state = LearnerState(params=group("params"), target=group("target"),
                         adam_m=group("adam_m"), adam_v=group("adam_v"), step=step,
                         isv=tensors["isv"], isv_observed=observed.astype(bool))
    return Checkpoint(state, {name: blob.tobytes() for name, blob in extras.items()}, path,
                      stored)


class CheckpointPolicy:
    """When to save: every ``every_steps`` steps and/or every ``every_seconds`` seconds.

    0 turns a trigger off; with both off no periodic save is ever due (saves then
    happen only on demand and at shutdown).  ``step`` and ``now`` are the state's
    step and the clock at start (a resumed learner starts at its step).  Times are
    readings of one clock the caller passes in, e.g. ``time.monotonic()``.  Not
    thread-safe: call it under the lock that serialises steps.
    """

    def __init__(self, every_steps: int = 0, every_seconds: float = 0.0, *,
                 step: int = 0, now: float):
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 0:
            raise InvalidArgument("every_steps", f"must be an integer ≥ 0, got {every_steps!r}")
        if isinstance(every_seconds, bool) or not isinstance(every_seconds, (int, float)) \
                or not math.isfinite(every_seconds) or every_seconds < 0:
            raise InvalidArgument("every_seconds", f"must be a finite number ≥ 0, "
                                                   f"got {every_seconds!r}")
        self.every_steps = every_steps
        self.every_seconds = float(every_seconds)
        self.record(step, now)

    def maybe_save(self, step: int, now: float) -> bool:
        """True when a save is due, counting it as done; the caller then saves.

        Due when the step has advanced since the last save and ``every_steps``
        steps or ``every_seconds`` seconds have passed.  If that save fails, the
        next chance comes one period later, not on every following step.
        """
        if step <= self._step:
            return False
        due = ((self.every_steps > 0 and step - self._step >= self.every_steps)
               or (self.every_seconds > 0 and now - self._time >= self.every_seconds))
        if due:
            self.record(step, now)
        return due

    def record(self, step: int, now: float) -> None:
        """Note a save made for another reason (on demand, shutdown); restarts both periods."""
        self._step, self._time = step, now


def _state_tensors(state: LearnerState, config: LearnerConfig,
                   path: Path) -> dict[str, np.ndarray]:
    """The named tensors of ``state``, checked against ``config``'s layout."""
    if state.isv_observed.dtype != np.bool_:
        raise CheckpointError(path, f"isv_observed must be bool, got {state.isv_observed.dtype}")
    tensors = {f"{g}.{p}": getattr(getattr(state, g), p) for g in GROUPS for p in PARAM_NAMES}
    tensors["isv"] = state.isv
    tensors["isv_observed"] = state.isv_observed.astype(np.uint8)
    problem = _layout_problem(tensors, config)
    if problem:
        raise CheckpointError(path, f"refusing to write a state that does not fit the "
                                    f"config: {problem}")
    return {name: np.ascontiguousarray(a) for name, a in tensors.items()}


def _layout_problem(tensors: Mapping[str, np.ndarray], config: LearnerConfig) -> str | None:
    """What is wrong with the names, dtypes and shapes of ``tensors``, or None."""
    H, N, S = config.hidden_dim, config.n_actions, config.isv_size
    shapes = {"w_v": (H,), "b_v": (1,), "w_a": (H, N), "b_a": (N,)}
    expected = {f"{g}.{p}": (np.float32, shapes[p]) for g in GROUPS for p in PARAM_NAMES}
    expected["isv"] = (np.float32, (S,))
    expected["isv_observed"] = (np.uint8, (S,))
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        return f"tensors missing {missing}, unexpected {extra}"
    for name, (dtype, shape) in expected.items():
        a = tensors[name]
        if a.dtype != dtype or a.shape != shape:
            return (f"tensor {name} is {a.dtype}{list(a.shape)}, expected "
                    f"{np.dtype(dtype)}{list(shape)}")
    return None


def _encode(tensors: Mapping[str, np.ndarray], info: Mapping[str, Any]) -> bytes:
    """The safetensors bytes of ``tensors`` with ``info`` as JSON metadata and its digest."""
    text = json.dumps(info, sort_keys=True)
    return safetensors.numpy.save(dict(tensors), metadata={
        META_KEY: text, DIGEST_KEY: _digest(text, tensors)})


def _digest(text: str, tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the metadata JSON and each tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(text.encode())
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every final-named checkpoint in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), directory / name)
             for name in names if (m := _NAME.fullmatch(name))]
    return sorted(found)


def _fsync_dir(directory: Path) -> None:
    """Make the directory entry of a rename durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Returns a consistent (state, extras) pair to save; the caller provides the consistency.
Snapshot = Callable[[], "tuple[LearnerState, Mapping[str, bytes]]"]


class CheckpointWriter:
    """Saves one learner's checkpoints to one directory: on demand, by a policy, at close.

    ``snapshot`` returns a consistent (state, extras) pair; the server takes it
    under the lock that serialises steps, so a checkpoint holds exactly the
    steps applied before it and the idempotency records of those steps.  Saves
    are serialised here (snapshot and write under one lock), so files appear in
    step order.  Periodic saves run on a background thread, off the step path:
    :meth:`notify` only records the step count and wakes the thread when
    ``every_steps`` have passed; ``every_seconds`` is checked at least once a
    second.  A failed periodic save is logged and retried one period later.
    """

    def __init__(self, directory: str | os.PathLike, config: LearnerConfig, snapshot: Snapshot,
                 *, keep: int = 3, every_steps: int = 0, every_seconds: float = 0.0,
                 step: int = 0, backend: str | None = None):
        _check_keep(keep)   # at construction, not at the first save
        self.directory, self.config, self.keep, self.backend = Path(directory), config, keep, backend
        self._snapshot = snapshot
        self._policy = CheckpointPolicy(every_steps, every_seconds, step=step,
                                        now=time.monotonic())
        self._lock = threading.Lock()      # one save at a time; guards the policy
        self._wake = threading.Event()
        self._latest = step                # newest step notified
        self._due = step + every_steps if every_steps else -1  # step that makes a save due
        self._closed = False
        self._final: tuple[Path, int] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the periodic saver (a daemon thread), if a period is set."""
        if self._policy.every_steps or self._policy.every_seconds:
            self._thread = threading.Thread(target=self._run, name="duelq-checkpoint",
                                            daemon=True)
            self._thread.start()

    def notify(self, step: int) -> None:
        """Steps up to ``step`` were applied; cheap enough for the step path (no I/O, no
        lock).  Callers may tell out of order (the replay loop's runs end outside the apply
        lock): the latest step is the largest told."""
        self._latest = max(self._latest, step)
        if 0 <= self._due <= step:
            self._wake.set()

    def save(self) -> tuple[Path, int]:
        """Snapshot and write a checkpoint now: (path, step); raises :class:`CheckpointError`."""
        with self._lock:
            return self._save_locked()

    def close(self, *, final: bool = True) -> tuple[Path, int] | None:
        """Stop the periodic saver; with ``final``, write one last checkpoint: (path, step)."""
        with self._lock:
            if self._closed:
                return self._final
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._final = self.save() if final else None
        return self._final

    def _save_locked(self) -> tuple[Path, int]:
        started = time.perf_counter()
        state, extras = self._snapshot()
        snapped = time.perf_counter()
        path = save_checkpoint(self.directory, state, self.config, keep=self.keep,
                               backend=self.backend, extras=extras)
        self._policy.record(state.step, time.monotonic())
        if self._policy.every_steps:
            self._due = state.step + self._policy.every_steps
        done = time.perf_counter()
        log.info("checkpoint %s: step %d, %d bytes, snapshot %.1f ms, write %.1f ms",
                 path, state.step, path.stat().st_size, 1e3 * (snapped - started),
                 1e3 * (done - snapped))
        return path, state.step

    def _run(self) -> None:
        tick = min(self._policy.every_seconds, 1.0) or None
        while True:
            self._wake.wait(tick)
            self._wake.clear()
            if self._closed:
                return
            with self._lock:
                if not self._policy.maybe_save(self._latest, time.monotonic()):
                    continue
                try:
                    self._save_locked()
                except Exception:  # noqa: BLE001 — keep serving; the next period retries
                    log.exception("periodic checkpoint to %s failed", self.directory)
                    if self._policy.every_steps:
                        self._due = self._latest + self._policy.every_steps
