// action_entropy.cu — entropy of an actions buffer folded into an ISV slot as an EMA (DESIGN §3).
//
// One block of ENT_THREADS threads. Histogram: each warp counts 32 actions at a time with
// __match_any_sync; the lowest lane of each group of equal actions adds the group size to
// the warp's own shared-memory row (distinct actions → distinct addresses, no atomics).
// Rows are summed per action in warp order, and −Σ p ln p is a fixed-order block sum.
// Actions are validated to [0, N) before launch; nothing is clamped here.
// EMA: on the slot's first observation ema = H, afterwards (1−α)·ema + α·H; the observed
// flag is explicit, never the value 0.0.
//
// Dynamic shared memory: (ENT_THREADS / 32) * N_ACTIONS ints.

#include "dueling_common.cuh"

#define ENT_THREADS 1024
#define ENT_UNROLL 8  // actions per lane loaded at once

extern "C" __global__ void __launch_bounds__(ENT_THREADS)
action_entropy(const int* __restrict__ actions,  // [m] in [0, N)
               int m,
               float* __restrict__ isv,          // [S] ISV, slot updated in place
               int* __restrict__ observed,       // [S] observed flags, slot set to 1
               int slot, float alpha, float keep, // keep = 1 − α
               float* __restrict__ out) {        // [2] entropy (nats), new EMA
    extern __shared__ int hist[];                // [ENT_THREADS / 32][N_ACTIONS]
    __shared__ double scratch[33];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int i = tid; i < (ENT_THREADS / 32) * N_ACTIONS; i += ENT_THREADS) hist[i] = 0;
    __syncthreads();

    int* mine = hist + warp * N_ACTIONS;
    for (int base = warp * 32; base < m; base += ENT_THREADS * ENT_UNROLL) {
        int x[ENT_UNROLL];  // all of this round's loads in flight before the first match
#pragma unroll
        for (int u = 0; u < ENT_UNROLL; ++u) {
            const int i = base + u * ENT_THREADS + lane;
            x[u] = i < m ? __ldg(actions + i) : -1;
        }
#pragma unroll
        for (int u = 0; u < ENT_UNROLL; ++u) {
            const unsigned int peers = __match_any_sync(FULL_MASK, x[u]);
            if (x[u] >= 0 && lane == __ffs(peers) - 1) mine[x[u]] += __popc(peers);
            __syncwarp();
        }
    }
    __syncthreads();

    double term = 0.0;
    for (int k = tid; k < N_ACTIONS; k += ENT_THREADS) {
        int c = 0;
        for (int w = 0; w < ENT_THREADS / 32; ++w) c += hist[w * N_ACTIONS + k];
        if (c > 0) {
            const double p = (double)c / (double)m;
            term -= p * log(p);
        }
    }
    const double h = block_sum(term, scratch);
    if (tid == 0) {
        const float hf = (float)h;
        const float ema = observed[slot] ? keep * isv[slot] + alpha * hf : hf;
        isv[slot] = ema;
        observed[slot] = 1;
        out[0] = hf;
        out[1] = ema;
    }
}
