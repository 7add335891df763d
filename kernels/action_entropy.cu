// action_entropy.cu — entropy of an actions buffer folded into an ISV slot as an EMA
// (DESIGN §3).
//
// One block of ENT_THREADS threads. Histogram: every thread owns a private column of
// 32-bit counters in shared memory, counts[a][thread], and counts its strided share of the
// actions (no atomics, no two threads touching one counter). Then each warp sums its lanes'
// counters per action with a fixed butterfly, one warp per action sums the warp totals with
// another, and −Σ p ln p is a fixed-order block sum. Actions are validated to [0, N)
// before launch; nothing is clamped here.
// EMA: on the slot's first observation ema = H, afterwards (1−α)·ema + α·H; the observed
// flag is explicit, never the value 0.0.

#include "dueling_common.cuh"

// Threads: as many (≤ 1024, a multiple of 32) as keep the counters within 96 KiB.
#define ENT_THREADS_FIT ((24576 / N_ACTIONS) / 32 * 32)
#define ENT_THREADS (ENT_THREADS_FIT > 1024 ? 1024 : ENT_THREADS_FIT < 32 ? 32 : ENT_THREADS_FIT)
#define ENT_SMEM_BYTES (N_ACTIONS * ENT_THREADS * 4)
#define ENT_UNROLL 16  // actions per thread loaded at once

// Read once by the host: block size and dynamic shared bytes.
extern "C" {
__device__ unsigned int entropy_layout[2] = {ENT_THREADS, ENT_SMEM_BYTES};
}

extern "C" __global__ void __launch_bounds__(ENT_THREADS)
action_entropy(const int* __restrict__ actions,  // [m] in [0, N)
               int m,
               float* __restrict__ isv,          // [S] ISV, slot updated in place
               int* __restrict__ observed,       // [S] observed flags, slot set to 1
               int slot, float alpha, float keep, // keep = 1 − α
               float* __restrict__ out) {        // [2] entropy (nats), new EMA
    extern __shared__ unsigned int counts[];     // [N_ACTIONS][ENT_THREADS]
    __shared__ double scratch[33];
    const int tid = threadIdx.x, lane = tid & 31;
    float prev = 0.f;
    int seen = 0;
    if (tid == 0) {  // in flight while the histogram is built
        prev = isv[slot];
        seen = observed[slot];
    }
    for (int i = tid; i < N_ACTIONS * ENT_THREADS; i += ENT_THREADS) counts[i] = 0u;
    __syncthreads();

    unsigned int* mine = counts + tid;
    for (int base = 0; base < m; base += ENT_UNROLL * ENT_THREADS) {
        int x[ENT_UNROLL];
#pragma unroll
        for (int u = 0; u < ENT_UNROLL; ++u) {
            const int i = base + u * ENT_THREADS + tid;
            x[u] = i < m ? __ldg(actions + i) : -1;
        }
#pragma unroll
        for (int u = 0; u < ENT_UNROLL; ++u)
            if (x[u] >= 0) mine[x[u] * ENT_THREADS] += 1u;
    }
    __syncthreads();

    // Per action: warp totals (stored over lane 0's counter), then one warp per action
    // sums those totals.
#pragma unroll 16
    for (int k = 0; k < N_ACTIONS; ++k) {
        const unsigned int c = warp_sum(counts[k * ENT_THREADS + tid]);
        if (lane == 0) counts[k * ENT_THREADS + tid] = c;
    }
    __syncthreads();
    double term = 0.0;
    for (int k = tid >> 5; k < N_ACTIONS; k += ENT_THREADS / 32) {
        const unsigned int c =
            warp_sum(lane < ENT_THREADS / 32 ? counts[k * ENT_THREADS + 32 * lane] : 0u);
        if (lane == 0 && c > 0) {
            const double p = (double)c / (double)m;
            term -= p * log(p);
        }
    }
    const double h = block_sum(term, scratch);
    if (tid == 0) {
        const float hf = (float)h;
        const float ema = seen ? keep * prev + alpha * hf : hf;
        isv[slot] = ema;
        observed[slot] = 1;
        out[0] = hf;
        out[1] = ema;
    }
}
