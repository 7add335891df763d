"""CUDA backend: the whole learner state on one GPU, one cooperative kernel per step.

Kernels come from ``kernels/*.cu`` and are compiled at start-up by CuPy (NVRTC) with
the configuration's sizes as defines.  The mutable state (θ, θ⁻, Adam moments, ISV and
its observed flags) lives twice on the device: :meth:`CudaBackend.propose` writes the
pending copy from the current one, :meth:`CudaBackend.commit` swaps an index.

Per step the host does one H2D copy of a packed pinned input buffer, one cooperative
launch of ``learner_step`` and one D2H copy of the packed outputs (layouts in
``kernels/learner_step.cu``); it then adds the G per-block loss, Q and norm partials in
block order.  Blocks hand each other partials as words tagged with the launch's epoch
(``kernels/dueling_common.cuh``); the host numbers the launches.  The kernel also reports
whether every input value was valid (docs/design.md §7), so the host checks only dtypes and shapes.
:meth:`CudaBackend.upload` packs a batch into one of a few pinned upload buffers and starts its
copy on a second stream before the step's turn; the step then waits for that copy on the
device instead of making it.  An upload's driver calls and a step's (wait, launch, copy
back, sync, the block totals) are one C call each (server/core/native.c), not eight
crossings of CuPy's wrappers.
``learner_step`` is compiled per feature dtype and at two row tiles: the smaller serves
batches that need at most one block per SM, the larger the rest.
"""

from __future__ import annotations

import ctypes
import logging
import math
import queue
import re
from dataclasses import dataclass

import cupy as cp
import numpy as np
from cupy_backends.cuda.api import driver

from duelq.kernels import source
from duelq.server.core.backend import Backend, StepOutputs, Upload
from duelq.server.core.batch import Batch, PackedBatch, packed_layout
from duelq.server.core.config import LearnerConfig
from duelq.server.core.native import StepArgs, StepCall, UploadCall
from duelq.server.core.native import load as load_native
from duelq.server.core.state import LearnerState
from duelq.wire.types import BFLOAT16, Params

log = logging.getLogger(__name__)

THREADS = 256             # threads per block of learner_step and q_values
STATIC_SMEM_SLACK = 4096  # bytes of static shared memory besides the per-action counts
UPLOAD_BUFFERS = 3          # batches that may be on their way to the device at once
UPLOAD_MAX_WORDS = 1 << 24  # larger batches are packed at their step (64 MiB a buffer at most)
#: Feature dtype → learner_step's -DFEATURES (the kernel widens 16-bit rows as it loads them).
FEATURE_KINDS = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, BFLOAT16: 2}


def kernel_source(name: str) -> str:
    """Text of ``kernels/<name>`` with its ``#include "x.cuh"`` lines inlined.

    Inlining keeps the whole program in the text CuPy hashes for its kernel cache.
    """
    return re.sub(r'^#include "([\w.]+)"$', lambda m: source(m.group(1)),
                  source(name), flags=re.MULTILINE)


def pack_params(p: Params, stride: int) -> np.ndarray:
    """Params → the device layout [stride] float32: weights [N+1][H], biases [N+1]."""
    H, N = p.w_a.shape
    flat = np.zeros(stride, np.float32)
    weights = flat[:(N + 1) * H].reshape(N + 1, H)
    weights[0] = p.w_v
    weights[1:] = p.w_a.T
    flat[(N + 1) * H:(N + 1) * (H + 1)] = np.concatenate([p.b_v, p.b_a])
    return flat


def unpack_params(flat: np.ndarray, hidden_dim: int, n_actions: int) -> Params:
    """Inverse of :func:`pack_params` (copies)."""
    H, N = hidden_dim, n_actions
    weights = flat[:(N + 1) * H].reshape(N + 1, H)
    biases = flat[(N + 1) * H:(N + 1) * (H + 1)]
    return Params(w_v=weights[0].copy(), b_v=biases[:1].copy(),
                  w_a=np.ascontiguousarray(weights[1:].T), b_a=biases[1:].copy())


@dataclass(frozen=True)
class StepKernel:
    """One compiled shape of learner_step."""

    row_tile: int         # feature rows per shared-memory tile
    fn: cp.RawKernel      # the kernel
    smem: int             # its dynamic shared memory, bytes
    ptr: int              # its CUfunction (read once: fn.kernel asks for the device each time)

    @classmethod
    def of(cls, row_tile: int, fn: cp.RawKernel, smem: int) -> "StepKernel":
        return cls(row_tile, fn, smem, fn.kernel.ptr)


@dataclass
class _State:
    """One copy of the mutable state on the device."""

    params: cp.ndarray    # [4, stride] float32: θ, θ⁻, Adam m, Adam v
    isv: cp.ndarray       # [S] float32
    observed: cp.ndarray  # [S] int32, 0/1


class _Staging:
    """A pinned host buffer and its device twin, grown to powers of two on demand (their
    addresses kept as ints: reading them from the arrays costs more than a copy's call)."""

    def __init__(self):
        self.host = np.empty(0, np.float32)
        self.device = cp.empty(0, np.float32)
        self.host_ptr = self.device_ptr = 0

    def reserve(self, words: int) -> np.ndarray:
        """The first ``words`` floats of the host buffer (both buffers grown to hold them)."""
        if words > self.host.size:
            size = _grown(words)
            self.host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * size), np.float32, size)
            self.host_ptr = self.host.ctypes.data
        self.reserve_device(words)
        return self.host[:words]

    def reserve_device(self, words: int) -> cp.ndarray:
        """The device buffer, grown to hold ``words`` floats (the host one left as it is)."""
        if words > self.device.size:
            self.device = cp.empty(_grown(words), np.float32)
            self.device_ptr = self.device.data.ptr
        return self.device

    def upload(self, words: int, stream: cp.cuda.Stream, source: int | None = None) -> None:
        """Copy ``words`` to the device buffer from the host buffer (or host address
        ``source``)."""
        cp.cuda.runtime.memcpyAsync(self.device_ptr, self.host_ptr if source is None else source,
                                    4 * words, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)

    def pack(self, batch: Batch) -> int:
        """Write ``batch`` in the kernel's packed input layout (:func:`packed_layout`: the
        features in their own dtype, then 32-bit words); returns the words used."""
        B, size = batch.size, batch.h_t.dtype.itemsize  # float32: 4; float16, bfloat16: 2
        offsets, words = packed_layout(B, batch.h_t.shape[1], size, batch.weights is not None)
        host = self.reserve(words)
        raw = host if size == 4 else host.view(np.uint16)  # elements of the features' size
        for at, h in zip(offsets[:2], (batch.h_t, batch.h_tp1)):
            raw[at // size:at // size + h.size] = h.reshape(-1).view(raw.dtype)
        at = offsets[2] // 4
        host[at:at + B].view(np.int32)[:] = batch.actions
        for at, column in zip(offsets[3:], (batch.rewards, batch.dones, batch.discounts,
                                            batch.weights)):   # weights: absent when None
            host[at // 4:at // 4 + B] = column
        return words


def _grown(words: int) -> int:
    """A buffer size for ``words``: the next power of two, at least 1024."""
    return 1 << max(10, (words - 1).bit_length())


class _UploadBuffer:
    """A pinned staging buffer for uploads, the event of its last copy, and the event of the
    last launch that reads it without a sync (:meth:`CudaReplay.insert`): the next copy
    into it waits for that launch on the device."""

    def __init__(self, stream: cp.cuda.Stream):
        self.staging = _Staging()
        self.copied = cp.cuda.Event(disable_timing=True)
        self.read = cp.cuda.Event(disable_timing=True)
        # The upload's call (server/core/native.c): its stream and events.
        self.call = UploadCall(stream=stream.ptr, copied=self.copied.ptr, read=self.read.ptr)
        self.call_address = ctypes.addressof(self.call)

    def make_room(self, words: int) -> None:
        """Before the device buffer grows to ``words``: the launch that may still read the
        memory it replaces is done."""
        if words > self.staging.device.size:
            self.read.synchronize()


class _Uploaded(Upload):
    """One batch in an upload buffer, waiting for its step (or an insert's rows, for their
    insert); closing returns the buffer.  Closed unconsumed, it first waits for its copy,
    which may still be reading the batch's host bytes."""

    def __init__(self, buf: _UploadBuffer, free: "queue.SimpleQueue[_UploadBuffer]"):
        self.buffer: _UploadBuffer | None = buf
        self.consumed = False   # a launch (a step's, an insert's) waited for the copy
        self._free = free

    def close(self) -> None:
        buf, self.buffer = self.buffer, None
        if buf is not None:
            try:
                if not self.consumed:
                    buf.copied.synchronize()
            finally:
                self._free.put(buf)


class CudaBackend(Backend):
    """Learner state resident on the current CUDA device; kernels compiled for the config.

    ``row_tile`` pins learner_step to one row tile (for benchmarks); by default the
    kernel's own choice and twice it are compiled.  Needs a C compiler and libcuda for the
    host calls (:func:`duelq.server.core.native.load`).
    """

    name = "cuda"
    checks_values = True
    feature_dtypes = (np.dtype(np.float16), BFLOAT16)

    def __init__(self, config: LearnerConfig, state: LearnerState, *,
                 row_tile: int | None = None):
        super().__init__(config, state)
        N, S = config.n_actions, config.isv_size
        rt, dev = cp.cuda.runtime, cp.cuda.Device().id
        name = rt.getDeviceProperties(dev)["name"]
        self.device = name.decode() if isinstance(name, bytes) else name
        # One resident block per SM always fits: the cooperative launch's grid limit.
        self.max_blocks = rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, dev)
        max_smem = rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)
        self._compile(row_tile, max_smem)
        self.stream = cp.cuda.Stream(non_blocking=True)
        with self.stream:
            self._states = [_State(cp.zeros((4, self.stride), np.float32),
                                  cp.zeros(S, np.float32), cp.zeros(S, np.int32))
                           for _ in range(2)]
            G, P = self.max_blocks, self.stride
            self._part_grad = cp.zeros((G, P), np.uint64)    # per-block gradient partials
            self._part_sq = cp.zeros(G, np.float64)          # per-block ‖g‖² (clipping)
            self._part_counts = cp.zeros((G, N), np.uint64)  # per-block action counts
            self._grad = cp.zeros(P, np.float32)             # reduced gradient
            self._arrivals = cp.zeros(G, np.uint32)          # grid-barrier flags
            self._act_out = cp.empty(0, np.float32)          # Act's Q-values [B*N]
            self._ent_out = cp.zeros(2, np.float32)          # entropy, EMA
            self._ent_part = cp.zeros((self._ent_max_blocks, N), np.uint64)  # block counts
        self._epoch = 1
        self._inputs, self._outputs = _Staging(), _Staging()
        self._upload_stream = cp.cuda.Stream(non_blocking=True)
        self._pinned: list[tuple[int, int]] = []   # page-locked host memory [lo, hi)
        self._native = load_native()
        self._free_uploads: queue.SimpleQueue[_UploadBuffer] = queue.SimpleQueue()
        for _ in range(UPLOAD_BUFFERS):
            self._free_uploads.put(_UploadBuffer(self._upload_stream))
        self._shapes: dict[int, tuple[int, int, int]] = {}   # batch size → _shape's answer
        self._cur = 0
        self._pending = False
        self._step = 0
        self._entropy_slot = (config.isv_slots[config.step_entropy_slot]
                              if config.step_entropy_slot else -1)
        self._args = [self._fixed_args(cur) for cur in (0, 1)]
        # The kernel's parameter array for each: launches are serialised and copy their
        # arguments as they are enqueued, so _fill_args() fills these in place.
        self._arg_params = [(ctypes.c_void_p * 1)(ctypes.addressof(a)) for a in self._args]
        self._arg_param_addresses = [ctypes.addressof(p) for p in self._arg_params]
        self._step_call = StepCall(threads=THREADS, stream=self.stream.ptr)
        self._step_call_address = ctypes.addressof(self._step_call)
        self.load(state)

    def _compile(self, row_tile: int | None, max_smem: int) -> None:
        """Compile the kernels: learner_step at the kernel's default row tile (halved until
        its shared memory fits) and at twice that for batches of more than one tile per SM,
        or at ``row_tile`` alone when given; each for float32, float16 and bfloat16
        features."""
        H, N = self.config.hidden_dim, self.config.n_actions
        sizes = (f"-DHIDDEN_DIM={H}", f"-DN_ACTIONS={N}")

        def build(tile: int | None, kind: int = 0):
            options = sizes + (f"-DFEATURES={kind}",) + (
                () if tile is None else (f"-DROW_TILE={tile}",))
            module = cp.RawModule(code=kernel_source("learner_step.cu"), options=options)
            layout = cp.ndarray(5, np.uint32, module.get_global("learner_layout")).get()
            return module, [int(x) for x in layout]

        def fits(layout) -> bool:
            return layout[2] + 4 * N + STATIC_SMEM_SLACK <= max_smem

        module, layout = build(row_tile)
        while not fits(layout) and layout[4] > 1:
            module, layout = build(layout[4] // 2)
        n_params, self.stride, _, self._qv_smem, self._qv_tile = layout
        assert n_params == (N + 1) * (H + 1), "kernel and host disagree on the layout"
        self._qv_fn = module.get_function("q_values")
        steps = [StepKernel.of(layout[4], module.get_function("learner_step"), layout[2])]
        if row_tile is None:
            big, big_layout = build(2 * layout[4])
            if fits(big_layout):
                steps.append(StepKernel.of(big_layout[4], big.get_function("learner_step"),
                                           big_layout[2]))
        self._steps = {0: steps}  # feature kind → learner_step at each row tile
        for kind in sorted(set(FEATURE_KINDS.values()) - {0}):
            self._steps[kind] = [
                StepKernel.of(k.row_tile, build(k.row_tile, kind)[0].get_function("learner_step"),
                              k.smem) for k in steps]
        entropy = cp.RawModule(code=kernel_source("action_entropy.cu"), options=sizes)
        self._ent_fn = entropy.get_function("action_entropy")
        self._ent_threads, self._ent_block_actions, max_blocks = (
            int(x) for x in cp.ndarray(3, np.uint32, entropy.get_global("entropy_layout")).get())
        self._ent_max_blocks = min(max_blocks, self.max_blocks)
        kernels = [k for ks in self._steps.values() for k in ks]
        for fn, smem in [(k.fn, k.smem) for k in kernels] + [(self._qv_fn, self._qv_smem)]:
            if smem > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = smem

    # ---- state ------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self._step

    def load(self, state: LearnerState) -> None:
        cur = self._states[self._cur]
        groups = (state.params, state.target, state.adam_m, state.adam_v)
        host = np.stack([pack_params(g.astype(np.float32), self.stride) for g in groups])
        with self.stream:
            cur.params.set(host, stream=self.stream)
            cur.isv.set(state.isv.astype(np.float32), stream=self.stream)
            cur.observed.set(state.isv_observed.astype(np.int32), stream=self.stream)
        self.stream.synchronize()
        self._step, self._pending = state.step, False

    def snapshot(self) -> LearnerState:
        cur = self._states[self._cur]
        with self.stream:
            params = cur.params.get(stream=self.stream)
            isv = cur.isv.get(stream=self.stream)
            observed = cur.observed.get(stream=self.stream)
        H, N = self.config.hidden_dim, self.config.n_actions
        theta, target, m, v = (unpack_params(row, H, N) for row in params)
        return LearnerState(params=theta, target=target, adam_m=m, adam_v=v, step=self._step,
                            isv=isv, isv_observed=observed.astype(bool))

    def weights(self, target: bool = False) -> Params:
        with self.stream:
            row = self._states[self._cur].params[1 if target else 0].get(stream=self.stream)
        return unpack_params(row, self.config.hidden_dim, self.config.n_actions)

    def read_isv(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cur = self._states[self._cur]
        with self.stream:
            isv = cur.isv.get(stream=self.stream)
            observed = cur.observed.get(stream=self.stream)
        return isv[indices], observed[indices].astype(bool)

    # ---- Act ----------------------------------------------------------------------
    def q_values(self, h: np.ndarray, target: bool = False) -> np.ndarray:
        B, N = h.shape[0], self.config.n_actions
        with self.stream:
            if self._act_out.size < B * N:
                self._act_out = cp.empty(B * N, np.float32)
            h_dev = cp.asarray(np.ascontiguousarray(h, np.float32))
            params = self._states[self._cur].params[1 if target else 0]
            self._qv_fn(((B + self._qv_tile - 1) // self._qv_tile,), (THREADS,),
                        (params, h_dev, self._act_out, np.int32(B)), shared_mem=self._qv_smem)
            return self._act_out[:B * N].get(stream=self.stream).reshape(B, N)

    # ---- a learner step ----------------------------------------------------------
    def step_kernel(self, batch_size: int, kind: int = 0) -> StepKernel:
        """The smallest row tile that needs at most one block per SM, else the largest
        (for features of FEATURE_KINDS ``kind``)."""
        return self._steps[kind][self._shape(batch_size)[2]]

    def grid(self, batch_size: int) -> tuple[int, int]:
        """(blocks G, rows per block R) of the step kernel for ``batch_size`` rows."""
        return self._shape(batch_size)[:2]

    def _shape(self, batch_size: int) -> tuple[int, int, int]:
        """(G, R, the row tile's index in each kind's kernels) for ``batch_size`` rows,
        worked out once per size."""
        shape = self._shapes.get(batch_size)
        if shape is None:
            kernels = self._steps[0]
            tile = next((i for i, k in enumerate(kernels)
                         if -(-batch_size // k.row_tile) <= self.max_blocks), len(kernels) - 1)
            blocks = min(-(-batch_size // kernels[tile].row_tile), self.max_blocks)
            shape = self._shapes[batch_size] = (blocks, -(-batch_size // blocks), tile)
        return shape

    def stage(self, batch: Batch | PackedBatch) -> None:
        """Start ``batch``'s H2D copy into the step's own input buffer: packed into its pinned
        host buffer first, or a packed batch's words from where they lie."""
        if type(batch) is PackedBatch:
            self._inputs.reserve_device(batch.words)
            self._inputs.upload(batch.words, self.stream, batch.address)
        else:
            self._inputs.upload(self._inputs.pack(batch), self.stream)

    def pin(self, region: np.ndarray) -> None:
        """Page-lock ``region`` (cudaHostRegister), where packed batches will lie: their
        copies to the device then go straight from it.  The caller keeps such a batch's
        bytes unchanged until its step has returned."""
        if region.nbytes:
            cp.cuda.runtime.hostRegister(region.ctypes.data, region.nbytes, 0)
            self._pinned.append((region.ctypes.data, region.ctypes.data + region.nbytes))

    def unpin(self, region: np.ndarray) -> None:
        """Undo :meth:`pin` for ``region``."""
        span = (region.ctypes.data, region.ctypes.data + region.nbytes)
        if span in self._pinned:
            self._pinned.remove(span)
            cp.cuda.runtime.hostUnregister(span[0])

    def upload(self, batch: Batch | PackedBatch) -> Upload | None:
        B, H = batch.size, self.config.hidden_dim
        if 2 * B * H + 5 * B > UPLOAD_MAX_WORDS:
            return None
        try:
            buf = self._free_uploads.get_nowait()
        except queue.Empty:
            return None
        try:
            if type(batch) is PackedBatch:
                self._copy(buf, batch.address, batch.words)
            else:
                buf.copied.synchronize()  # its previous copy out of the host buffer is done
                buf.make_room(packed_layout(B, H, batch.h_t.dtype.itemsize,
                                            batch.weights is not None)[1])
                words = buf.staging.pack(batch)
                self._copy(buf, buf.staging.host_ptr, words)
        except BaseException:
            self._free_uploads.put(buf)
            raise
        return _Uploaded(buf, self._free_uploads)

    def _copy(self, buf: _UploadBuffer, address: int, words: int) -> None:
        """Copy ``words`` packed words from host ``address`` into the buffer's device memory
        and record the buffer's event after the copy."""
        buf.make_room(words)
        buf.staging.reserve_device(words)
        status = self._native.copy(buf.call_address, buf.staging.device_ptr, address,
                                   4 * words)
        if status:
            driver.check_status(status)

    def _fixed_args(self, cur: int) -> StepArgs:
        """The launch arguments that change from step to step only through the current state
        copy ``cur``; :meth:`_fill_args` fills in the rest."""
        c = self.config
        now, nxt = self._states[cur], self._states[1 - cur]
        return StepArgs(
            state=now.params.data.ptr, next=nxt.params.data.ptr,
            isv=now.isv.data.ptr, isv_next=nxt.isv.data.ptr,
            observed=now.observed.data.ptr, observed_next=nxt.observed.data.ptr,
            part_grad=self._part_grad.data.ptr, part_sq=self._part_sq.data.ptr,
            part_counts=self._part_counts.data.ptr, grad=self._grad.data.ptr,
            arrivals=self._arrivals.data.ptr, max_norm=c.max_grad_norm,
            double_dqn=c.double_dqn, adam=c.optimizer == "adam",
            isv_size=c.isv_size, entropy_slot=self._entropy_slot,
            kappa=c.huber_kappa, priority_eps=c.priority_eps, lr=c.lr,
            one_minus_beta1=1 - c.beta1, beta2=c.beta2, one_minus_beta2=1 - c.beta2,
            adam_eps=c.adam_eps,
            tau=c.tau, ent_alpha=c.step_entropy_alpha, ent_keep=1.0 - c.step_entropy_alpha)

    def launch(self, batch_size: int, has_weights: bool, inputs: cp.ndarray | None = None,
               kind: int = 0) -> None:
        """Enqueue the step kernel for features of ``kind`` on staged ``inputs`` (default:
        the step's own buffer); no copies, no sync."""
        G, R, tile = self._shape(batch_size)
        self._fill_args(batch_size, R, has_weights,
                        self._inputs.device_ptr if inputs is None else inputs.data.ptr)
        self._launch(self._steps[kind][tile], G)

    def _launch(self, kernel: StepKernel, G: int) -> None:
        """Enqueue ``kernel`` on G blocks with the arguments filled in."""
        driver.launchCooperativeKernel(kernel.ptr, G, 1, 1, THREADS, 1, 1, kernel.smem,
                                       self.stream.ptr, self._arg_param_addresses[self._cur])

    def _bind_inputs(self, batch_size: int, rows_per_block: int, has_weights: bool,
                     inputs_ptr: int) -> None:
        """Point the next steps' launch arguments (the current state copy's, in place: not
        thread-safe; the learner's lock serialises steps) at inputs staged at device address
        ``inputs_ptr``."""
        args = self._args[self._cur]
        args.inputs, args.out = inputs_ptr, self._outputs.device_ptr
        args.batch, args.rows_per_block, args.has_weights = (batch_size, rows_per_block,
                                                             has_weights)

    def _fill_args(self, batch_size: int, rows_per_block: int, has_weights: bool,
                   inputs_ptr: int) -> None:
        """Fill in the next step's launch arguments (:meth:`_bind_inputs`, then the step's
        own: its epoch and :meth:`step_scalars`)."""
        self._bind_inputs(batch_size, rows_per_block, has_weights, inputs_ptr)
        args = self._args[self._cur]
        args.epoch = self._next_epoch()
        args.update_target, args.step_size, args.sqrt_bc2 = self.step_scalars(self._step + 1)

    def step_scalars(self, t: int) -> tuple[bool, float, float]:
        """Step t's (whether it updates θ⁻, Adam's step size lr / (1 − β1^t), and
        sqrt(1 − β2^t), torch's bias_correction2 ** 0.5), as float64: float32 fields round
        them."""
        c = self.config
        return (t % c.target_update_period == 0, c.lr / (1 - c.beta1 ** t),
                (1 - c.beta2 ** t) ** 0.5)

    def _next_epoch(self, steps: int = 1) -> int:
        """The next launch's epoch (it also uses epoch − 1 and epoch + 1); with ``steps``,
        the first of that many launches' epochs, 2 apart.

        Epochs only grow, so no word left by an earlier launch carries the current one.  A
        grid barrier compares flags with its target as signed 32-bit differences, and a block
        that smaller launches leave out keeps an old flag; so before the count passes 2^30,
        every tagged buffer and barrier flag is zeroed and it restarts.
        """
        if self._epoch + 2 * steps > 1 << 30:
            with self.stream:
                for buf in (self._part_grad, self._part_counts, self._arrivals, self._ent_part):
                    buf.fill(0)
            self._epoch = 1
        epoch, self._epoch = self._epoch, self._epoch + 2 * steps
        return epoch

    def _launch_cooperative(self, fn: cp.RawKernel, blocks: int, threads: int, smem: int,
                            *args: ctypes._SimpleCData | ctypes.Structure) -> None:
        """Enqueue ``fn`` on the stream with every block resident (ctypes arguments)."""
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        driver.launchCooperativeKernel(fn.kernel.ptr, blocks, 1, 1, threads, 1, 1, smem,
                                       self.stream.ptr, ctypes.addressof(params))

    def propose(self, batch: Batch | PackedBatch, upload: Upload | None = None) -> StepOutputs:
        B = batch.size
        if type(batch) is PackedBatch:
            kind, has_weights = FEATURE_KINDS[batch.dtype], batch.has_weights
        else:
            kind, has_weights = FEATURE_KINDS[batch.h_t.dtype], batch.weights is not None
        G, R, tile = self._shape(B)
        words = 2 * B + 1 + 5 * G   # td_errors, priorities, entropy, [5, G] partials
        self._outputs.reserve(words)
        buf = upload.buffer if type(upload) is _Uploaded else None
        reached = stepped = False   # the step's call (it syncs the stream even failing);
        try:                        # its success (it waited for the upload's copy)
            if buf is None:
                self.stage(batch)
            self._fill_args(B, R, has_weights,
                            self._inputs.device_ptr if buf is None else buf.staging.device_ptr)
            kernel = self._steps[kind][tile]
            reached = True
            totals = self._native_step(kernel, G, buf, B, words)
            stepped = buf is not None
        finally:
            if not reached:   # a staged copy may still read the caller's memory
                self.stream.synchronize()
            if upload is not None:   # stepped: nothing reads it; else close waits for it
                upload.consumed = stepped
                upload.close()
        finite, norm2, loss_sum, q_sum, valid = totals
        out = self._outputs.host
        td = out[:2 * B].copy()                  # td_errors, priorities
        loss, q_mean = loss_sum / B, q_sum / B
        self._pending = True
        return StepOutputs(
            loss=loss, td_errors=td[:B], priorities=td[B:], q_taken_mean=q_mean,
            grad_norm=math.sqrt(norm2),
            finite=finite == G and math.isfinite(loss) and math.isfinite(q_mean),
            entropy=float(out[2 * B]) if self._entropy_slot >= 0 else None,
            inputs_valid=valid == G)

    def _native_step(self, kernel: StepKernel, G: int, buf: _UploadBuffer | None, B: int,
                     words: int) -> list[float]:
        """Launch ``kernel`` on the arguments filled in (after ``buf``'s upload), download
        its ``words`` of outputs and synchronize, in one call to server/core/native.c;
        returns the block totals: the per-block partials [5, G] (finite flag, slice norm,
        loss, Q sum, inputs valid) added in block order in float64, the norms squared first.
        The flags are 1.0 or 0.0, so they are all 1.0 exactly when they add up to G.  The
        stream is synchronized even when a call fails."""
        call, out = self._step_call, self._outputs
        call.fn, call.blocks, call.smem = kernel.ptr, G, kernel.smem
        call.params = self._arg_param_addresses[self._cur]
        call.wait = buf.copied.ptr if buf is not None else None
        call.out, call.out_device = out.host_ptr, out.device_ptr
        call.out_bytes, call.parts = 4 * words, out.host_ptr + 4 * (2 * B + 1)
        status = self._native.step(self._step_call_address)
        if status:
            driver.check_status(status)
        return call.totals[:]

    def commit(self) -> None:
        assert self._pending, "commit without a pending step"
        self._cur, self._pending = 1 - self._cur, False
        self._step += 1

    def discard(self) -> None:
        self._pending = False

    # ---- ComputeEntropy -------------------------------------------------------------
    def entropy(self, actions: np.ndarray, slot: int, alpha: float) -> tuple[float, float]:
        with self.stream:
            self.launch_entropy(cp.asarray(np.ascontiguousarray(actions, np.int32)), slot, alpha)
            entropy, ema = self._ent_out.get(stream=self.stream)
        return float(entropy), float(ema)

    def entropy_grid(self, m: int) -> tuple[int, int]:
        """(blocks G, actions per block P, a multiple of 32) of the entropy kernel."""
        blocks = max(1, min(self._ent_max_blocks, -(-m // self._ent_block_actions)))
        return blocks, -(-m // (32 * blocks)) * 32

    def launch_entropy(self, actions: cp.ndarray, slot: int, alpha: float) -> None:
        """Enqueue the entropy kernel on device-resident ``actions`` [M] int32 (no sync)."""
        cur = self._states[self._cur]
        m = actions.shape[0]
        G, P = self.entropy_grid(m)
        ptr = ctypes.c_void_p
        self._launch_cooperative(
            self._ent_fn, G, self._ent_threads, 0,
            ptr(actions.data.ptr), ctypes.c_int(m), ctypes.c_int(P), ptr(cur.isv.data.ptr),
            ptr(cur.observed.data.ptr), ctypes.c_int(slot), ctypes.c_float(alpha),
            ctypes.c_float(1.0 - alpha), ptr(self._ent_out.data.ptr),
            ptr(self._ent_part.data.ptr), ctypes.c_uint(self._next_epoch()))
