// action_entropy.cu — entropy of an actions buffer folded into an ISV slot as an EMA
// (docs/design.md §2).
//
// Grid: G blocks of ENT_THREADS threads, all resident (cooperative launch); block b counts
// the actions [b·P, b·P + P), P = per_block. A warp reads 32 consecutive actions at a time.
//   N ≤ 32: lane a of every warp owns action a and adds the population count of the warp's
//           ballot "my action is a": the counts stay in registers.
//   N > 32: every warp owns a row of counters in shared memory; the lanes holding the same
//           action find each other with __match_any_sync and the lowest adds the group's size.
// The warps' counts are added in warp order. Blocks b > 0 store their counts tagged with the
// launch's epoch (dueling_common.cuh) and leave; block 0 adds them in block order as they
// land (no grid barrier), then −Σ p ln p in double precision as a fixed-order sum. No atomics;
// actions are validated to [0, N) before launch and nothing is clamped here.
// EMA: on the slot's first observation ema = H, afterwards (1−α)·ema + α·H; the observed
// flag is explicit, never the value 0.0.

#include "dueling_common.cuh"

#define ENT_THREADS 256
#define ENT_WARPS (ENT_THREADS / 32)
#define ENT_UNROLL 8              // chunks of 32 actions per warp loaded at once
#define ENT_BLOCK_ACTIONS 1024    // actions per block the host aims for
#define ENT_MAX_BLOCKS 16         // block 0 adds at most this many partials per action

// Read once by the host: block size, actions per block, most blocks.
extern "C" {
__device__ unsigned int entropy_layout[3] = {ENT_THREADS, ENT_BLOCK_ACTIONS, ENT_MAX_BLOCKS};
}

extern "C" __global__ void __launch_bounds__(ENT_THREADS)
action_entropy(const int* __restrict__ actions,  // [m] in [0, N)
               int m,
               int per_block,                    // P: actions per block, a multiple of 32
               float* __restrict__ isv,          // [S] ISV, slot updated in place
               int* __restrict__ observed,       // [S] observed flags, slot set to 1
               int slot, float alpha, float keep, // keep = 1 − α
               float* __restrict__ out,          // [2] entropy (nats), new EMA
               tagged_t* __restrict__ part,      // [G][N] counts of blocks 1..G−1
               unsigned int epoch) {             // this launch's tag
    __shared__ unsigned int counts[ENT_WARPS][N_ACTIONS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, blk = blockIdx.x;
    float prev = 0.f;
    int seen = 0;
    if (blk == 0 && tid == 0) {  // in flight while the histogram is built
        prev = isv[slot];
        seen = observed[slot];
    }
    const int lo = min(m, blk * per_block), hi = min(m, lo + per_block);
    unsigned int* row = counts[warp];
#if N_ACTIONS <= 32
    unsigned int mine = 0;  // lane a: this warp's count of action a
#else
    for (int k = lane; k < N_ACTIONS; k += 32) row[k] = 0u;
    __syncwarp();
#endif
    // Warp w takes chunks lo + 32·w, then every ENT_THREADS; a lane past the end holds −1.
    for (int base = lo + warp * 32; base < hi; base += ENT_UNROLL * ENT_THREADS) {
        int x[ENT_UNROLL];
#pragma unroll
        for (int u = 0; u < ENT_UNROLL; ++u) {
            const int i = base + u * ENT_THREADS + lane;
            x[u] = i < hi ? __ldg(actions + i) : -1;
        }
#pragma unroll
        for (int u = 0; u < ENT_UNROLL; ++u) {
#if N_ACTIONS <= 32
            unsigned int own = 0;  // ballot of this lane's action
#pragma unroll
            for (int k = 0; k < N_ACTIONS; ++k) {
                const unsigned int b = __ballot_sync(FULL_MASK, x[u] == k);
                if (lane == k) own = b;
            }
            mine += __popc(own);
#else
            const unsigned int same = __match_any_sync(FULL_MASK, x[u]);
            if (x[u] >= 0 && lane == __ffs(same) - 1) row[x[u]] += __popc(same);
            __syncwarp();  // the next chunk's leaders see this one's counts
#endif
        }
    }
#if N_ACTIONS <= 32
    if (lane < N_ACTIONS) row[lane] = mine;
#endif
    __syncthreads();

    if (blk > 0) {
        for (int k = tid; k < N_ACTIONS; k += ENT_THREADS) {
            unsigned int c = 0;
            for (int w = 0; w < ENT_WARPS; ++w) c += counts[w][k];
            put_tagged(part + (size_t)blk * N_ACTIONS + k, c, epoch);
        }
        return;
    }
    double term = 0.0;
    for (int k = tid; k < N_ACTIONS; k += ENT_THREADS) {
        unsigned int c = 0;
        for (int w = 0; w < ENT_WARPS; ++w) c += counts[w][k];
        c += tagged_sum<unsigned int>(part + k, N_ACTIONS, 1, gridDim.x, epoch);
        if (c > 0) {
            const double p = (double)c / (double)m;
            term -= p * log(p);
        }
    }
#if N_ACTIONS <= 32
    if (warp != 0) return;  // the N terms are all in warp 0
    const double h = warp_sum(term);
#else
    __shared__ double scratch[33];
    const double h = block_sum(term, scratch);
#endif
    if (tid == 0) {
        const float hf = (float)h;
        const float ema = seen ? keep * prev + alpha * hf : hf;
        isv[slot] = ema;
        observed[slot] = 1;
        out[0] = hf;
        out[1] = ema;
    }
}
