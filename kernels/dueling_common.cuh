// dueling_common.cuh — sizes, parameter layout and block helpers shared by the kernels.
//
// Sizes come from the configuration as compile-time defines:
//   -DHIDDEN_DIM=<H> -DN_ACTIONS=<N> [-DROW_TILE=<feature rows per tile>]
//   [-DFEATURES=<dtype of a step's h_t, h_tp1: 0 float32 (default), 1 float16, 2 bfloat16>]
// 16-bit features are widened to float32 (exactly) as they are loaded.
//
// Device layout of one parameter set (θ, θ⁻, Adam m, Adam v all alike):
//   weights [N_OUT][HIDDEN_DIM]  row 0 = w_v, row 1+a = W_a[:, a]
//   biases  [N_OUT]              b_v, then b_a[0..N)
// so output j of a feature row x is  x · weights[j] + biases[j]  (j = 0 is V, j = 1+a is A[a]).
// Sets are PARAM_STRIDE floats apart (16-byte aligned rows for vector loads).
//
// No atomics anywhere: every reduction runs in an order fixed by the launch shape.

#ifndef DUELING_COMMON_CUH
#define DUELING_COMMON_CUH

#ifndef HIDDEN_DIM
#error "compile with -DHIDDEN_DIM=<H>"
#endif
#ifndef N_ACTIONS
#error "compile with -DN_ACTIONS=<N>"
#endif

#define THREADS 256                                   // threads per block of the row kernels
#define N_OUT (N_ACTIONS + 1)                         // V and A[0..N)
#define N_WEIGHTS (N_OUT * HIDDEN_DIM)
#define N_PARAMS (N_WEIGHTS + N_OUT)
#define PARAM_STRIDE (((N_PARAMS + 63) / 64) * 64)    // floats between parameter sets
#define HS (((HIDDEN_DIM + 3) / 4) * 4 + 4)           // shared-memory row stride (floats)
#define FULL_MASK 0xffffffffu
#ifndef FEATURES
#define FEATURES 0
#endif
#define FEATURE_BYTES (FEATURES == 0 ? 4 : 2)

// Feature rows move as float4 when H allows it.
#if HIDDEN_DIM % 4 == 0
typedef float4 vec_t;
#define VW 4
#else
typedef float vec_t;
#define VW 1
#endif
#define ROW_VECS (HIDDEN_DIM / VW)

// Rows per tile: by default as many as keep ≤ 4 vectors of each matrix per thread in flight.
#ifndef ROW_TILE
#define ROW_TILE_FIT ((4 * THREADS * VW) / HIDDEN_DIM)
#define ROW_TILE (ROW_TILE_FIT < 1 ? 1 : ROW_TILE_FIT > 16 ? 16 : ROW_TILE_FIT)
#endif
#define TILE_VECS (ROW_TILE * ROW_VECS)
#define FETCH_PER_THREAD ((TILE_VECS + THREADS - 1) / THREADS)

__device__ __forceinline__ vec_t vec_zero() {
#if VW == 4
    return make_float4(0.f, 0.f, 0.f, 0.f);
#else
    return 0.f;
#endif
}

// acc += x · c, lane by lane.
__device__ __forceinline__ void vec_fma(vec_t& acc, const vec_t x, float c) {
#if VW == 4
    acc.x = fmaf(x.x, c, acc.x);
    acc.y = fmaf(x.y, c, acc.y);
    acc.z = fmaf(x.z, c, acc.z);
    acc.w = fmaf(x.w, c, acc.w);
#else
    acc = fmaf(x, c, acc);
#endif
}

__device__ __forceinline__ void vec_add(vec_t& acc, const vec_t x) {
#if VW == 4
    acc.x += x.x;
    acc.y += x.y;
    acc.z += x.z;
    acc.w += x.w;
#else
    acc += x;
#endif
}

// A 16-bit float's bits (the low half of `b`) as a float32: KIND 1 float16, 2 bfloat16.
template <int KIND>
__device__ __forceinline__ float widen16(unsigned int b) {
    if (KIND == 2) return __uint_as_float(b << 16);
    const unsigned short h = (unsigned short)b;
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Vector `at` of feature rows x of dtype KIND (0 float32, else 16-bit), as float32.
template <int KIND>
__device__ __forceinline__ vec_t load_vec(const void* __restrict__ x, size_t at) {
    if (KIND == 0) return __ldg(reinterpret_cast<const vec_t*>(x) + at);
#if VW == 4
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(x) + at);
    return make_float4(widen16<KIND>(u.x & 0xffffu), widen16<KIND>(u.x >> 16),
                       widen16<KIND>(u.y & 0xffffu), widen16<KIND>(u.y >> 16));
#else
    return widen16<KIND>(__ldg(reinterpret_cast<const unsigned short*>(x) + at));
#endif
}

// Loads rows [row0, row0 + ROW_TILE) of x [*, H] (dtype KIND) into registers as float32,
// every load in flight at once; rows at or past row_end read as zero. Pair with stash_rows.
template <int KIND>
__device__ __forceinline__ void fetch_rows(vec_t (&regs)[FETCH_PER_THREAD],
                                           const void* __restrict__ x, int row0, int row_end) {
#pragma unroll
    for (int k = 0; k < FETCH_PER_THREAD; ++k) {
        const int i = threadIdx.x + k * THREADS, r = i / ROW_VECS, c = i - r * ROW_VECS;
        regs[k] = (i < TILE_VECS && row0 + r < row_end)
                      ? load_vec<KIND>(x, (size_t)(row0 + r) * ROW_VECS + c) : vec_zero();
    }
}

// Stores fetched rows into xs [ROW_TILE][HS].
__device__ __forceinline__ void stash_rows(const vec_t (&regs)[FETCH_PER_THREAD], float* xs) {
#pragma unroll
    for (int k = 0; k < FETCH_PER_THREAD; ++k) {
        const int i = threadIdx.x + k * THREADS, r = i / ROW_VECS, c = i - r * ROW_VECS;
        if (i < TILE_VECS) *reinterpret_cast<vec_t*>(xs + r * HS + c * VW) = regs[k];
    }
}

// Whether every fetched value is finite (rows past the end are fetched as zeros).
__device__ __forceinline__ bool all_finite(const vec_t (&regs)[FETCH_PER_THREAD]) {
    bool ok = true;
#pragma unroll
    for (int k = 0; k < FETCH_PER_THREAD; ++k) {
#if VW == 4
        ok = ok && isfinite(regs[k].x) && isfinite(regs[k].y) && isfinite(regs[k].z) &&
             isfinite(regs[k].w);
#else
        ok = ok && isfinite(regs[k]);
#endif
    }
    return ok;
}

// Dot product of a feature row in shared memory with a weight row (shared or global).
__device__ __forceinline__ float dot_row(const float* __restrict__ x, const float* __restrict__ w) {
#if VW == 4
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int c = 0; c < HIDDEN_DIM; c += 4) {
        const float4 xv = *reinterpret_cast<const float4*>(x + c);
        const float4 wv = *reinterpret_cast<const float4*>(w + c);
        acc.x = fmaf(xv.x, wv.x, acc.x);
        acc.y = fmaf(xv.y, wv.y, acc.y);
        acc.z = fmaf(xv.z, wv.z, acc.z);
        acc.w = fmaf(xv.w, wv.w, acc.w);
    }
    return (acc.x + acc.y) + (acc.z + acc.w);
#else
    float acc = 0.f;
#pragma unroll 8
    for (int c = 0; c < HIDDEN_DIM; ++c) acc = fmaf(x[c], w[c], acc);
    return acc;
#endif
}

// Dot products of two feature rows in shared memory with one weight row (shared or global).
__device__ __forceinline__ float2 dot_rows2(const float* __restrict__ x0,
                                            const float* __restrict__ x1,
                                            const float* __restrict__ w) {
#if VW == 4
    float4 a0 = make_float4(0.f, 0.f, 0.f, 0.f), a1 = a0;
#pragma unroll 8
    for (int c = 0; c < HIDDEN_DIM; c += 4) {
        const float4 wv = *reinterpret_cast<const float4*>(w + c);
        const float4 u = *reinterpret_cast<const float4*>(x0 + c);
        const float4 v = *reinterpret_cast<const float4*>(x1 + c);
        a0.x = fmaf(u.x, wv.x, a0.x);
        a0.y = fmaf(u.y, wv.y, a0.y);
        a0.z = fmaf(u.z, wv.z, a0.z);
        a0.w = fmaf(u.w, wv.w, a0.w);
        a1.x = fmaf(v.x, wv.x, a1.x);
        a1.y = fmaf(v.y, wv.y, a1.y);
        a1.z = fmaf(v.z, wv.z, a1.z);
        a1.w = fmaf(v.w, wv.w, a1.w);
    }
    return make_float2((a0.x + a0.y) + (a0.z + a0.w), (a1.x + a1.y) + (a1.z + a1.w));
#else
    float a0 = 0.f, a1 = 0.f;
#pragma unroll 8
    for (int c = 0; c < HIDDEN_DIM; ++c) {
        const float wc = w[c];
        a0 = fmaf(x0[c], wc, a0);
        a1 = fmaf(x1[c], wc, a1);
    }
    return make_float2(a0, a1);
#endif
}

// Sum of src[i * stride] for i in [i0, i1) in index order, 8 loads in flight at a time
// (L2 reads: data written by other blocks of this launch before a grid barrier).
template <typename T>
__device__ __forceinline__ T strided_sum(const T* src, size_t stride, int i0, int i1) {
    T s = 0;
    for (int i = i0; i < i1; i += 8) {
        T v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u)
            v[u] = i + u < i1 ? __ldcg(src + (size_t)(i + u) * stride) : T(0);
#pragma unroll
        for (int u = 0; u < 8; ++u) s += v[u];
    }
    return s;
}

// Tagged words: a 32-bit value and the launch's epoch in one 64-bit word, stored and loaded
// with single-copy-atomic relaxed accesses at GPU scope. A reader that sees its epoch sees the
// value stored with it, so a block waits for exactly the partials it sums, as they land,
// instead of for a grid barrier and then for the loads (one L2 round trip instead of two).
typedef unsigned long long tagged_t;

__device__ __forceinline__ void put_tagged(tagged_t* dst, unsigned int bits, unsigned int epoch) {
    const tagged_t word = ((tagged_t)epoch << 32) | bits;
    asm volatile("st.relaxed.gpu.u64 [%0], %1;" ::"l"(dst), "l"(word) : "memory");
}

__device__ __forceinline__ tagged_t peek_tagged(const tagged_t* src) {
    tagged_t word;
    asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(word) : "l"(src));
    return word;
}

__device__ __forceinline__ float tagged_value(tagged_t word, float) {
    return __uint_as_float((unsigned int)word);
}
__device__ __forceinline__ unsigned int tagged_value(tagged_t word, unsigned int) {
    return (unsigned int)word;
}

// Sum of the values of src[i * stride] for i in [i0, i1) in index order, each word awaited
// until it carries `epoch`; 8 loads in flight at a time.
template <typename T>
__device__ __forceinline__ T tagged_sum(const tagged_t* src, size_t stride, int i0, int i1,
                                        unsigned int epoch) {
    T s = 0;
    for (int i = i0; i < i1; i += 8) {
        tagged_t v[8];
        bool ready;
        do {  // all 8 loads again until every word carries the epoch
            ready = true;
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                v[u] = i + u < i1 ? peek_tagged(src + (size_t)(i + u) * stride)
                                  : (tagged_t)epoch << 32;
                ready &= (unsigned int)(v[u] >> 32) == epoch;
            }
        } while (!ready);
#pragma unroll
        for (int u = 0; u < 8; ++u) s += tagged_value(v[u], T());
    }
    return s;
}

// A grid barrier of a cooperative launch: every block arrives with `target`, then waits
// until all G blocks have (per-block arrival flags; targets only grow, wrap-safe). The block's writes
// are ordered before its release store by the CTA barrier; acquire loads order the other
// blocks' writes before everything after the final CTA barrier.
__device__ __forceinline__ void grid_barrier(unsigned int* arrivals, unsigned int target) {
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(arrivals + blockIdx.x), "r"(target)
                     : "memory");
    if (threadIdx.x < 32) {
        for (int i = threadIdx.x; i < (int)gridDim.x; i += 32) {
            unsigned int seen;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(arrivals + i)
                             : "memory");
            } while ((int)(seen - target) < 0);
        }
    }
    __syncthreads();
}

// Mean of the advantages A[0..N) of one row of outputs [N_OUT].
__device__ __forceinline__ float mean_advantage(const float* out) {
    float s = 0.f;
    for (int a = 0; a < N_ACTIONS; ++a) s += out[1 + a];
    return s / (float)N_ACTIONS;
}

// Butterfly sum over aligned groups of W lanes; every lane of a group gets the same bits.
template <int W>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Butterfly sums over a warp; every lane gets the same bits (a + b == b + a).
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ unsigned int warp_sum(unsigned int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Sum of one double per thread over the block, in a fixed order; every thread gets it.
// `scratch` holds 33 doubles of shared memory.
__device__ __forceinline__ double block_sum(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double s = warp_sum(lane < warps ? scratch[lane] : 0.0);
        if (lane == 0) scratch[32] = s;
    }
    __syncthreads();
    const double total = scratch[32];
    __syncthreads();  // scratch may be reused right after
    return total;
}

#endif  // DUELING_COMMON_CUH
