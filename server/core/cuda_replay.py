"""The replay buffer on the device (kernels/replay.cu) beside a :class:`CudaBackend`.

Allocated at start: the rows (features in the buffer's dtype, 16-bit ones as their bits),
priorities, leaves, the tree's sums and mins, the write-back's owner marks, the gathered
batch and a run's report; each upload buffer's check word at its first insert.  A buffer
that does not fit the device's free memory is refused before any of it is allocated
(:class:`ReplayTooLarge`).  An insert's rows reach the device in one of the backend's
upload buffers, copied before the insert takes the learner's lock and checked there by
``replay_check`` on the upload stream, so the host never reads them
(:meth:`CudaReplay.upload`); with no buffer free, the host checks them and they go
through the backend's own step input buffer at the insert (:meth:`CudaBackend.stage`;
the learner's lock is held).  The insert itself is enqueued
behind whatever the stream holds, a run left running included, and not waited for.

A run of K ≤ :data:`CALL_STEPS` steps is one C call (server/core/native.c's
``duelq_replay_run``, without the GIL) that enqueues per step the draw (``replay_sample``:
rows, weights, the gather into learner_step's packed inputs), the backend's own
``learner_step`` on them, and ``replay_commit``, which applies the step on the device (the
proposed state copied over the current one, priorities written back, the tree updated) or,
for a non-finite step, marks the run halted, after which the run's remaining steps change
nothing; then it enqueues the copy back of the run's report (the steps committed, whether
it halted, each step's per-block partials, which the host adds up as for a batch step)
and an event, and returns: the run is left running (:meth:`CudaReplay.start`), and
finishing it waits for that event (``duelq_replay_wait``) and makes the counters follow
the report.  The host fills each step's own values (draw, owner mark, β, epoch, barrier
targets, Adam's step t) beforehand; C writes them into the three kernels' argument structs
before each launch.
No other host round trip: a step's decision is the device's, made as the host's
:meth:`CudaBackend.propose` would.

The draws, weights, priorities and tree are those of :class:`ReferenceReplay` bit for bit
(server/core/replay.py; tests/test_cuda_replay.py holds them together step by step).
"""

from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np
from cupy_backends.cuda.api import driver

from duelq.server.core.batch import PackedBatch, packed_layout
from duelq.server.core.config import LearnerConfig
from duelq.server.core.backend import Upload
from duelq.server.core.cuda import (FEATURE_KINDS, THREADS, CudaBackend, _Uploaded,
                                    kernel_source)
from duelq.server.core.errors import ReplayTooLarge
from duelq.server.core.native import (CheckArgs, CommitArgs, InsertArgs, ReplayRunCall,
                                      ReplayStepCall, SampleArgs, field_address)
from duelq.server.core.replay import (STORAGE_DTYPES, ReplayBuffer, ReplayRun, ReplayState,
                                      RunningReplay, SumTree, after_insert, beta_at,
                                      replay_bytes, tree_layout, tree_levels)
from duelq.wire.types import Batch, Transitions

CALL_STEPS = 64          # steps of one C call, between two syncs (rows of the report)
HEADROOM = 256 << 20     # device memory left free beside the buffer, bytes
_WORD = 0xFFFFFFFF


def _packable(t: Transitions) -> Batch:
    """An insert's rows as the batch whose packed layout replay_insert reads (priorities in
    the weights' place)."""
    return Batch(t.h_t, t.h_tp1, t.actions, t.rewards, t.dones, t.discounts, t.priorities)


def _ran(runs: list[tuple[int, bool, np.ndarray]]) -> ReplayRun:
    """The :class:`ReplayRun` of device runs' (steps committed, halted, figures: gradient
    norm, loss, mean Q)."""
    columns = np.concatenate([f for _, _, f in runs]).reshape(-1, 3) if runs else np.zeros((0, 3))
    norms, losses, q_means = columns.T.copy()
    return ReplayRun(columns.shape[0], bool(runs) and runs[-1][1], losses, q_means, norms)


class _Check:
    """replay_check's word for one upload buffer (on the device and its pinned host copy),
    the event after the copy back, and the kernel's arguments."""

    def __init__(self):
        self.device = cp.empty(1, np.uint32)   # zeroed on the upload stream before each use
        self.host = np.frombuffer(cp.cuda.alloc_pinned_memory(4), np.uint32, 1)
        self.done = cp.cuda.Event(disable_timing=True)
        self.args = CheckArgs(refused=self.device.data.ptr)
        self.params = _params(self.args)


def _params(args: ctypes.Structure) -> ctypes.Array:
    """A kernel's parameter array whose one parameter is ``args`` (keep it with ``args``)."""
    return (ctypes.c_void_p * 1)(ctypes.addressof(args))


def tree_blocks(rows: int, max_blocks: int) -> int:
    """Blocks of a replay_commit or replay_insert that touches ``rows`` leaves: one per 16
    rows, at least 32, at most one per SM.  Every loop in them is grid-strided, so any count
    gives the same bits; more blocks share the rows, but a grid barrier's wait grows with the
    blocks it polls (benchmarks/replay_step.py sweeps the count)."""
    return min(max_blocks, max(32, rows // 16))


def report_bytes(steps: int, blocks: int) -> int:
    """Bytes of the report of a run of ``steps`` on ``blocks`` blocks: the control words
    (halted, steps committed) as uint32, then each step's per-block partials, [steps][5][G]
    float32."""
    return 8 + 4 * steps * 5 * blocks


def device_bytes(config: LearnerConfig, max_blocks: int) -> int:
    """Device memory the buffer of ``config`` takes: :func:`replay_bytes`, the owner marks,
    the gathered batch and the report (steps on up to ``max_blocks`` blocks)."""
    B, H = config.replay_batch_size, config.hidden_dim
    itemsize = STORAGE_DTYPES[config.replay_dtype].itemsize
    gathered = 4 * packed_layout(B, H, itemsize, True)[1]
    return (replay_bytes(config) + 8 * config.replay_capacity + gathered
            + report_bytes(CALL_STEPS, max_blocks))


class CudaReplay(ReplayBuffer):
    """The replay buffer resident on ``backend``'s device, stepped on its stream."""

    checks_values = True

    def __init__(self, config: LearnerConfig, backend: CudaBackend):
        super().__init__(config, backend)
        C, H, B = config.replay_capacity, config.hidden_dim, config.replay_batch_size
        needed = device_bytes(config, backend.max_blocks)
        free, total = cp.cuda.runtime.memGetInfo()
        if needed + HEADROOM > free:
            raise ReplayTooLarge(
                f"replay_capacity={C} ({config.replay_dtype} rows of H={H}) needs "
                f"{needed / 2**30:.2f} GiB of device memory and {HEADROOM >> 20} MiB to "
                f"spare; {backend.device} has {free / 2**30:.2f} GiB free of "
                f"{total / 2**30:.2f} GiB")
        self._dtype = STORAGE_DTYPES[config.replay_dtype]
        self._kind = FEATURE_KINDS[self._dtype]
        self._levels = tree_levels(C)
        self._barrier = 1                    # the next grid barrier's target
        self._mark = 0                       # the last owner mark given: one per draw
                                             # enqueued, so it only grows
        self._compile()
        bits = np.uint16 if self._dtype.itemsize == 2 else np.float32
        stream = backend.stream
        with stream:
            self._h_t = cp.zeros((C, H), bits)           # [C, H] features
            self._h_tp1 = cp.zeros((C, H), bits)
            self._actions = cp.zeros(C, np.int32)        # [C]
            self._rewards = cp.zeros(C, np.float32)      # [C]
            self._dones = cp.zeros(C, np.float32)        # [C]
            self._discounts = cp.zeros(C, np.float32)    # [C]
            self._priorities = cp.zeros(C, np.float32)   # [C]
            self._leaves = cp.zeros(self._levels[0], np.float32)             # [32 n_1]
            self._sums = cp.zeros(sum(self._levels[1:]), np.float64)          # levels 1..D
            self._mins = cp.full(sum(self._levels[1:]), np.inf, np.float32)
            self._owner = cp.zeros(C, np.uint64)         # [C] marks of the last draws
            self._max_priority = cp.ones(1, np.float32)  # [1] the largest priority given
            self._drawn = cp.zeros(B, np.int32)          # [B] rows of the last draw
            self._gathered = cp.zeros(packed_layout(B, H, self._dtype.itemsize, True)[1],
                                      np.float32)        # learner_step's packed inputs
            self._arrivals = cp.zeros(backend.max_blocks, np.uint32)   # [G] barrier flags
            self._ticket = cp.zeros(1, np.uint32)        # [1] update_tree's blocks done
            self._report = cp.zeros(report_bytes(CALL_STEPS, backend.max_blocks), np.uint8)
        stream.synchronize()
        n = self._report.nbytes
        self._report_host = np.frombuffer(cp.cuda.alloc_pinned_memory(n), np.uint8, n)  # pinned
        self._parts_address = self._report_host.ctypes.data + 8   # after the control words
        self._totals = np.empty((CALL_STEPS, 5))   # a run's block totals (_figures)
        self._totals_address = self._totals.ctypes.data
        self._done = cp.cuda.Event(disable_timing=True)   # a run's report is back
        seed = config.replay_seed
        self._sample_args = SampleArgs(   # a draw sets draw, mark and beta
            leaves=self._leaves.data.ptr, sums=self._sums.data.ptr, mins=self._mins.data.ptr,
            rows_t=self._h_t.data.ptr, rows_tp1=self._h_tp1.data.ptr,
            actions=self._actions.data.ptr, rewards=self._rewards.data.ptr,
            dones=self._dones.data.ptr, discounts=self._discounts.data.ptr,
            drawn=self._drawn.data.ptr, owner=self._owner.data.ptr,
            packed=self._gathered.data.ptr, key0=seed & _WORD, key1=seed >> 32, batch=B)
        self._sample_params = _params(self._sample_args)
        self._commit_args = CommitArgs()     # filled in once a run (_commit_for)
        self._commit_params = _params(self._commit_args)
        sample, commit = self._sample_args, self._commit_args
        self._step_values = (ReplayStepCall * CALL_STEPS)()   # each step's own values
        self._call = ReplayRunCall(   # a run sets the step kernel's, the blocks and count
            stream=stream.ptr, sample=self._sample.kernel.ptr, commit=self._commit.kernel.ptr,
            sample_blocks=-(-B // (THREADS // 32)), threads=THREADS,
            sample_params=ctypes.addressof(self._sample_params),
            commit_params=ctypes.addressof(self._commit_params),
            sample_draw=field_address(sample, "draw"), sample_mark=field_address(sample, "mark"),
            sample_beta=field_address(sample, "beta"), commit_mark=field_address(commit, "mark"),
            commit_barrier=field_address(commit, "barrier"),
            commit_stats_row=field_address(commit, "stats_row"),
            steps=ctypes.addressof(self._step_values), report=self._report_host.ctypes.data,
            report_device=self._report.data.ptr, report_bytes=self._report.nbytes,
            done=self._done.ptr)
        self._checks: dict[int, _Check] = {}   # by upload buffer (one upload uses it at a time)
        self._counters = dict(cursor=0, size=0, inserted=0, sampled=0, draws=0)

    def _compile(self) -> None:
        """Compile kernels/replay.cu for the config and write its tree layout."""
        c = self.config
        options = (f"-DHIDDEN_DIM={c.hidden_dim}", f"-DN_ACTIONS={c.n_actions}",
                   f"-DFEATURES={self._kind}", f"-DCAPACITY={c.replay_capacity}",
                   f"-DTREE_DEPTH={len(self._levels) - 1}", "--fmad=false")
        module = cp.RawModule(code=kernel_source("replay.cu"), options=options)
        self._sample = module.get_function("replay_sample")
        self._commit = module.get_function("replay_commit")
        self._insert = module.get_function("replay_insert")
        self._check = module.get_function("replay_check")
        layout = cp.ndarray(2, np.uint32, module.get_global("replay_layout")).get()
        self._tree_barriers, row_bytes = (int(x) for x in layout)
        assert row_bytes == c.hidden_dim * self._dtype.itemsize, "kernel and host disagree"
        for name, values in zip(("tree_offset", "tree_nodes"), tree_layout(c.replay_capacity)):
            cp.ndarray(values.shape, np.int64, module.get_global(name)).set(values)
        cp.cuda.Device().synchronize()

    # ---- counters and state -----------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def snapshot(self) -> ReplayState:
        C, stream = self.config.replay_capacity, self.backend.stream
        with stream:
            got = {name: getattr(self, "_" + name).get(stream=stream) for name in (
                "h_t", "h_tp1", "actions", "rewards", "dones", "discounts", "priorities")}
            leaves = self._leaves[:C].get(stream=stream)
            max_priority = float(self._max_priority.get(stream=stream)[0])
        for name in ("h_t", "h_tp1"):
            got[name] = got[name].view(self._dtype)
        return ReplayState(**got, leaves=leaves, **self._counters, max_priority=max_priority)

    def load(self, state: ReplayState) -> None:
        C, stream = self.config.replay_capacity, self.backend.stream
        tree = SumTree(C)                      # sums and mins: additions and minima only,
        tree.leaves[:C] = state.leaves         # the same bits as the device's
        tree.rebuild()
        bits = np.uint16 if self._dtype.itemsize == 2 else np.float32
        with stream:
            for name in ("h_t", "h_tp1"):
                getattr(self, "_" + name).set(np.ascontiguousarray(getattr(state, name)).view(bits),
                                              stream=stream)
            for name in ("actions", "rewards", "dones", "discounts", "priorities"):
                getattr(self, "_" + name).set(np.ascontiguousarray(getattr(state, name)),
                                              stream=stream)
            self._leaves.set(tree.leaves, stream=stream)
            self._sums.set(np.concatenate(tree.sums), stream=stream)
            self._mins.set(np.concatenate(tree.mins), stream=stream)
            self._max_priority.set(np.array([state.max_priority], np.float32), stream=stream)
            self._owner.fill(0)
        stream.synchronize()
        self._counters = {name: getattr(state, name) for name in ReplayState.COUNTERS}

    # ---- inserts ------------------------------------------------------------------------
    def upload(self, t: Transitions | PackedBatch) -> Upload | None:
        """The backend's upload of the rows, then replay_check of them on the upload stream
        (a zeroed word, the kernel, the word's copy back, an event): :meth:`checked`."""
        packed = t if type(t) is PackedBatch else None
        upload = self.backend.upload(t if packed is not None else _packable(t))
        if upload is None:
            return None
        try:
            buf = upload.buffer
            check = self._checks.get(id(buf)) or self._checks.setdefault(id(buf), _Check())
            a = check.args
            a.staged, a.count = buf.staging.device_ptr, t.size
            a.staged_kind = FEATURE_KINDS[packed.dtype if packed is not None else t.h_t.dtype]
            a.has_priorities = (packed.has_weights if packed is not None
                                else t.priorities is not None)
            stream = self.backend._upload_stream
            elements = 2 * t.size * self.config.hidden_dim
            blocks = min(self.backend.max_blocks, -(-elements // (8 * THREADS)))
            cp.cuda.runtime.memsetAsync(check.device.data.ptr, 0, 4, stream.ptr)
            driver.launchKernel(self._check.kernel.ptr, blocks, 1, 1, THREADS, 1, 1, 0,
                                stream.ptr, ctypes.addressof(check.params), 0)
            cp.cuda.runtime.memcpyAsync(check.host.ctypes.data, check.device.data.ptr, 4,
                                        cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            check.done.record(stream)
        except BaseException:
            upload.close()
            raise
        return upload

    def checked(self, upload: Upload) -> bool:
        check = self._checks[id(upload.buffer)]
        check.done.synchronize()
        return int(check.host[0]) == 0

    def insert(self, t: Transitions, upload: Upload | None = None) -> None:
        """Store the rows that ``upload`` brought to the device, behind whatever is enqueued
        (a run left running included), without waiting for it: the upload buffer's next
        copy waits on the device for this launch.  Without an upload, stage them as a
        step's batch is (the step's own input buffer) and wait for the insert."""
        b, c, n = self.backend, self._counters, t.size
        buf = upload.buffer if type(upload) is _Uploaded else None
        waited = launched = marked = False   # the stream waits for the upload's copy; the
        try:                                 # insert is enqueued; the buffer's read event
            with b.stream:                   # is recorded after it
                if buf is None:
                    b.stage(_packable(t))
                    staged = b._inputs.device_ptr
                else:
                    b.stream.wait_event(buf.copied)
                    staged, waited = buf.staging.device_ptr, True
                self._launch_insert(t, staged)
                launched = True
                if buf is not None:
                    buf.read.record(b.stream)
                    marked = True
        finally:
            if marked:
                buf.copied.synchronize()   # the copy is done with the caller's bytes
            else:
                b.stream.synchronize()     # the staged rows are read (or something failed)
            if upload is not None:   # else its close waits for the copy
                upload.consumed = waited
            if launched:   # the rows go in: the counters follow
                c["cursor"], c["size"], c["inserted"] = after_insert(
                    c["cursor"], c["size"], c["inserted"], n, self.config.replay_capacity)

    def _launch_insert(self, t: Transitions, staged: int) -> None:
        """replay_insert of ``t``'s rows, packed at device address ``staged``, at the cursor."""
        b, c, n = self.backend, self._counters, t.size
        kind = FEATURE_KINDS[t.h_t.dtype]
        if t.h_tp1.dtype != t.h_t.dtype or (t.h_t.dtype != self._dtype and self._kind != 0):
            raise ValueError(f"replay_insert takes rows of one feature dtype, the buffer's "
                             f"({self._dtype}) or 16-bit into float32; got {t.h_t.dtype} "
                             f"and {t.h_tp1.dtype}")
        args = InsertArgs(
            staged=staged, rows_t=self._h_t.data.ptr,
            rows_tp1=self._h_tp1.data.ptr, actions=self._actions.data.ptr,
            rewards=self._rewards.data.ptr, dones=self._dones.data.ptr,
            discounts=self._discounts.data.ptr, priorities=self._priorities.data.ptr,
            leaves=self._leaves.data.ptr, sums=self._sums.data.ptr,
            mins=self._mins.data.ptr, max_priority=self._max_priority.data.ptr,
            arrivals=self._arrivals.data.ptr, ticket=self._ticket.data.ptr,
            alpha=self.config.replay_alpha, barrier=self._barriers(self._tree_barriers),
            count=n, start=c["cursor"],
            has_priorities=t.priorities is not None,
            staged_kind=0 if t.h_t.dtype == self._dtype else kind)
        b._launch_cooperative(self._insert, self._blocks(n), THREADS, 0, args)

    def _blocks(self, rows: int) -> int:
        return tree_blocks(rows, self.backend.max_blocks)

    def _barriers(self, count: int) -> int:
        """The first of ``count`` grid-barrier targets of the next launch.  A barrier compares
        flags with its target as signed 32-bit differences, and a block that smaller
        launches leave out keeps an old flag; so before the targets pass 2^30 every flag is
        zeroed on the stream and they start again at 1."""
        if self._barrier + count > 1 << 30:
            cp.cuda.runtime.memsetAsync(self._arrivals.data.ptr, 0, self._arrivals.nbytes,
                                        self.backend.stream.ptr)
            self._barrier = 1
        first = self._barrier
        self._barrier += count
        return first

    # ---- training -----------------------------------------------------------------------
    def train(self, steps: int) -> ReplayRun:
        return self.start(steps).finish()

    def start(self, steps: int) -> RunningReplay:
        """Runs of :data:`CALL_STEPS` steps, waited for, until the last, which is enqueued
        and left running: finishing it waits for it."""
        b, B = self.backend, self.config.replay_batch_size
        G = b.grid(B)[0]
        b._outputs.reserve(2 * B + 1 + 5 * G)
        done: list[tuple[int, bool, np.ndarray]] = []
        while steps > CALL_STEPS and not (done and done[-1][1]):
            self._enqueue(CALL_STEPS, G)
            done.append(self._finish())
            steps -= CALL_STEPS
        if done and done[-1][1]:   # halted: the rest is not drawn
            return RunningReplay(lambda: _ran(done))
        self._enqueue(steps, G)
        return RunningReplay(lambda: _ran(done + [self._finish()]), wait=self._wait)

    def _enqueue(self, run: int, G: int) -> None:
        """Enqueue ``run`` steps and their report's copy back (one C call, without the GIL).
        After a failure (the copy back and its event may not have been enqueued): wait for
        the stream, read the report itself, follow it, raise."""
        status = self.backend._native.replay_run(ctypes.addressof(self._prepare(run, G)))
        if status:
            self.backend.stream.synchronize()
            self._report_host[:] = self._report.get(stream=self.backend.stream)
            self._follow()
            driver.check_status(status)

    def _wait(self) -> None:
        """Wait for the last run's report (without the GIL)."""
        status = self.backend._native.replay_wait(ctypes.addressof(self._call))
        if status:
            driver.check_status(status)

    def _finish(self) -> tuple[int, bool, np.ndarray]:
        """Wait for the last run, then :meth:`_follow` its report."""
        self._wait()
        return self._follow()

    def _follow(self) -> tuple[int, bool, np.ndarray]:
        """The counters follow what the device did in the last run, as its report says.
        Returns (steps committed, halted, their :meth:`_figures`)."""
        b, c, B = self.backend, self._counters, self.config.replay_batch_size
        host = self._report_host
        control = host[:8].view(np.uint32)
        committed, halted = int(control[1]), bool(control[0])
        b._step += committed
        c["draws"] += committed + halted
        c["sampled"] += committed * B
        return committed, halted, self._figures(committed)

    def _figures(self, committed: int) -> np.ndarray:
        """[committed, 3] gradient norm, loss and mean Q of the last run's committed steps,
        from the per-block partials of its report, added as a batch step's are
        (server/core/native.c's duelq_block_totals, which :meth:`CudaBackend.propose` uses).
        Once per run (on the replay loop's thread, mostly), so into buffers kept for it."""
        B, G = self.config.replay_batch_size, self._commit_args.step_blocks
        self.backend._native.block_totals(self._parts_address, G, committed,
                                          self._totals_address)
        figures = self._totals[:committed, 1:4].copy()   # ‖g‖², loss sum, Q sum
        np.sqrt(figures[:, 0], out=figures[:, 0])
        figures[:, 1:] /= B
        return figures

    def _prepare(self, run: int, G: int) -> ReplayRunCall:
        """The C call that enqueues the next ``run`` steps (learner_step on G blocks), filled
        in: the commit's arguments, the step kernel on the current state copy, and each
        step's draw, owner mark, β, epoch, barrier targets and Adam step t."""
        b, c, config, B = self.backend, self._counters, self.config, self.config.replay_batch_size
        self._commit_for(G)
        _, R, tile = b._shape(B)
        kernel, args = b._steps[self._kind][tile], b._args[b._cur]
        b._bind_inputs(B, R, True, self._gathered.data.ptr)
        call = self._call
        call.step, call.step_blocks, call.step_smem = kernel.ptr, G, kernel.smem
        call.step_params = b._arg_param_addresses[b._cur]
        call.step_epoch, call.step_update_target, call.step_size, call.step_sqrt_bc2 = (
            field_address(args, name) for name in ("epoch", "update_target", "step_size",
                                                   "sqrt_bc2"))
        call.commit_blocks, call.count = self._blocks(B), run
        call.report_bytes = report_bytes(run, G)   # what comes back: this run's rows
        epoch = b._next_epoch(run)   # every target of the run at once: none wraps mid-run
        barrier = self._barriers(run * self._tree_barriers)
        for j in range(run):
            s, draw = self._step_values[j], c["draws"] + j
            self._mark += 1
            s.draw, s.mark, s.beta = draw, self._mark, beta_at(config, draw)
            s.update_target, s.step_size, s.sqrt_bc2 = b.step_scalars(b._step + j + 1)
            s.epoch, s.barrier = epoch + 2 * j, barrier + j * self._tree_barriers
        return call

    def draw_alone(self, draw: int) -> None:
        """Enqueue replay_sample of draw ``draw`` by itself, outside a run, under a new owner
        mark (tests compare its rows and gathered bytes with the reference's;
        benchmarks/replay_step.py times it).  It changes no counter."""
        a = self._sample_args
        self._mark += 1
        a.draw, a.mark, a.beta = draw, self._mark, beta_at(self.config, draw)
        driver.launchKernel(self._sample.kernel.ptr, self._call.sample_blocks, 1, 1,
                            THREADS, 1, 1, 0, self.backend.stream.ptr,
                            ctypes.addressof(self._sample_params), 0)

    def _commit_for(self, G: int) -> None:
        """Fill in replay_commit's arguments for steps launched on G blocks, but for those
        each step sets (the device commits a step by copying its state over
        the current copy: the copies stay where they are for a whole run)."""
        b, config = self.backend, self.config
        now, proposed = b._states[b._cur], b._states[1 - b._cur]
        a = self._commit_args
        a.out, a.next, a.state = (b._outputs.device_ptr, proposed.params.data.ptr,
                                  now.params.data.ptr)
        a.isv_next, a.isv = proposed.isv.data.ptr, now.isv.data.ptr
        a.observed_next, a.observed = proposed.observed.data.ptr, now.observed.data.ptr
        a.drawn, a.owner, a.priorities = (self._drawn.data.ptr, self._owner.data.ptr,
                                          self._priorities.data.ptr)
        a.leaves, a.sums, a.mins = self._leaves.data.ptr, self._sums.data.ptr, self._mins.data.ptr
        a.max_priority = self._max_priority.data.ptr
        a.control, a.stats = self._report.data.ptr, self._report.data.ptr + 8
        a.arrivals, a.ticket = self._arrivals.data.ptr, self._ticket.data.ptr
        a.alpha, a.batch, a.step_blocks = config.replay_alpha, config.replay_batch_size, G
        a.isv_size = config.isv_size
