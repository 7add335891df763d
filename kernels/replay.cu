// replay.cu — the server-side prioritised replay buffer on the device (docs/design.md, "The
// server-side replay"). Its NumPy reference, which these kernels match bit for bit, is
// server/core/replay.py: read its docstring first.
//
// Defines, besides dueling_common.cuh's (-DFEATURES is the buffer's feature dtype):
//   -DCAPACITY=<C> -DTREE_DEPTH=<D>
// and, before the first launch, the host writes the tree's layout into tree_offset and
// tree_nodes (server/core/replay.py's tree_layout): level k (1 = the parents of the leaves,
// D = the root) has tree_nodes[k] nodes, kept from entry tree_offset[k] of the sums (double)
// and mins (float) arrays; the leaves (float, p^α) are an array of their own. Compile with
// --fmad=false: no multiply-add here may be fused (the reference rounds each operation);
// the few that matter are written with __d*_rn intrinsics besides.
//
// Kernels, in a replay step's order on one stream:
//   replay_sample   one warp per drawn row: Philox4x32-10 uniform, the walk down the tree,
//                   the importance weight, the gather of the row into learner_step's packed
//                   inputs (the buffer's feature dtype, weights present)
//   (learner_step, unchanged, on those inputs, writing the proposed state)
//   replay_commit   cooperative: if the step is finite and no earlier step of the run was
//                   refused, copies the proposed state over the current one, records the
//                   step's figures and writes the drawn rows' priorities back (the last
//                   occurrence of a row in batch order wins), then updates the tree level by
//                   level; otherwise marks the run halted and changes nothing.
//   replay_insert   cooperative: rows into the buffer at the cursor, their priorities and
//                   leaves, then the tree.
// Grid barriers between phases (grid_barrier); no reduction whose order depends on timing:
// atomics only take maxima (the last batch position of a row, the largest priority), whose
// result is the same in any order.

#include "dueling_common.cuh"

#if !defined(CAPACITY) || !defined(TREE_DEPTH)
#error "compile with -DCAPACITY=<C> -DTREE_DEPTH=<D> (server/core/replay.py's tree_levels)"
#endif

#define FANOUT 32
#define FLT_MAX_BITS 0x7f7fffffu
#define ROW_BYTES (HIDDEN_DIM * FEATURE_BYTES)
// A row's features move in the widest unit that divides them.
#if ROW_BYTES % 16 == 0
typedef uint4 unit_t;
#elif ROW_BYTES % 4 == 0
typedef unsigned int unit_t;
#else
typedef unsigned short unit_t;
#endif
#define ROW_UNITS (ROW_BYTES / (int)sizeof(unit_t))

// [k]: the first entry of tree level k (k ≥ 1) in sums and mins; its number of nodes.
// Written by the host (tree_layout) before the first launch.
extern "C" {
__constant__ long long tree_offset[TREE_DEPTH + 1];
__constant__ long long tree_nodes[TREE_DEPTH + 1];
}

// Philox4x32-10 (Random123's philox4x32_R, R = 10) of counter c under key (k0, k1).
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned int hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// Row b's uniform in [0, 1) of draw `draw`: counter (b / 2, draw low, draw high, 0), words
// 0–1 for an even b and 2–3 for an odd one, 53 bits as NumPy makes a double.
__device__ __forceinline__ double draw_uniform(unsigned long long draw, int b, unsigned int k0,
                                               unsigned int k1) {
    const uint4 w = philox4x32_10(
        make_uint4((unsigned int)(b >> 1), (unsigned int)draw, (unsigned int)(draw >> 32), 0u),
        k0, k1);
    const unsigned int high = (b & 1) ? w.z : w.x, low = (b & 1) ? w.w : w.y;
    return __dmul_rn(__dadd_rn(__dmul_rn((double)(high >> 5), 67108864.0), (double)(low >> 6)),
                     1.0 / 9007199254740992.0);
}

// (float) pow((double) p, α): a priority's leaf.
__device__ __forceinline__ float leaf_of(float p, double alpha) {
    return (float)pow((double)p, alpha);
}

// A child's min for its parent: positive values count, empty ones are +inf.
__device__ __forceinline__ float positive_or_inf(float m) {
    return m > 0.f ? m : __int_as_float(0x7f800000);
}

// The row of the t-th touched leaf: rows[t], or (start + t) mod C without rows.
__device__ __forceinline__ long long touched_row(const int* rows, int start, long long t) {
    return rows != nullptr ? (long long)__ldcg(rows + t) : ((long long)start + t) % CAPACITY;
}

// Recompute level k's nodes above `count` touched leaves (each by one warp from its 32
// children, sums by the xor butterfly left in lane 0, mins likewise); every node of the
// level when it has no more nodes than `count`. Children were written by other blocks
// before the last grid barrier: read from L2.
__device__ void update_level(int k, const int* rows, int start, int count, const float* leaves,
                             double* sums, float* mins) {
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long nodes = tree_nodes[k];
    const bool whole = nodes <= count;
    const long long tasks = whole ? nodes : count;
    for (long long t = warp; t < tasks; t += warps) {
        const long long node = whole ? t : touched_row(rows, start, t) >> (5 * k);
        const long long at = node * FANOUT + lane;
        double s;
        float m;
        if (k == 1) {
            const float leaf = __ldcg(leaves + at);
            s = (double)leaf;
            m = positive_or_inf(leaf);
        } else {
            s = __ldcg(sums + tree_offset[k - 1] + at);
            m = positive_or_inf(__ldcg(mins + tree_offset[k - 1] + at));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            s = __dadd_rn(s, __shfl_xor_sync(FULL_MASK, s, o));
            m = fminf(m, __shfl_xor_sync(FULL_MASK, m, o));
        }
        if (lane == 0) {
            sums[tree_offset[k] + node] = s;
            mins[tree_offset[k] + node] = m;
        }
    }
}

// Levels 1..D above `count` touched leaves, a grid barrier before each (the first: the
// leaves written; targets barrier, barrier + 1, …). Every block of the grid calls it.
__device__ void update_tree(const int* rows, int start, int count, const float* leaves,
                            double* sums, float* mins, unsigned int* arrivals,
                            unsigned int barrier) {
    for (int k = 1; k <= TREE_DEPTH; ++k) {
        __threadfence();
        grid_barrier(arrivals, barrier + (unsigned int)(k - 1));
        update_level(k, rows, start, count, leaves, sums, mins);
    }
}

// Read once by the host: grid barriers of replay_commit and of replay_insert (the host
// numbers them: each launch's targets follow the last's), a row's feature bytes.
extern "C" {
__device__ unsigned int replay_layout[3] = {TREE_DEPTH + 1, TREE_DEPTH, ROW_BYTES};
}

// ---- replay_sample ---------------------------------------------------------------------
// Grid: ceil(B / (THREADS / 32)) blocks of THREADS; warp w of the grid draws row b = w.
extern "C" __global__ void __launch_bounds__(THREADS)
replay_sample(const float* __restrict__ leaves, const double* __restrict__ sums,
              const float* __restrict__ mins, const unit_t* __restrict__ rows_t,
              const unit_t* __restrict__ rows_tp1, const int* __restrict__ actions,
              const float* __restrict__ rewards, const float* __restrict__ dones,
              const float* __restrict__ discounts, unsigned long long draw, unsigned int key0,
              unsigned int key1, double beta, int batch, int* __restrict__ drawn,
              unit_t* __restrict__ packed) {
    const int lane = threadIdx.x & 31;
    const int b = (int)(((long long)blockIdx.x * THREADS + threadIdx.x) >> 5);
    if (b >= batch) return;  // whole warps: b is the same in every lane of one
    const double total = sums[tree_offset[TREE_DEPTH]];
    double mass = __dmul_rn(draw_uniform(draw, b, key0, key1), total);
    long long node = 0;
    for (int k = TREE_DEPTH - 1; k >= 0; --k) {  // the children of `node` are at level k
        const long long at = node * FANOUT + lane;
        const double c = k == 0 ? (double)leaves[at] : sums[tree_offset[k] + at];
        double prefix = c;  // inclusive prefix sum, Hillis–Steele
#pragma unroll
        for (int d = 1; d < FANOUT; d <<= 1) {
            const double lower = __shfl_up_sync(FULL_MASK, prefix, d);
            if (lane >= d) prefix = __dadd_rn(prefix, lower);
        }
        const unsigned int positive = __ballot_sync(FULL_MASK, c > 0.0);
        const unsigned int fits = __ballot_sync(FULL_MASK, c > 0.0 && mass < prefix);
        const int j = fits ? __ffs(fits) - 1 : positive ? 31 - __clz(positive) : FANOUT - 1;
        const double before = __shfl_sync(FULL_MASK, prefix, j > 0 ? j - 1 : 0);
        if (j > 0) mass = __dsub_rn(mass, before);
        node = node * FANOUT + j;
    }
    const long long row = node;
    // Packed inputs (server/core/batch.py packed_layout): h_t [B] rows | h_tp1 [B] rows |
    // actions | rewards | dones | discounts | weights, each [B] of 32-bit words.
    for (int u = lane; u < ROW_UNITS; u += 32) {
        packed[(size_t)b * ROW_UNITS + u] = rows_t[(size_t)row * ROW_UNITS + u];
        packed[((size_t)batch + b) * ROW_UNITS + u] = rows_tp1[(size_t)row * ROW_UNITS + u];
    }
    if (lane == 0) {
        float* tail = reinterpret_cast<float*>(packed + 2 * (size_t)batch * ROW_UNITS);
        const double ratio = __ddiv_rn((double)mins[tree_offset[TREE_DEPTH]], (double)leaves[row]);
        reinterpret_cast<int*>(tail)[b] = actions[row];
        tail[batch + b] = rewards[row];
        tail[2 * batch + b] = dones[row];
        tail[3 * batch + b] = discounts[row];
        tail[4 * batch + b] = (float)pow(ratio, beta);
        drawn[b] = (int)row;
    }
}

// ---- replay_commit -----------------------------------------------------------------------
struct CommitArgs {
    const float* out;           // learner_step's packed outputs: td [B] | priorities [B] |
                                // entropy | per block: finite, norm, loss, Q sum, inputs ok
    const float* next;          // [4][PARAM_STRIDE] the proposed θ, θ⁻, Adam m, v
    float* state;               // [4][PARAM_STRIDE] the current ones: overwritten on commit
    const float* isv_next;      // [isv_size] proposed ISV and observed flags
    float* isv;
    const int* observed_next;
    int* observed;
    const int* drawn;           // [B] rows drawn by replay_sample
    float* priorities;          // [C]
    float* leaves;              // [32 n_1] p^α
    double* sums;               // tree levels 1..D
    float* mins;
    int* owner;                 // [C] the last batch position that drew a row; −1 between
    float* max_priority;        // [1] the largest priority written (bits compare as uints)
    unsigned int* control;      // [2] the run's halted flag, steps committed in the run
    double* stats;              // [run][3] loss, mean Q, gradient norm of each committed step
    unsigned int* arrivals;     // [G] grid-barrier flags
    double alpha;               // α
    unsigned int barrier;       // the first barrier's target (the launch uses D + 1)
    int batch;                  // B
    int step_blocks;            // G of the learner_step launch that wrote `out`
    int isv_size;
    int stats_row;              // the step's position in the run: its row of stats
};

extern "C" __global__ void __launch_bounds__(THREADS, 1) replay_commit(const CommitArgs a) {
    __shared__ int commit;
    const int B = a.batch, G = a.step_blocks;
    const float* head = a.out + 2 * B;  // entropy, then [5][G]
    if (threadIdx.x < 32) {  // the same decision in every block (see the host's propose)
        bool ok = *reinterpret_cast<volatile const unsigned int*>(a.control) == 0u;
        for (int g = threadIdx.x; g < G; g += 32)
            ok = ok && head[1 + g] == 1.f && head[1 + 4 * G + g] == 1.f &&
                 isfinite(head[1 + 2 * G + g]) && isfinite(head[1 + 3 * G + g]);
        ok = __all_sync(FULL_MASK, ok);
        if (threadIdx.x == 0) commit = ok;
    }
    __syncthreads();
    if (!commit) {  // refused, or an earlier step of the run was: nothing changes
        if (blockIdx.x == 0 && threadIdx.x == 0) a.control[0] = 1u;
        return;     // every block returns here: no barrier is reached
    }
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long threads = (long long)gridDim.x * blockDim.x;
    const float* written = a.out + B;  // the step's |δ| + ε
    for (long long i = tid; i < 4LL * PARAM_STRIDE; i += threads) a.state[i] = a.next[i];
    for (long long i = tid; i < a.isv_size; i += threads) {
        a.isv[i] = a.isv_next[i];
        a.observed[i] = a.observed_next[i];
    }
    for (long long b = tid; b < B; b += threads) {
        atomicMax(a.owner + a.drawn[b], (int)b);
        const float p = fminf(written[b], __int_as_float(FLT_MAX_BITS));
        atomicMax(reinterpret_cast<unsigned int*>(a.max_priority), __float_as_uint(p));
    }
    if (tid == 0) {  // the step's figures, as the host adds them (server/core/native.c)
        double loss = 0.0, q = 0.0, norm2 = 0.0;
        for (int g = 0; g < G; ++g) {
            const double n = (double)head[1 + G + g];
            norm2 = __dadd_rn(norm2, __dmul_rn(n, n));
            loss = __dadd_rn(loss, (double)head[1 + 2 * G + g]);
            q = __dadd_rn(q, (double)head[1 + 3 * G + g]);
        }
        a.stats[3 * a.stats_row] = __ddiv_rn(loss, (double)B);
        a.stats[3 * a.stats_row + 1] = __ddiv_rn(q, (double)B);
        a.stats[3 * a.stats_row + 2] = __dsqrt_rn(norm2);
        a.control[1] += 1u;
    }
    __threadfence();
    grid_barrier(a.arrivals, a.barrier);
    for (long long b = tid; b < B; b += threads) {  // the last occurrence of each row
        const int row = __ldcg(a.drawn + b);
        if (__ldcg(a.owner + row) == (int)b) {
            const float p = fminf(written[b], __int_as_float(FLT_MAX_BITS));
            a.priorities[row] = p;
            a.leaves[row] = leaf_of(p, a.alpha);
        }
    }
    update_tree(a.drawn, 0, B, a.leaves, a.sums, a.mins, a.arrivals, a.barrier + 1u);
    for (long long b = tid; b < B; b += threads) a.owner[__ldcg(a.drawn + b)] = -1;
}

// ---- replay_insert -----------------------------------------------------------------------
struct InsertArgs {
    const unit_t* staged;       // packed rows (packed_layout of n rows): h_t | h_tp1 |
                                // actions | rewards | dones | discounts | priorities (if given)
    unit_t* rows_t;             // [C][ROW_UNITS] the buffer's features
    unit_t* rows_tp1;
    int* actions;               // [C]
    float* rewards;             // [C]
    float* dones;               // [C]
    float* discounts;           // [C]
    float* priorities;          // [C]
    float* leaves;              // [32 n_1]
    double* sums;
    float* mins;
    float* max_priority;        // [1]
    unsigned int* arrivals;     // [G]
    double alpha;
    unsigned int barrier;       // the first barrier's target (the launch uses D)
    int count;                  // n ≤ C
    int start;                  // the cursor: row t goes to (start + t) mod C
    int has_priorities;         // 0: every row gets *max_priority
};

extern "C" __global__ void __launch_bounds__(THREADS, 1) replay_insert(const InsertArgs a) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long threads = (long long)gridDim.x * blockDim.x;
    const int n = a.count;
    for (long long u = tid; u < (long long)n * ROW_UNITS; u += threads) {
        const long long t = u / ROW_UNITS, row = ((long long)a.start + t) % CAPACITY;
        const long long c = u - t * ROW_UNITS;
        a.rows_t[row * ROW_UNITS + c] = a.staged[u];
        a.rows_tp1[row * ROW_UNITS + c] = a.staged[(long long)n * ROW_UNITS + u];
    }
    const float* tail = reinterpret_cast<const float*>(a.staged + 2 * (long long)n * ROW_UNITS);
    const float fallback = *a.max_priority;  // written below only when priorities are given
    for (long long t = tid; t < n; t += threads) {
        const long long row = ((long long)a.start + t) % CAPACITY;
        a.actions[row] = reinterpret_cast<const int*>(tail)[t];
        a.rewards[row] = tail[n + t];
        a.dones[row] = tail[2 * n + t];
        a.discounts[row] = tail[3 * n + t];
        const float p = a.has_priorities ? tail[4 * n + t] : fallback;
        if (a.has_priorities)
            atomicMax(reinterpret_cast<unsigned int*>(a.max_priority), __float_as_uint(p));
        a.priorities[row] = p;
        a.leaves[row] = leaf_of(p, a.alpha);
    }
    update_tree(nullptr, a.start, n, a.leaves, a.sums, a.mins, a.arrivals, a.barrier);
}
