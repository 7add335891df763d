"""The learner: validates inputs, runs one step on a backend, commits or refuses it.

This is the object the gRPC service calls.  Every public method checks its
inputs first and raises :class:`InvalidArgument` naming the field; a refused
call leaves the state bit-identical.  Calls are serialised by one lock, so
steps apply one at a time in arrival order.  :meth:`Learner.prepare` (and
:meth:`Learner.prepare_insert`) does a step's (an insert's) checks and starts its copy
to the device without that lock, so the service can run it while another step holds
the device.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from duelq.server.core.backend import Backend, StepOutputs, Upload
from duelq.server.core.batch import (Batch, PackedBatch, validate_actions, validate_batch,
                                    validate_features)
from duelq.server.core.config import LearnerConfig
from duelq.server.core.errors import (InvalidArgument, NonFiniteStep, ReplayNotReady,
                                      ReplayTooLarge, ResourceExhausted)
from duelq.server.core.replay import (ReferenceReplay, ReplayBuffer, ReplayRun,
                                      ReplayState, RunningReplay, replay_bytes,
                                      validate_transitions)
from duelq.server.core.state import LearnerState, Params
from duelq.wire.types import FEATURE_DTYPES, ReplayInfo, Transitions

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cuda", "reference")


@dataclass
class StepResult:
    """What a committed step returns (docs/design.md §1 step 9).

    Read-only by convention; not frozen, being built per request (docs/benchmarks.md)."""

    loss: float               # mean importance-weighted Huber loss
    td_errors: np.ndarray     # [B] float32, before the update
    priorities: np.ndarray    # [B] float32, |δ| + ε
    q_taken_mean: float       # mean Q_θ(h_t)[a] before the update
    grad_norm: float          # global gradient norm before clipping
    step: int                 # steps applied, this one included: the weights' version
    entropy: float | None     # batch action entropy if step_entropy_slot is set


@dataclass(frozen=True)
class EntropyResult:
    entropy: float  # nats, in [0, ln N]
    ema: float      # the slot's value after the update
    slot: int       # the slot index written


@dataclass(frozen=True)
class ISVValue:
    slot: int
    name: str       # "" if the index has no name
    value: float
    observed: bool


def overflow(out: StepOutputs) -> str:
    """What a non-finite step overflowed: the first quantity in the step's order that is not
    finite (TD errors, loss, mean taken Q, gradient), else the update's results."""
    td = out.td_errors
    bad = int(np.count_nonzero(~np.isfinite(td)))
    if bad:
        return f"{bad} of {td.shape[0]} TD errors are non-finite (the Q-values overflowed)"
    if not math.isfinite(out.loss):
        return f"the loss overflowed to {out.loss:g} (gradient norm {out.grad_norm:g})"
    if not math.isfinite(out.q_taken_mean):
        return f"the mean taken Q-value overflowed to {out.q_taken_mean:g}"
    if not math.isfinite(out.grad_norm):
        return f"the gradient overflowed (norm {out.grad_norm:g})"
    return (f"the update would make the weights or the Adam moments non-finite (gradient "
            f"norm {out.grad_norm:g})")


@dataclass(frozen=True)
class InsertResult:
    """What an insert into the replay buffer reports."""

    rows: int       # rows this insert stored
    size: int       # rows in the buffer after it
    inserted: int   # rows inserted over the buffer's life
    step: int       # steps applied so far (== weights version)


class _Staged:
    """A context manager: leaving it gives unused staging space (its upload) back."""

    upload: Upload | None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.upload is not None:
            self.upload.close()


@dataclass
class Prepared(_Staged):
    """A validated batch, maybe already on its way to the device (:meth:`Learner.prepare`).

    Read-only by convention; not frozen, being built per request (docs/benchmarks.md).
    """

    batch: Batch | PackedBatch
    upload: Upload | None


@dataclass
class PreparedInsert(_Staged):
    """An insert's validated rows, as the buffer stores them, maybe already on their way to
    the device (:meth:`Learner.prepare_insert`)."""

    rows: Transitions
    upload: Upload | None


def cuda_usable() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a GPU, else (False, why not)."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (the cuda extra: pip install 'duelq[server,cuda]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError, missing driver…
        return False, f"{type(exc).__name__}: {exc}"
    if count < 1:
        return False, "no CUDA device visible"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    return True, props["name"].decode() if isinstance(props["name"], bytes) else props["name"]


def make_backend(kind: str, config: LearnerConfig, state: LearnerState) -> Backend:
    """Build the backend ``kind`` (auto|cuda|reference); auto says which it picked."""
    if kind not in BACKENDS:
        raise InvalidArgument("backend", f"must be one of {BACKENDS}, got {kind!r}")
    if kind in ("auto", "cuda"):
        ok, why = cuda_usable()
        if ok:
            from duelq.server.core.cuda import CudaBackend
            backend: Backend = CudaBackend(config, state)
            log.info("backend %s: cuda on %s", kind, backend.device)
            return backend
        if kind == "cuda":
            raise RuntimeError(f"--backend cuda: no usable GPU ({why})")
        log.info("backend auto: reference (NumPy), because CUDA is not usable: %s", why)
    from duelq.server.core.reference import ReferenceBackend
    return ReferenceBackend(config, state)


def make_replay(config: LearnerConfig, backend: Backend) -> ReplayBuffer:
    """The replay buffer of ``config`` beside ``backend``: on the device for the cuda
    backend, in host memory otherwise, a wrapper of the cuda backend (the bench's timing
    one) included: it is stepped through the backend's propose and commit.  Raises
    ReplayTooLarge when it cannot be held."""
    if backend.name == "cuda":
        from duelq.server.core.cuda import CudaBackend
        if isinstance(backend, CudaBackend):
            from duelq.server.core.cuda_replay import CudaReplay
            return CudaReplay(config, backend)
    needed = replay_bytes(config)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > memory:
        raise ReplayTooLarge(f"replay_capacity={config.replay_capacity} needs "
                             f"{needed / 2**30:.2f} GiB of host memory; this host has "
                             f"{memory / 2**30:.2f} GiB")
    return ReferenceReplay(config, backend)


class _Settled:
    """The learner's lock, with any replay run left running (:meth:`Learner.start_replay`)
    finished first.  A class rather than a generator: it is on every step's path."""

    __slots__ = ("_learner",)

    def __init__(self, learner: "Learner"):
        self._learner = learner

    def __enter__(self) -> None:
        learner = self._learner
        learner.lock.acquire()
        if learner._running is not None:
            running, learner._running = learner._running, None
            try:
                running.finish()
            except BaseException:
                learner.lock.release()
                raise

    def __exit__(self, *exc) -> None:
        self._learner.lock.release()


class Learner:
    """One Dueling-DQN learner: state on a backend, steps applied one at a time."""

    def __init__(self, config: LearnerConfig, *, backend: str | Backend = "auto",
                 state: LearnerState | None = None, max_batch_size: int = 65536):
        if max_batch_size < 1:
            raise InvalidArgument("max_batch_size", f"must be ≥ 1, got {max_batch_size}")
        self.config = config
        self.max_batch_size = max_batch_size
        state = state if state is not None else LearnerState.initial(config)
        self.backend = (backend if isinstance(backend, Backend)
                        else make_backend(backend, config, state))
        self.lock = threading.Lock()
        """Serialises the backend's use: steps, inserts, reads, snapshots."""
        self._running: RunningReplay | None = None   # a replay run left running
        self._settled = _Settled(self)
        """``with self._settled:`` the lock, with a run left running finished first."""
        self.replay: ReplayBuffer | None = (make_replay(config, self.backend)
                                            if config.replay_capacity else None)
        """The server-side replay buffer (replay_capacity > 0), else None."""

    @property
    def step_count(self) -> int:
        """Steps applied, a run left running included (it is finished first)."""
        with self._settled:
            return self.backend.step

    def prepare(self, batch: Batch) -> Prepared:
        """Validate ``batch`` and start its copy to the device; no lock is taken."""
        batch = validate_batch(batch, self.config, self.max_batch_size,
                               check_values=not self.backend.checks_values,
                               keep=self.backend.feature_dtypes)
        return Prepared(batch, self.backend.upload(batch))

    def prepare_packed(self, packed: PackedBatch) -> Prepared:
        """:meth:`prepare` of a batch already in the packed layout, whose dtypes and shapes
        were checked, all but against this learner: a backend that checks values itself
        gets it as it is once H and B pass here; otherwise, and to word a refusal, it is
        prepared as the :class:`Batch` of its arrays."""
        backend = self.backend
        if (backend.checks_values
                and packed.hidden_dim == self.config.hidden_dim
                and packed.size <= self.max_batch_size
                and (packed.dtype == FEATURE_DTYPES[0] or packed.dtype in backend.feature_dtypes)):
            return Prepared(packed, backend.upload(packed))
        return self.prepare(packed.batch())

    def step(self, batch: Batch | Prepared) -> StepResult:
        """Validate ``batch`` (unless prepared), run one step, commit it unless it is
        non-finite."""
        prepared = batch if isinstance(batch, Prepared) else self.prepare(batch)
        with prepared, self._settled:
            out = self.backend.propose(prepared.batch, prepared.upload)
            if not out.inputs_valid:  # the backend's check; the host names the culprit
                self.backend.discard()
                checked = prepared.batch
                validate_batch(checked.batch() if type(checked) is PackedBatch else checked,
                               self.config, self.max_batch_size)
                raise RuntimeError("the backend reported an invalid input value the host "
                                   "does not find")
            if not out.finite:
                self.backend.discard()
                raise NonFiniteStep(f"step {self.backend.step + 1} refused: {overflow(out)}; "
                                    f"the state is unchanged")
            self.backend.commit()
            step = self.backend.step
        return StepResult(loss=out.loss, td_errors=out.td_errors, priorities=out.priorities,
                          q_taken_mean=out.q_taken_mean, grad_norm=out.grad_norm,
                          step=step, entropy=out.entropy)

    def q_values(self, h: np.ndarray, target: bool = False) -> np.ndarray:
        """[B, H] features → [B, N] float32 Q-values under θ (or θ⁻)."""
        h = validate_features(h, self.config.hidden_dim, "h")
        if h.shape[0] > self.max_batch_size:
            raise ResourceExhausted(f"h: {h.shape[0]} rows exceed the limit "
                                    f"{self.max_batch_size}")
        with self._settled:
            return self.backend.q_values(h, target)

    def compute_entropy(self, actions: np.ndarray, slot: str | int,
                        alpha: float) -> EntropyResult:
        """Entropy of ``actions`` [M] folded into ISV ``slot`` as an EMA with rate α."""
        index = self.config.slot_index(slot)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
                or not 0 < alpha <= 1:
            raise InvalidArgument("alpha", f"must be in (0, 1], got {alpha!r}")
        actions = validate_actions(actions, self.config.n_actions,
                                   max_len=self.max_batch_size)
        with self._settled:
            entropy, ema = self.backend.entropy(actions, index, float(alpha))
        return EntropyResult(entropy=entropy, ema=ema, slot=index)

    def weights(self, target: bool = False) -> tuple[Params, int]:
        """Host copy of θ (or θ⁻) and its version."""
        with self._settled:
            return self.backend.weights(target), self.backend.step

    def read_isv(self, slots: Iterable[str | int]) -> list[ISVValue]:
        """Values of ISV slots given by name or index (empty → every named slot); an unknown
        one is refused naming its place, ``slots[i]``."""
        slots = list(slots) or sorted(self.config.isv_slots, key=self.config.isv_slots.get)
        indices = np.array([self.config.slot_index(s, f"slots[{i}]") for i, s in enumerate(slots)],
                           dtype=np.int64)
        names = {i: n for n, i in self.config.isv_slots.items()}
        with self._settled:
            values, observed = self.backend.read_isv(indices)
        return [ISVValue(int(i), names.get(int(i), ""), float(v), bool(o))
                for i, v, o in zip(indices, values, observed)]

    def snapshot(self) -> LearnerState:
        """Host copy of the whole state (for checkpoints and tests)."""
        with self._settled:
            return self.backend.snapshot()

    def load(self, state: LearnerState) -> None:
        """Replace the whole state, e.g. from a checkpoint."""
        with self._settled:
            self.backend.load(state)

    # ---- the server-side replay buffer ----------------------------------------------
    def _replay(self) -> ReplayBuffer:
        if self.replay is None:
            raise ReplayNotReady("the server-side replay buffer is off (replay_capacity = 0)")
        return self.replay

    def prepare_insert(self, transitions: Transitions | PackedBatch) -> PreparedInsert:
        """Check every row of ``transitions`` and start their copy to the device; no lock is
        taken, so an insert's checks and copy run beside steps.  Rows a front process
        packed (priorities in the weights' place) are copied as they lie: the buffer takes
        every accepted row in its own dtype or, float32, widens 16-bit ones itself.  A buffer
        that checks values on the device does so as they arrive (the host does not read
        them then; it checks them itself when no staging is free); a refusal names its
        field either way."""
        replay = self._replay()
        packed = transitions if type(transitions) is PackedBatch else None
        if packed is not None:
            b = packed.batch()
            transitions = Transitions(b.h_t, b.h_tp1, b.actions, b.rewards, b.dones,
                                      b.discounts, b.weights)
        max_rows = min(self.max_batch_size, self.config.replay_capacity)
        rows = validate_transitions(transitions, self.config, max_rows,
                                    check_values=not replay.checks_values)
        upload = replay.upload(rows if packed is None else packed)
        try:
            if replay.checks_values and (upload is None or not replay.checked(upload)):
                validate_transitions(transitions, self.config, max_rows)   # names the field
                if upload is not None:
                    raise RuntimeError("the device refused an insert's value that the host "
                                       "does not find")
        except BaseException:
            if upload is not None:
                upload.close()
            raise
        return PreparedInsert(rows, upload)

    def insert(self, transitions: Transitions | PreparedInsert) -> InsertResult:
        """Check every row of ``transitions`` (unless prepared), then store them all in the
        replay buffer (a refused insert stores nothing)."""
        replay = self._replay()
        prepared = (transitions if isinstance(transitions, PreparedInsert)
                    else self.prepare_insert(transitions))
        with prepared, self.lock:
            replay.insert(prepared.rows, prepared.upload)
            counters = replay.counters
            return InsertResult(prepared.rows.size, counters["size"], counters["inserted"],
                                self.backend.step)

    def train_replay(self, steps: int) -> ReplayRun:
        """Up to ``steps`` learner steps drawn from the replay buffer (fewer only when one
        would be non-finite: it is refused, as a batch's would be, and the run stops)."""
        return self.finish_replay(self.start_replay(steps))

    def start_replay(self, steps: int) -> RunningReplay:
        """:meth:`train_replay`, begun on the device and left running: inserts may go on
        meanwhile (their rows go in after the run's steps); anything else that uses the
        learner first waits for the run.  :meth:`finish_replay` gives what it did."""
        replay = self._replay()
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidArgument("steps", f"must be an integer ≥ 1, got {steps!r}")
        with self._settled:
            replay.ready()
            self._running = replay.start(steps)
            return self._running

    def finish_replay(self, running: RunningReplay) -> ReplayRun:
        """Wait for a run that :meth:`start_replay` began, without the lock, then finish it
        (unless a call that needed the learner did already)."""
        running.wait()
        with self._settled:
            return running.finish()

    def replay_due(self) -> int:
        """Learner steps that replay_ratio asks for now (0 with the buffer off)."""
        if self.replay is None:
            return 0
        with self._settled:
            return self.replay.due_steps()

    def replay_info(self) -> ReplayInfo:
        """The replay buffer's figures."""
        replay = self._replay()
        with self._settled:
            return replay.info()

    def replay_snapshot(self) -> ReplayState:
        """Host copy of the whole replay buffer (for checkpoints and tests)."""
        replay = self._replay()
        with self._settled:
            return replay.snapshot()

    def load_replay(self, state: ReplayState) -> None:
        """Replace the whole replay buffer, e.g. from a checkpoint (checked against the
        config: InvalidArgument saying what does not fit)."""
        replay = self._replay()
        problem = state.problem(self.config)
        if problem:
            raise InvalidArgument("replay", problem)
        with self._settled:
            replay.load(state)
