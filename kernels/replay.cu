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
//                   inputs (the buffer's feature dtype, weights present), and the row's
//                   owner mark (the draw's mark and the largest batch position that drew it)
//   (learner_step, unchanged, on those inputs, writing the proposed state)
//   replay_commit   cooperative: if the step is finite and no earlier step of the run was
//                   refused, copies the proposed state over the current one, copies the
//                   step's per-block partials into the run's report (the host adds them, as
//                   for a batch step) and writes the drawn rows' priorities back (the
//                   position that owns a row: its last occurrence in batch order), then
//                   updates the tree; otherwise marks the run halted and changes nothing.
//   replay_insert   cooperative: rows into the buffer at the cursor (16-bit features into a
//                   float32 buffer widened on the way), their priorities and leaves, then
//                   the tree.
// and, on the upload stream as an insert's rows arrive (before the insert is enqueued):
//   replay_check    every value of the staged rows against the insert's rules (features
//                   finite, actions in [0, N), rewards finite, dones 0 or 1, discounts in
//                   [0, 1], priorities finite and > 0): one word, 1 if any fails.
// The tree is updated two levels at a time (update_pair), a grid barrier (grid_barrier)
// before each pair that holds a level of more than TOP_NODES nodes; the last block to
// finish those updates the small levels at the top alone. No reduction whose order
// depends on timing: atomics only take maxima (owner marks, the largest priority), whose
// result is the same in any order.

#include "dueling_common.cuh"

#if !defined(CAPACITY) || !defined(TREE_DEPTH)
#error "compile with -DCAPACITY=<C> -DTREE_DEPTH=<D> (server/core/replay.py's tree_levels)"
#endif

#define FANOUT 32
#define WARPS (THREADS / 32)      // warps of a block
#define TASKS 4                   // tree nodes a warp loads at once
#define TOP_NODES (TASKS * WARPS) // levels this small are updated by one block
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

// Nodes of tree level k (level 0: the leaves), as tree_nodes holds them.
__host__ __device__ constexpr long long level_nodes(int k) {
    return k == 0 ? (long long)CAPACITY : (level_nodes(k - 1) + FANOUT - 1) / FANOUT;
}
// The first level of at most TOP_NODES nodes: it and those above are one block's work.
__host__ __device__ constexpr int top_level(int k) {
    return level_nodes(k) <= TOP_NODES ? k : top_level(k + 1);
}
#define TOP_LEVEL top_level(1)

// Recompute level k's nodes above `count` touched leaves, every node of the level when it
// has no more nodes than `count`: warp w of `warps` takes tasks w, w + warps, …, TASKS at a
// time, loading their children before reducing any (sums by the xor butterfly left in lane
// 0, mins likewise). Children were written by other blocks (or other warps of this one)
// before the last barrier: read from L2.
__device__ void update_level(int k, const int* rows, int start, int count, const float* leaves,
                             double* sums, float* mins, long long warp, long long warps) {
    const int lane = threadIdx.x & 31;
    const long long nodes = tree_nodes[k];
    const bool whole = nodes <= count;
    const long long tasks = whole ? nodes : count;
    for (long long first = warp; first < tasks; first += TASKS * warps) {
        long long node[TASKS];
        double s[TASKS];
        float m[TASKS];
#pragma unroll
        for (int r = 0; r < TASKS; ++r) {
            const long long t = first + r * warps;
            node[r] = -1;
            s[r] = 0.0;
            m[r] = __int_as_float(0x7f800000);
            if (t >= tasks) continue;  // the same t in every lane of the warp
            node[r] = whole ? t : touched_row(rows, start, t) >> (5 * k);
            const long long at = node[r] * FANOUT + lane;
            if (k == 1) {
                const float leaf = __ldcg(leaves + at);
                s[r] = (double)leaf;
                m[r] = positive_or_inf(leaf);
            } else {
                s[r] = __ldcg(sums + tree_offset[k - 1] + at);
                m[r] = positive_or_inf(__ldcg(mins + tree_offset[k - 1] + at));
            }
        }
#pragma unroll
        for (int r = 0; r < TASKS; ++r) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                s[r] = __dadd_rn(s[r], __shfl_xor_sync(FULL_MASK, s[r], o));
                m[r] = fminf(m[r], __shfl_xor_sync(FULL_MASK, m[r], o));
            }
            if (lane == 0 && node[r] >= 0) {
                sums[tree_offset[k] + node[r]] = s[r];
                mins[tree_offset[k] + node[r]] = m[r];
            }
        }
    }
}

// Recompute levels k and k + 1 (k < D) above `count` touched leaves, every node of level
// k + 1 when it has no more nodes than `count`: a warp takes a node of level k + 1; lane i
// recomputes its child i at level k from that child's 32 children, loaded at once and
// added in registers in the butterfly's order (so the bits are update_level's), then the
// warp's butterfly gives the node. One L2 round trip for two levels, and no barrier
// between them: the children of level k + 1's nodes are written by the warp that reads them.
__device__ void update_pair(int k, const int* rows, int start, int count, const float* leaves,
                            double* sums, float* mins, long long warp, long long warps) {
    const int lane = threadIdx.x & 31;
    const long long nodes = tree_nodes[k + 1];
    const bool whole = nodes <= count;
    const long long tasks = whole ? nodes : count;
    for (long long t = warp; t < tasks; t += warps) {  // the same t in every lane of the warp
        const long long node = whole ? t : touched_row(rows, start, t) >> (5 * (k + 1));
        // An insert's rows are consecutive: the first of those under one node does it.
        if (!whole && rows == nullptr && t > 0 &&
            touched_row(rows, start, t - 1) >> (5 * (k + 1)) == node)
            continue;
        const long long child = node * FANOUT + lane;  // at level k
        double s = 0.0;                                // padding past the level: 0, +inf
        float m = __int_as_float(0x7f800000);
        if (child < tree_nodes[k]) {
            double c[FANOUT];
            if (k == 1) {
                const float4* in = reinterpret_cast<const float4*>(leaves + child * FANOUT);
#pragma unroll
                for (int q = 0; q < FANOUT / 4; ++q) {
                    const float4 v = __ldcg(in + q);
                    c[4 * q] = v.x, c[4 * q + 1] = v.y, c[4 * q + 2] = v.z, c[4 * q + 3] = v.w;
                    m = fminf(fminf(fminf(fminf(m, positive_or_inf(v.x)), positive_or_inf(v.y)),
                                    positive_or_inf(v.z)), positive_or_inf(v.w));
                }
            } else {
                const long long at = tree_offset[k - 1] + child * FANOUT;
                const double2* in = reinterpret_cast<const double2*>(sums + at);
                const float4* in_min = reinterpret_cast<const float4*>(mins + at);
#pragma unroll
                for (int q = 0; q < FANOUT / 2; ++q) {
                    const double2 v = __ldcg(in + q);
                    c[2 * q] = v.x, c[2 * q + 1] = v.y;
                }
#pragma unroll
                for (int q = 0; q < FANOUT / 4; ++q) {
                    const float4 v = __ldcg(in_min + q);
                    m = fminf(fminf(fminf(fminf(m, positive_or_inf(v.x)), positive_or_inf(v.y)),
                                    positive_or_inf(v.z)), positive_or_inf(v.w));
                }
            }
            // Lane 0's order of the xor butterfly; constant bounds, so c stays in registers.
#pragma unroll
            for (int i = 0; i < 16; ++i) c[i] = __dadd_rn(c[i], c[i + 16]);
#pragma unroll
            for (int i = 0; i < 8; ++i) c[i] = __dadd_rn(c[i], c[i + 8]);
#pragma unroll
            for (int i = 0; i < 4; ++i) c[i] = __dadd_rn(c[i], c[i + 4]);
            c[0] = __dadd_rn(c[0], c[2]), c[1] = __dadd_rn(c[1], c[3]);
            s = __dadd_rn(c[0], c[1]);
            sums[tree_offset[k] + child] = s;
            mins[tree_offset[k] + child] = m;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            s = __dadd_rn(s, __shfl_xor_sync(FULL_MASK, s, o));
            m = fminf(m, __shfl_xor_sync(FULL_MASK, m, o));
        }
        if (lane == 0) {
            sums[tree_offset[k + 1] + node] = s;
            mins[tree_offset[k + 1] + node] = m;
        }
    }
}

// Levels k and k + 1 by `warps` warps when both are at most `last`, else level k alone.
__device__ void update_levels(int k, int last, const int* rows, int start, int count,
                              const float* leaves, double* sums, float* mins, long long warp,
                              long long warps) {
    if (k < last) update_pair(k, rows, start, count, leaves, sums, mins, warp, warps);
    else update_level(k, rows, start, count, leaves, sums, mins, warp, warps);
}

// Grid-wide passes of a tree update: the pairs that hold the levels below TOP_LEVEL.
#define GRID_PASSES (TOP_LEVEL / 2)

// Levels 1..D above `count` touched leaves; every block of the grid calls it after writing
// its leaves. The pairs of levels below TOP_LEVEL go grid-wide, a grid barrier before each
// (targets barrier, barrier + 1, …); the last block to finish them (the ticket counts
// arrivals; that block sets it back to 0) updates the levels above alone. Other blocks
// return.
__device__ void update_tree(const int* rows, int start, int count, const float* leaves,
                            double* sums, float* mins, unsigned int* arrivals,
                            unsigned int barrier, unsigned int* ticket) {
    __shared__ bool last;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    for (int pass = 0; pass < GRID_PASSES; ++pass) {
        __threadfence();
        grid_barrier(arrivals, barrier + (unsigned int)pass);
        update_pair(2 * pass + 1, rows, start, count, leaves, sums, mins, warp,
                    ((long long)gridDim.x * blockDim.x) >> 5);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int k = 2 * GRID_PASSES + 1; k <= TREE_DEPTH; k += 2) {
        update_levels(k, TREE_DEPTH, rows, start, count, leaves, sums, mins, threadIdx.x >> 5,
                      WARPS);
        __syncthreads();
    }
    if (threadIdx.x == 0) *ticket = 0u;
}

// Read once by the host: the grid barriers of one tree update (of replay_commit and of
// replay_insert; the host numbers them: each launch's targets follow the last's), a row's
// feature bytes.
extern "C" {
__device__ unsigned int replay_layout[2] = {GRID_PASSES, ROW_BYTES};
}

// A row's owner mark: the draw's mark (from 1, one more for each draw the host enqueues; 48
// bits last 10^9 s at 10^5 draws/s) above the batch position (B ≤ 65536, LearnerConfig's
// limit), so a later draw's marks exceed every earlier one's and no mark is ever cleared.
__device__ __forceinline__ unsigned long long owner_mark(unsigned long long mark, int b) {
    return (mark << 16) | (unsigned int)b;
}

// ---- replay_sample ---------------------------------------------------------------------
// Its arguments in one struct (server/core/native.py reads it), so that the host fills one
// in place and changes three fields a draw.
struct SampleArgs {
    const float* leaves;        // [32 n_1] p^α
    const double* sums;         // tree levels 1..D
    const float* mins;
    const unit_t* rows_t;       // [C] rows of ROW_UNITS
    const unit_t* rows_tp1;
    const int* actions;         // [C]
    const float* rewards;       // [C]
    const float* dones;         // [C]
    const float* discounts;     // [C]
    int* drawn;                 // [B] rows drawn
    unsigned long long* owner;  // [C] owner marks
    unit_t* packed;             // learner_step's packed inputs, weights present
    unsigned long long draw;    // the draw's number (the Philox counter's high words)
    unsigned long long mark;    // the draw's owner mark
    double beta;                // β of the importance weights
    unsigned int key0, key1;    // the Philox key (replay_seed's low and high words)
    int batch;                  // B
};

// Grid: ceil(B / (THREADS / 32)) blocks of THREADS; warp w of the grid draws row b = w.
// The buffer and the tree are read through the read-only cache (__ldg: the loads from a
// struct's pointers would not be).
extern "C" __global__ void __launch_bounds__(THREADS) replay_sample(const SampleArgs a) {
    const int lane = threadIdx.x & 31;
    const int b = (int)(((long long)blockIdx.x * THREADS + threadIdx.x) >> 5);
    const int batch = a.batch;
    if (b >= batch) return;  // whole warps: b is the same in every lane of one
    const double total = __ldg(&a.sums[tree_offset[TREE_DEPTH]]);
    double mass = __dmul_rn(draw_uniform(a.draw, b, a.key0, a.key1), total);
    long long node = 0;
    for (int k = TREE_DEPTH - 1; k >= 0; --k) {  // the children of `node` are at level k
        const long long at = node * FANOUT + lane;
        const double c = k == 0 ? (double)__ldg(&a.leaves[at])
                                : __ldg(&a.sums[tree_offset[k] + at]);
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
    unit_t* packed = a.packed;
    for (int u = lane; u < ROW_UNITS; u += 32) {
        packed[(size_t)b * ROW_UNITS + u] = __ldg(&a.rows_t[(size_t)row * ROW_UNITS + u]);
        packed[((size_t)batch + b) * ROW_UNITS + u] =
            __ldg(&a.rows_tp1[(size_t)row * ROW_UNITS + u]);
    }
    if (lane == 0) {
        float* tail = reinterpret_cast<float*>(packed + 2 * (size_t)batch * ROW_UNITS);
        const double ratio = __ddiv_rn((double)__ldg(&a.mins[tree_offset[TREE_DEPTH]]),
                                       (double)__ldg(&a.leaves[row]));
        reinterpret_cast<int*>(tail)[b] = __ldg(&a.actions[row]);
        tail[batch + b] = __ldg(&a.rewards[row]);
        tail[2 * batch + b] = __ldg(&a.dones[row]);
        tail[3 * batch + b] = __ldg(&a.discounts[row]);
        tail[4 * batch + b] = (float)pow(ratio, a.beta);
        a.drawn[b] = (int)row;
        atomicMax(a.owner + row, owner_mark(a.mark, b));
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
    const unsigned long long* owner;  // [C] owner marks (replay_sample's)
    float* priorities;          // [C]
    float* leaves;              // [32 n_1] p^α
    double* sums;               // tree levels 1..D
    float* mins;
    float* max_priority;        // [1] the largest priority written (bits compare as uints)
    unsigned int* control;      // [2] the run's halted flag, steps committed in the run
    float* stats;               // [run][5][G] each committed step's per-block partials, as
                                // learner_step wrote them (finite, norm, loss, Q sum, inputs ok)
    unsigned int* arrivals;     // [G] grid-barrier flags
    unsigned int* ticket;       // [1] update_tree's count of blocks done; 0 between launches
    unsigned long long mark;    // the draw's mark, as replay_sample got it
    double alpha;               // α
    unsigned int barrier;       // the first barrier's target
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
        for (int g = threadIdx.x; g < G; g += 32)  // no short cut: the loads go together
            ok &= (head[1 + g] == 1.f) & (head[1 + 4 * G + g] == 1.f) &
                  isfinite(head[1 + 2 * G + g]) & isfinite(head[1 + 3 * G + g]);
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
    unsigned int largest = 0u;  // of this thread's priorities, as bits
    for (long long b = tid; b < B; b += threads) {
        const int row = a.drawn[b];
        const float p = fminf(written[b], __int_as_float(FLT_MAX_BITS));
        if (a.owner[row] == owner_mark(a.mark, (int)b)) {  // the row's last occurrence
            a.priorities[row] = p;
            a.leaves[row] = leaf_of(p, a.alpha);
        }
        largest = max(largest, __float_as_uint(p));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) largest = max(largest, __shfl_xor_sync(FULL_MASK, largest, o));
    if ((threadIdx.x & 31) == 0 && largest != 0u)
        atomicMax(reinterpret_cast<unsigned int*>(a.max_priority), largest);
    float* partials = a.stats + (size_t)a.stats_row * 5 * G;  // the host adds them up
    for (long long i = tid; i < 5LL * G; i += threads) partials[i] = head[1 + i];
    if (tid == 0) a.control[1] += 1u;
    update_tree(a.drawn, 0, B, a.leaves, a.sums, a.mins, a.arrivals, a.barrier, a.ticket);
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
    unsigned int* ticket;       // [1]
    double alpha;
    unsigned int barrier;       // the first barrier's target
    int count;                  // n ≤ C
    int start;                  // the cursor: row t goes to (start + t) mod C
    int has_priorities;         // 0: every row gets *max_priority
    int staged_kind;            // the staged features: 0 the buffer's dtype; in a float32
                                // buffer also 1 float16, 2 bfloat16 (widened here, exactly)
};

// Rows [n][H] of 16-bit features of KIND (1 float16, 2 bfloat16) widened into the float32
// rows from row `start` on, wrapping at CAPACITY.
template <int KIND>
__device__ void widen_rows(const unsigned short* in, float* out, int n, int start,
                           long long tid, long long threads) {
    for (long long e = tid; e < (long long)n * HIDDEN_DIM; e += threads) {
        const long long t = e / HIDDEN_DIM, row = ((long long)start + t) % CAPACITY;
        out[row * HIDDEN_DIM + (e - t * HIDDEN_DIM)] = widen16<KIND>(in[e]);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) replay_insert(const InsertArgs a) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long threads = (long long)gridDim.x * blockDim.x;
    const int n = a.count;
    const float* tail;   // the staged rows' 32-bit vectors, after their features
#if FEATURES == 0
    if (a.staged_kind != 0) {
        const unsigned short* in = reinterpret_cast<const unsigned short*>(a.staged);
        const long long features = (long long)n * HIDDEN_DIM;
        float* rows_t = reinterpret_cast<float*>(a.rows_t);
        float* rows_tp1 = reinterpret_cast<float*>(a.rows_tp1);
        if (a.staged_kind == 1) {
            widen_rows<1>(in, rows_t, n, a.start, tid, threads);
            widen_rows<1>(in + features, rows_tp1, n, a.start, tid, threads);
        } else {
            widen_rows<2>(in, rows_t, n, a.start, tid, threads);
            widen_rows<2>(in + features, rows_tp1, n, a.start, tid, threads);
        }
        tail = reinterpret_cast<const float*>(in + 2 * features);
    } else
#endif
    {
        for (long long u = tid; u < (long long)n * ROW_UNITS; u += threads) {
            const long long t = u / ROW_UNITS, row = ((long long)a.start + t) % CAPACITY;
            const long long c = u - t * ROW_UNITS;
            a.rows_t[row * ROW_UNITS + c] = a.staged[u];
            a.rows_tp1[row * ROW_UNITS + c] = a.staged[(long long)n * ROW_UNITS + u];
        }
        tail = reinterpret_cast<const float*>(a.staged + 2 * (long long)n * ROW_UNITS);
    }
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
    update_tree(nullptr, a.start, n, a.leaves, a.sums, a.mins, a.arrivals, a.barrier,
                a.ticket);
}

// ---- replay_check ------------------------------------------------------------------------
struct CheckArgs {
    const unsigned int* staged;  // packed rows (packed_layout of n rows), as replay_insert
                                 // reads them: h_t | h_tp1 | actions | rewards | dones |
                                 // discounts | priorities (if given)
    unsigned int* refused;       // [1] zeroed before; set to 1 if any value fails
    int count;                   // n
    int staged_kind;             // the features: 0 float32, 1 float16, 2 bfloat16
    int has_priorities;
};

// A feature's exponent bits all set: an Inf or a NaN (the same test as the host's).
__device__ __forceinline__ bool not_finite_bits(unsigned int bits, unsigned int exponent) {
    return (bits & exponent) == exponent;
}

// Grid-strided; any grid size gives the same word.
extern "C" __global__ void __launch_bounds__(THREADS) replay_check(const CheckArgs a) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long threads = (long long)gridDim.x * blockDim.x;
    const int n = a.count;
    const long long features = 2LL * n * HIDDEN_DIM;   // of h_t and h_tp1
    bool bad = false;
    const float* tail;
    if (a.staged_kind == 0) {
        for (long long e = tid; e < features; e += threads)
            bad |= not_finite_bits(__ldg(a.staged + e), 0x7f800000u);
        tail = reinterpret_cast<const float*>(a.staged + features);
    } else {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(a.staged);
        const unsigned int exponent = a.staged_kind == 1 ? 0x7c00u : 0x7f80u;
        for (long long e = tid; e < features; e += threads)
            bad |= not_finite_bits(__ldg(h + e), exponent);
        tail = reinterpret_cast<const float*>(h + features);
    }
    for (long long t = tid; t < n; t += threads) {
        const int action = __ldg(reinterpret_cast<const int*>(tail) + t);
        const float reward = __ldg(tail + n + t), done = __ldg(tail + 2 * n + t);
        const float discount = __ldg(tail + 3 * n + t);
        bad |= !(action >= 0 && action < N_ACTIONS && isfinite(reward) &&
                 (done == 0.f || done == 1.f) && discount >= 0.f && discount <= 1.f);
        if (a.has_priorities) {
            const float p = __ldg(tail + 4 * n + t);
            bad |= !(isfinite(p) && p > 0.f);
        }
    }
    if (bad) *a.refused = 1u;   // every writer writes the same word
}
