/* native.c: the CUDA backend's per-step host calls in C (server/core/native.py builds and
 * loads it; the structs below are read by native.py to make their ctypes twins).
 *
 * An upload (copy, event) and a step (wait, launch, copy back, sync, block totals) are one
 * ctypes call each, where CuPy's wrappers would take eight, each releasing the GIL.  The
 * driver's entry points come from the libcuda that CuPy has loaded; no CUDA header is
 * needed to build this file, only a C compiler.
 */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef int CUresult;
typedef void *CUstream, *CUevent, *CUfunction;
typedef unsigned long long CUdeviceptr;

static CUresult (*memcpy_htod)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*memcpy_dtoh)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                          unsigned, unsigned, CUstream, void **, void **);
static CUresult (*launch_cooperative)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                                      unsigned, unsigned, unsigned, CUstream, void **);
static CUresult (*memset_d32)(CUdeviceptr, unsigned, size_t, CUstream);
static CUresult (*event_record)(CUevent, CUstream);
static CUresult (*stream_wait_event)(CUstream, CUevent, unsigned);
static CUresult (*stream_synchronize)(CUstream);
static CUresult (*event_synchronize)(CUevent);

/* Resolve the driver's entry points; 0 on success, else the 1-based index of the one
 * missing (-1: no libcuda.so.1). */
int duelq_init(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda == NULL) return -1;
    struct { void **fn; const char *name; } entries[] = {
        {(void **)&memcpy_htod, "cuMemcpyHtoDAsync_v2"},
        {(void **)&memcpy_dtoh, "cuMemcpyDtoHAsync_v2"},
        {(void **)&launch, "cuLaunchKernel"},
        {(void **)&launch_cooperative, "cuLaunchCooperativeKernel"},
        {(void **)&memset_d32, "cuMemsetD32Async"},
        {(void **)&event_record, "cuEventRecord"},
        {(void **)&stream_wait_event, "cuStreamWaitEvent"},
        {(void **)&stream_synchronize, "cuStreamSynchronize"},
        {(void **)&event_synchronize, "cuEventSynchronize"},
    };
    for (size_t i = 0; i < sizeof entries / sizeof entries[0]; ++i) {
        *entries[i].fn = dlsym(cuda, entries[i].name);
        if (*entries[i].fn == NULL) return (int)i + 1;
    }
    return 0;
}

/* An upload buffer's stream, the event that marks the end of its last copy, and the one
 * recorded after the last launch that reads it without a sync (a replay insert's). */
struct duelq_upload {
    CUstream stream;
    CUevent copied, read;
};

/* A packed batch's words (host ``src``, pinned) to the device at ``dst`` on the upload's
 * stream, once the last launch that reads the buffer is done; the upload's event marks
 * the copy's end. */
int duelq_copy(const struct duelq_upload *u, CUdeviceptr dst, const void *src, size_t nbytes) {
    CUresult r = stream_wait_event(u->stream, u->read, 0);
    if (r == 0) r = memcpy_htod(dst, src, nbytes, u->stream);
    if (r == 0) r = event_record(u->copied, u->stream);
    return r;
}

/* parts [steps][5][blocks] float32 → totals [steps][5] float64: each row added in block
 * order, row 1 (the blocks' slice norms) squared first: the finite flags, ‖g‖², the loss
 * sum, the Q sum, the inputs-valid flags (built with -ffp-contract=off: no fused
 * multiply-adds).  A batch step's are one step's; a replay run's, its committed steps'. */
void duelq_block_totals(const float *parts, int blocks, int steps, double *totals) {
    for (int row = 0; row < 5 * steps; ++row) {
        double sum = 0.0;
        for (int g = 0; g < blocks; ++g) {
            double v = parts[row * blocks + g];
            sum += row % 5 == 1 ? v * v : v;
        }
        totals[row] = sum;
    }
}

/* One learner step: wait for the upload's event (if any), the cooperative launch of
 * learner_step, its outputs back to the pinned host buffer, the stream's sync, then the
 * block totals.  The stream is synchronized even when an earlier call failed, so nothing
 * still reads the upload's buffers when this returns. */
struct duelq_step {
    CUfunction fn;
    unsigned blocks, threads, smem;
    void **params;         /* learner_step's parameter array */
    CUstream stream;
    CUevent wait;          /* NULL: the inputs were staged on the stream itself */
    void *out;             /* the pinned host outputs */
    CUdeviceptr out_device;
    size_t out_bytes;
    const float *parts;    /* in out: the [5][blocks] partials */
    double totals[5];
};

int duelq_step(struct duelq_step *s) {
    CUresult r = s->wait != NULL ?
        stream_wait_event(s->stream, s->wait, 0) : 0;
    if (r == 0) r = launch_cooperative(s->fn, s->blocks, 1, 1, s->threads, 1, 1, s->smem,
                                      s->stream, s->params);
    if (r == 0) r = memcpy_dtoh(s->out, s->out_device, s->out_bytes, s->stream);
    CUresult synced = stream_synchronize(s->stream);
    if (r == 0) r = synced;
    if (r == 0) duelq_block_totals(s->parts, (int)s->blocks, 1, s->totals);
    return r;
}

/* A run of replay steps (server/core/cuda_replay.py): per step, replay_sample, learner_step
 * and replay_commit, enqueued with the step's own values written into their argument
 * structs first (a launch copies its arguments, so one struct serves every step). */
struct duelq_replay_step {
    unsigned long long draw, mark;  /* the draw's number and owner mark */
    double beta;                    /* β of its importance weights */
    float step_size, sqrt_bc2;      /* Adam's bias corrections of step t */
    unsigned epoch, barrier;        /* learner_step's epoch, replay_commit's first barrier */
    int update_target;              /* step t updates θ⁻ */
};

struct duelq_replay_run {
    CUstream stream;
    CUfunction sample, step, commit;
    unsigned sample_blocks, step_blocks, commit_blocks, threads, step_smem;
    void **sample_params, **step_params, **commit_params;
    /* the fields of SampleArgs, StepArgs and CommitArgs that a step sets */
    unsigned long long *sample_draw, *sample_mark, *commit_mark;
    double *sample_beta;
    float *step_size, *step_sqrt_bc2;
    unsigned *step_epoch, *commit_barrier;
    int *step_update_target, *commit_stats_row;
    const struct duelq_replay_step *steps;
    int count;
    void *report;          /* pinned host copy of the report */
    CUdeviceptr report_device;   /* replay_commit's [2] control words (zeroed first), then
                                    each step's per-block partials */
    size_t report_bytes;
    CUevent done;          /* recorded once the report is back */
};

/* Enqueue the run's steps after zeroing its control words. */
static int replay_enqueue(struct duelq_replay_run *r) {
    CUresult e = memset_d32(r->report_device, 0u, 2, r->stream);
    for (int j = 0; j < r->count && e == 0; ++j) {
        const struct duelq_replay_step *s = &r->steps[j];
        *r->sample_draw = s->draw, *r->sample_mark = s->mark, *r->sample_beta = s->beta;
        e = launch(r->sample, r->sample_blocks, 1, 1, r->threads, 1, 1, 0, r->stream,
                   r->sample_params, NULL);
        *r->step_epoch = s->epoch, *r->step_update_target = s->update_target;
        *r->step_size = s->step_size, *r->step_sqrt_bc2 = s->sqrt_bc2;
        if (e == 0) e = launch_cooperative(r->step, r->step_blocks, 1, 1, r->threads, 1, 1,
                                           r->step_smem, r->stream, r->step_params);
        *r->commit_mark = s->mark, *r->commit_barrier = s->barrier, *r->commit_stats_row = j;
        if (e == 0) e = launch_cooperative(r->commit, r->commit_blocks, 1, 1, r->threads, 1,
                                           1, 0, r->stream, r->commit_params);
    }
    return e;
}

/* The run enqueued, then the copy of its report back and its `done` event (whatever
 * failed: the host's counters follow what the device did; duelq_replay_wait). */
int duelq_replay_run(struct duelq_replay_run *r) {
    CUresult e = replay_enqueue(r);
    CUresult copied = memcpy_dtoh(r->report, r->report_device, r->report_bytes, r->stream);
    CUresult recorded = event_record(r->done, r->stream);
    return e != 0 ? e : copied != 0 ? copied : recorded;
}

/* Wait for the run's report. */
int duelq_replay_wait(const struct duelq_replay_run *r) { return event_synchronize(r->done); }

/* duelq_stream_copy: src[offset, offset + n) to dst, its whole 64-byte blocks from dst's
 * first 16-byte boundary on with non-temporal stores (the ≤ 15 bytes before and ≤ 63 after
 * with memcpy), which go to memory without taking cache lines: a front process writes a batch
 * into its relay buffer for the device's copy engine alone to read, and a cached write would
 * evict what the learner process's thread works on from the cache they share.  Fenced, so the bytes are visible before whatever this
 * thread writes next (the frame that names the buffer).  Without SSE2: memcpy. */
void duelq_stream_copy(unsigned char *dst, const char *src, size_t offset, size_t n) {
    src += offset;
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    _mm_sfence();
#endif
    memcpy(dst, src, n);
}
