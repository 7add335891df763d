// learner_step.cu — one Dueling-DQN learner step (docs/design.md §1) as ONE cooperative kernel,
// plus the Q-values kernel of Act.
//
// Grid: G blocks of THREADS threads, all resident (cooperative launch), G ≤ #SMs.
//   Phase 1 (rows)    block b owns rows [b·R, b·R + R), ROW_TILE at a time (the next tile's
//                     loads in flight while this one computes): forward of θ(h_t), θ⁻(h_tp1)
//                     and, for double DQN, θ(h_tp1); target action, y, δ, Huber, g; writes
//                     td_errors / priorities and its partial gradient over its rows (never a
//                     per-sample B·H·N buffer). Also copies its slice of the ISV to the next one.
//                     Its partials are tagged with the launch's epoch (dueling_common.cuh).
//   Phase 2 (params)  block b owns a slice of the parameters: sums the G partials of its slice
//                     in a fixed order (ranges of blocks, then the ranges), waiting for each to
//                     carry this epoch (no grid barrier: a block starts as soon as the partials
//                     it needs have landed); with clipping, publishes its squared norm, waits at
//                     a grid barrier and sums all of them in a fixed order (lane ranges, then a
//                     butterfly); then Adam/SGD and the target update on its
//                     slice. The last block (smallest slice) also folds the batch entropy into
//                     the ISV.
// The grid barrier is a per-block arrival flag that every block polls. No atomics, and no
// reduction whose order depends on timing. Per-block loss, Q and norm partials go out with
// the outputs and the host adds them in block order.
//
// Packed inputs (B = batch): h_t [B,H] | h_tp1 [B,H] (FEATURES dtype) | then 32-bit words:
//   actions [B] (int32) | rewards [B] | dones [B] | discounts [B] | weights [B] (only if
//   has_weights)
// Packed outputs: td_errors [B] | priorities [B] | entropy | per block g < G:
//   finite[g] (1.0 = finite) | grad_norm[g] (of its slice) | loss_sum[g] | q_sum[g] |
//   inputs_ok[g] (1.0 = every input value of its rows is valid: h_t, h_tp1 and rewards
//   finite, actions in [0, N), dones 0 or 1, discounts in [0, 1], weights finite and ≥ 0.
//   The host skips those passes over the batch and looks for the culprit only when a block
//   says 0.0; an action out of range is read as 0 meanwhile, so no index leaves its array)

#include "dueling_common.cuh"

// θ and θ⁻ staged in shared memory when they fit, weight rows HS floats apart (padded so
// that the rows a warp reads at once fall in different banks), biases after them.
#define WS_STRIDE (((N_OUT * (HS + 1) + 3) / 4) * 4)      // floats between staged sets
#define STAGE_WEIGHTS (WS_STRIDE <= 12288)
#define WROW (STAGE_WEIGHTS ? HS : HIDDEN_DIM)            // floats between weight rows read
#define WBIAS (N_OUT * WROW)                              // offset of the biases
#define WEIGHT_VECS (N_WEIGHTS / VW)                     // weight gradient as vectors
#define VECS_PER_THREAD ((WEIGHT_VECS + THREADS - 1) / THREADS)
#define BIAS_PER_THREAD ((N_OUT + THREADS - 1) / THREADS)
#define GRAD_IN_REGISTERS (VECS_PER_THREAD * VW <= 32)
// Lanes per row in the per-row stage: the smallest power of two ≥ N (up to a warp).
#define SEG (N_ACTIONS <= 2 ? 2 : N_ACTIONS <= 4 ? 4 : N_ACTIONS <= 8 ? 8 \
             : N_ACTIONS <= 16 ? 16 : 32)
#define HALF_TILE ((ROW_TILE + 1) / 2)
#define STEP_SMEM_FLOATS (ROW_TILE * (2 * HS + 4 * N_OUT + 5) + (STAGE_WEIGHTS ? 2 * WS_STRIDE : 0))
#define QV_SMEM_FLOATS (ROW_TILE * (HS + N_OUT + 1))

// Read once by the host: parameters, set stride, dynamic shared bytes, rows per tile.
extern "C" {
__device__ unsigned int learner_layout[5] = {N_PARAMS, PARAM_STRIDE, STEP_SMEM_FLOATS * 4,
                                             QV_SMEM_FLOATS * 4, ROW_TILE};
}

struct StepArgs {
    const float* state;        // [4][PARAM_STRIDE] current θ, θ⁻, Adam m, Adam v
    float* next;               // [4][PARAM_STRIDE] proposed state (every element written)
    const float* isv;          // [isv_size] current ISV
    float* isv_next;           // [isv_size] proposed ISV
    const int* observed;       // [isv_size] current observed flags (0/1)
    int* observed_next;        // [isv_size] proposed observed flags
    const float* inputs;       // packed inputs
    float* out;                // packed outputs
    tagged_t* part_grad;       // [G][PARAM_STRIDE] per-block gradient partials (tagged)
    double* part_sq;           // [G] per-block squared gradient norms (clipping)
    tagged_t* part_counts;     // [G][N_ACTIONS] per-block action counts (tagged)
    float* grad;               // [N_PARAMS] reduced gradient
    unsigned int* arrivals;    // [G] grid-barrier arrival flags
    double max_norm;           // global-norm clip threshold, 0 = off
    unsigned int epoch;        // this launch's tag (partials: epoch−1 until final, then
                               // epoch; clipping's grid barrier: epoch+1)
    int batch;                 // B
    int rows_per_block;        // R
    int has_weights;           // importance weights present
    int double_dqn;            // select a* with θ instead of θ⁻
    int adam;                  // 1 = Adam, 0 = SGD
    int update_target;         // this step updates θ⁻
    int isv_size;              // S
    int entropy_slot;          // ISV slot of the batch action entropy, −1 = off
    float kappa;               // Huber κ
    float priority_eps;        // ε of |δ| + ε
    float lr;                  // learning rate
    float one_minus_beta1;     // 1 − β1, rounded once from its exact value (as torch)
    float beta2;               // β2
    float one_minus_beta2;     // 1 − β2, rounded once from its exact value
    float adam_eps;            // Adam's ε
    float step_size;           // lr / (1 − β1^t)
    float sqrt_bc2;            // sqrt(1 − β2^t)
    float tau;                 // target update rate
    float ent_alpha;           // EMA rate α of the entropy slot
    float ent_keep;            // 1 − α
};

// A vector of floats stored / loaded as VW tagged words.
__device__ __forceinline__ void put_vec(tagged_t* dst, const vec_t v, unsigned int epoch) {
#if VW == 4
    put_tagged(dst, __float_as_uint(v.x), epoch);
    put_tagged(dst + 1, __float_as_uint(v.y), epoch);
    put_tagged(dst + 2, __float_as_uint(v.z), epoch);
    put_tagged(dst + 3, __float_as_uint(v.w), epoch);
#else
    put_tagged(dst, __float_as_uint(v), epoch);
#endif
}

__device__ __forceinline__ vec_t peek_vec(const tagged_t* src) {
#if VW == 4
    return make_float4(tagged_value(peek_tagged(src), 0.f), tagged_value(peek_tagged(src + 1), 0.f),
                       tagged_value(peek_tagged(src + 2), 0.f), tagged_value(peek_tagged(src + 3), 0.f));
#else
    return tagged_value(peek_tagged(src), 0.f);
#endif
}

// Column sums over the G blocks' tagged partials: thread t < ncols gets Σ_g src[g * stride + t]
// (0 elsewhere), each partial awaited until it carries `epoch`. Each column is split into
// contiguous block ranges summed by different threads, and the range sums are added in range
// order. `red` holds THREADS values of shared memory.
template <typename T>
__device__ __forceinline__ T sum_columns(const tagged_t* src, int stride, int ncols, int G, T* red,
                                         unsigned int epoch) {
    const int tid = threadIdx.x, chunks = THREADS / ncols, col = tid % ncols, ch = tid / ncols;
    const T s = ch < chunks ? tagged_sum<T>(src + col, stride, ch * G / chunks,
                                            (ch + 1) * G / chunks, epoch)
                            : T(0);
    red[tid] = s;
    __syncthreads();
    T total = 0;
    if (tid < ncols)
        for (int k = 0; k < chunks; ++k) total += red[k * ncols + tid];
    __syncthreads();
    return total;
}

// One block per SM by design (G ≤ #SMs): registers are not rationed for occupancy.
extern "C" __global__ void __launch_bounds__(THREADS, 1) learner_step(const StepArgs a) {
    extern __shared__ float4 smem4[];
    float* ws = reinterpret_cast<float*>(smem4);  // [2][WS_STRIDE] θ, θ⁻ (if STAGE_WEIGHTS)
    float* ht = ws + (STAGE_WEIGHTS ? 2 * WS_STRIDE : 0);  // [ROW_TILE][HS] h_t rows of the tile
    float* hn = ht + ROW_TILE * HS;               // [ROW_TILE][HS] h_tp1 rows
    float* q = hn + ROW_TILE * HS;  // [3][ROW_TILE][N_OUT] θ(h_t), θ⁻(h_tp1), θ(h_tp1)
    float* coef = q + 3 * ROW_TILE * N_OUT;       // [ROW_TILE][N_OUT] ∂L/∂V, ∂L/∂A per row
    float* row_f = coef + ROW_TILE * N_OUT;       // [ROW_TILE][4] reward, done, discount, weight
    int* row_act = reinterpret_cast<int*>(row_f + 4 * ROW_TILE);  // [ROW_TILE]
    __shared__ unsigned int counts[N_ACTIONS];    // this block's action counts
    __shared__ double red[THREADS];
    __shared__ double scratch[33];
    __shared__ double warp_stats[THREADS / 32][2];  // loss, Q sums of the rows (phase 1)
    __shared__ double slice_sq[THREADS / 32];       // ‖g‖² of the slice by warp (phase 2)
    __shared__ float shared_scale;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int blk = blockIdx.x, G = gridDim.x, B = a.batch;
    const size_t BH = (size_t)B * HIDDEN_DIM;
    const char* in = reinterpret_cast<const char*>(a.inputs);
    const void* h_t = in;                                              // [B, H] FEATURES
    const void* h_tp1 = in + BH * FEATURE_BYTES;                       // [B, H] FEATURES
    const float* tail = reinterpret_cast<const float*>(in + 2 * BH * FEATURE_BYTES);
    const int* actions = reinterpret_cast<const int*>(tail);           // [B]
    const float* rewards = tail + B;  // [4][B] rewards, dones, discounts, weights
    float* td = a.out;                         // [B]
    float* prio = a.out + B;                   // [B]
    float* head = a.out + 2 * B;               // [1 + 5G]
    const float* theta = a.state;
    const float* target = a.state + PARAM_STRIDE;
    const bool entropy_on = a.entropy_slot >= 0;
    const float kappa = a.kappa, inv_n = 1.0f / (float)N_ACTIONS;

    // ---- Phase 1: rows -------------------------------------------------------------
    const int row_begin = min(B, blk * a.rows_per_block);
    const int row_end = min(B, row_begin + a.rows_per_block);
    const int tiles = max(1, (row_end - row_begin + ROW_TILE - 1) / ROW_TILE);
    const int sets = a.double_dqn ? 3 : 2;

    vec_t fetch_t[FETCH_PER_THREAD], fetch_n[FETCH_PER_THREAD];  // the next tile, in flight
    float fetch_f[4];  // thread r < ROW_TILE: reward, done, discount, weight of row r
    int fetch_act = 0;
    bool inputs_ok = true;  // every input value this thread fetched is valid (docs/design.md §7)
    auto fetch = [&](int row0) {
        fetch_rows<FEATURES>(fetch_t, h_t, row0, row_end);
        fetch_rows<FEATURES>(fetch_n, h_tp1, row0, row_end);
        if (tid < ROW_TILE) {
            const int b = row0 + tid;
            const bool ok = b < row_end;
            fetch_act = ok ? actions[b] : 0;
            for (int k = 0; k < 3; ++k) fetch_f[k] = ok ? rewards[k * B + b] : 0.f;
            fetch_f[3] = ok && a.has_weights ? rewards[3 * B + b] : 1.f;
            // The host leaves these checks to us; NaN fails every comparison below.
            const float done = fetch_f[1], disc = fetch_f[2], w = fetch_f[3];
            const bool valid = fetch_act >= 0 && fetch_act < N_ACTIONS && isfinite(fetch_f[0])
                               && (done == 0.f || done == 1.f) && disc >= 0.f && disc <= 1.f
                               && w >= 0.f && isfinite(w);
            inputs_ok = inputs_ok && valid;
            if (!valid) fetch_act = 0;  // an index in range: the step is refused anyway
        }
    };
    fetch(row_begin);

    // This block's slice of the ISV is copied to the proposed ISV; the first THREADS
    // entries are loaded now and stored once the weights are staged.
    const int isv_slice = (a.isv_size + G - 1) / G;
    const int isv_begin = min(a.isv_size, blk * isv_slice);
    const int isv_end = min(a.isv_size, isv_begin + isv_slice);
    const int isv_i = isv_begin + tid;
    const float isv_v = isv_i < isv_end ? a.isv[isv_i] : 0.f;
    const int observed_v = isv_i < isv_end ? a.observed[isv_i] : 0;
#if STAGE_WEIGHTS
    for (int base = 0; base < N_PARAMS; base += 8 * THREADS) {
        float w[16];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int p = base + u * THREADS + tid;
            w[2 * u] = p < N_PARAMS ? __ldg(theta + p) : 0.f;
            w[2 * u + 1] = p < N_PARAMS ? __ldg(target + p) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int p = base + u * THREADS + tid;
            if (p < N_PARAMS) {
                const int j = p / HIDDEN_DIM;  // row, or N_OUT for a bias
                const int d = j < N_OUT ? j * WROW + (p - j * HIDDEN_DIM) : WBIAS + p - N_WEIGHTS;
                ws[d] = w[2 * u];
                ws[WS_STRIDE + d] = w[2 * u + 1];
            }
        }
    }
    const float* w_online = ws;
    const float* w_target = ws + WS_STRIDE;
#else
    const float* w_online = theta;
    const float* w_target = target;
#endif
    const int folded_slot = entropy_on ? a.entropy_slot : -1;  // written in phase 2 instead
    if (isv_i < isv_end && isv_i != folded_slot) {
        a.isv_next[isv_i] = isv_v;
        a.observed_next[isv_i] = observed_v;
    }
    for (int i = isv_i + THREADS; i < isv_end; i += THREADS) {  // small grids only
        if (i == folded_slot) continue;
        a.isv_next[i] = a.isv[i];
        a.observed_next[i] = a.observed[i];
    }
    for (int k = tid; k < N_ACTIONS; k += THREADS) counts[k] = 0;

#if GRAD_IN_REGISTERS
    vec_t acc[VECS_PER_THREAD];
    float acc_bias[BIAS_PER_THREAD];
#pragma unroll
    for (int k = 0; k < VECS_PER_THREAD; ++k) acc[k] = vec_zero();
#pragma unroll
    for (int k = 0; k < BIAS_PER_THREAD; ++k) acc_bias[k] = 0.f;
#endif
    tagged_t* my_part = a.part_grad + (size_t)blk * PARAM_STRIDE;
    double loss_w = 0.0, q_w = 0.0;  // this lane's rows (first lane of each row group)

    for (int tile = 0; tile < tiles; ++tile) {
        const int row0 = row_begin + tile * ROW_TILE;
        const int rows = max(0, min(ROW_TILE, row_end - row0));
        stash_rows(fetch_t, ht);
        stash_rows(fetch_n, hn);
        inputs_ok = inputs_ok && all_finite(fetch_t) && all_finite(fetch_n);
        if (tid < ROW_TILE) {
            for (int k = 0; k < 4; ++k) row_f[tid * 4 + k] = fetch_f[k];
            row_act[tid] = fetch_act;
        }
        __syncthreads();
        if (tile + 1 < tiles) fetch(row0 + ROW_TILE);

        // Forward: item = (set, output j, rows r and r + HALF_TILE), one weight row read for
        // both; r varies fastest so a warp shares weight rows.
        for (int item = tid; item < sets * N_OUT * HALF_TILE; item += THREADS) {
            const int r = item % HALF_TILE, k = item / HALF_TILE;
            const int s = k / N_OUT, j = k - s * N_OUT;
            const int r1 = r + HALF_TILE < ROW_TILE ? r + HALF_TILE : r;
            const float* p = (s == 1) ? w_target : w_online;
            const float* x = s == 0 ? ht : hn;
            const float bias = p[WBIAS + j];
            const float2 d = dot_rows2(x + r * HS, x + r1 * HS, p + j * WROW);
            q[(s * ROW_TILE + r) * N_OUT + j] = d.x + bias;
            q[(s * ROW_TILE + r1) * N_OUT + j] = d.y + bias;
        }
        __syncthreads();

        // Per row, SEG lanes each: target action (ties → lowest index), y, δ, Huber,
        // ∂L/∂(V, A).
        for (int r0 = warp * (32 / SEG); r0 < ROW_TILE; r0 += THREADS / SEG) {
            const int r = r0 + lane / SEG, sl = lane % SEG;
            const bool in_tile = r < ROW_TILE, valid = r < rows;
            const int rr = in_tile ? r : ROW_TILE - 1;  // lanes past the tile compute a copy
            const float* qo = q + rr * N_OUT;
            const float* qt = q + (ROW_TILE + rr) * N_OUT;
            const float* qs = a.double_dqn ? q + (2 * ROW_TILE + rr) * N_OUT : qt;
            float so = 0.f, st = 0.f, ss = 0.f;
            for (int k = sl; k < N_ACTIONS; k += SEG) {
                so += qo[1 + k];
                st += qt[1 + k];
                ss += qs[1 + k];
            }
            const float mean_o = group_sum<SEG>(so) / (float)N_ACTIONS;
            const float mean_t = group_sum<SEG>(st) / (float)N_ACTIONS;
            const float mean_s = group_sum<SEG>(ss) / (float)N_ACTIONS;
            float best_q = __int_as_float(0xff800000);  // −∞
            int best = sl;
            for (int k = sl; k < N_ACTIONS; k += SEG) {
                const float v = (qs[0] + qs[1 + k]) - mean_s;
                if (v > best_q) { best_q = v; best = k; }
            }
#pragma unroll
            for (int o = SEG / 2; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL_MASK, best_q, o);
                const int oi = __shfl_xor_sync(FULL_MASK, best, o);
                if (ov > best_q || (ov == best_q && oi < best)) { best_q = ov; best = oi; }
            }
            const int act = row_act[rr];
            const float* f = row_f + 4 * rr;
            const float q_next = (qt[0] + qt[1 + best]) - mean_t;
            const float y = f[0] + (f[2] * (1.f - f[1])) * q_next;
            const float q_taken = (qo[0] + qo[1 + act]) - mean_o;
            const float delta = q_taken - y;
            const float ad = fabsf(delta);
            const float g = valid ? (f[3] * fminf(fmaxf(delta, -kappa), kappa)) / (float)B : 0.f;
            float* cf = coef + rr * N_OUT;
            if (in_tile) {
                if (sl == 0) {
                    cf[0] = g;
                    if (valid) {
                        const float huber =
                            ad <= kappa ? (0.5f * delta) * delta : kappa * (ad - 0.5f * kappa);
                        td[row0 + r] = delta;
                        prio[row0 + r] = ad + a.priority_eps;
                        loss_w += (double)(f[3] * huber);
                        q_w += (double)q_taken;
                    }
                }
                for (int k = sl; k < N_ACTIONS; k += SEG)
                    cf[1 + k] = g * ((k == act ? 1.f : 0.f) - inv_n);
            }
        }
        __syncthreads();

        if (entropy_on)
            for (int k = tid; k < N_ACTIONS; k += THREADS)
                for (int r = 0; r < rows; ++r) counts[k] += (row_act[r] == k);
        // Partial gradient of this tile: ∂W[j][c] = Σ_r h[r][c]·coef[r][j] (VW columns of
        // one row j at a time), ∂b[j] = Σ_r coef[r][j].
#if GRAD_IN_REGISTERS
#pragma unroll
#else
#pragma unroll 4
#endif
        for (int k = 0; k < VECS_PER_THREAD; ++k) {
            const int i = tid + k * THREADS, p = i * VW;
            vec_t s = vec_zero();
            if (i < WEIGHT_VECS) {
                const int j = p / HIDDEN_DIM, c = p - j * HIDDEN_DIM;
#pragma unroll
                for (int r = 0; r < ROW_TILE; ++r)
                    vec_fma(s, *reinterpret_cast<const vec_t*>(ht + r * HS + c),
                            coef[r * N_OUT + j]);
            }
#if GRAD_IN_REGISTERS
            vec_add(acc[k], s);
#else
            if (i < WEIGHT_VECS) {  // running sums are tagged epoch − 1 until the last tile
                if (tile > 0) vec_add(s, peek_vec(my_part + p));
                put_vec(my_part + p, s, tile + 1 == tiles ? a.epoch : a.epoch - 1);
            }
#endif
        }
#pragma unroll
        for (int k = 0; k < BIAS_PER_THREAD; ++k) {
            const int j = tid + k * THREADS;
            float s = 0.f;
            if (j < N_OUT) {
#pragma unroll
                for (int r = 0; r < ROW_TILE; ++r) s += coef[r * N_OUT + j];
            }
#if GRAD_IN_REGISTERS
            acc_bias[k] += s;
#else
            if (j < N_OUT) {
                tagged_t* dst = my_part + N_WEIGHTS + j;
                if (tile > 0) s += tagged_value(peek_tagged(dst), 0.f);
                put_tagged(dst, __float_as_uint(s), tile + 1 == tiles ? a.epoch : a.epoch - 1);
            }
#endif
        }
        __syncthreads();
    }
#if GRAD_IN_REGISTERS
#pragma unroll
    for (int k = 0; k < VECS_PER_THREAD; ++k)
        if (tid + k * THREADS < WEIGHT_VECS) put_vec(my_part + (tid + k * THREADS) * VW, acc[k], a.epoch);
#pragma unroll
    for (int k = 0; k < BIAS_PER_THREAD; ++k)
        if (tid + k * THREADS < N_OUT)
            put_tagged(my_part + N_WEIGHTS + tid + k * THREADS, __float_as_uint(acc_bias[k]), a.epoch);
#endif
    if (entropy_on)
        for (int k = tid; k < N_ACTIONS; k += THREADS)
            put_tagged(a.part_counts + blk * N_ACTIONS + k, counts[k], a.epoch);
    loss_w = warp_sum(loss_w);  // lanes 0 and multiples of SEG hold row sums
    q_w = warp_sum(q_w);
    if (lane == 0) {
        warp_stats[warp][0] = loss_w;
        warp_stats[warp][1] = q_w;
    }
    inputs_ok = __syncthreads_and(inputs_ok);
    if (tid == 0) {
        double loss = 0.0, qsum = 0.0;
        for (int w = 0; w < THREADS / 32; ++w) {
            loss += warp_stats[w][0];
            qsum += warp_stats[w][1];
        }
        head[1 + 2 * G + blk] = (float)loss;
        head[1 + 3 * G + blk] = (float)qsum;
        head[1 + 4 * G + blk] = inputs_ok ? 1.f : 0.f;
    }

    // ---- Phase 2: this block's parameter slice ------------------------------------
    // No grid barrier: sum_columns waits for each partial it needs to carry this epoch.
    const int slice = (N_PARAMS + G - 1) / G;
    const int p_begin = min(N_PARAMS, blk * slice), p_end = min(N_PARAMS, p_begin + slice);
    const int p_first = p_begin + tid;
    const float* m = a.state + 2 * PARAM_STRIDE;
    const float* v = a.state + 3 * PARAM_STRIDE;
    float th0 = 0.f, tg0 = 0.f, m0 = 0.f, v0 = 0.f, g0 = 0.f;  // this thread's first parameter
    if (p_first < p_end) {
        th0 = theta[p_first];
        tg0 = target[p_first];
        m0 = m[p_first];
        v0 = v[p_first];
    }
    double sq = 0.0;
    for (int base = p_begin; base < p_end; base += THREADS) {
        const int cols = min(THREADS, p_end - base);
        const float total = sum_columns(a.part_grad + base, PARAM_STRIDE, cols, G,
                                        reinterpret_cast<float*>(red), a.epoch);
        if (tid < cols) {
            a.grad[base + tid] = total;
            sq += (double)total * (double)total;
            if (base == p_begin) g0 = total;
        }
    }
    // The last block has the smallest parameter slice (often none): it folds the entropy.
    const bool folds_entropy = blk == G - 1;
    if (folds_entropy && tid == 0 && !entropy_on) head[0] = 0.f;
    if (folds_entropy && entropy_on) {  // batch action entropy → EMA in the proposed ISV
        double term = 0.0;
        for (int base = 0; base < N_ACTIONS; base += THREADS) {
            const int cols = min(THREADS, N_ACTIONS - base);
            const unsigned int c = sum_columns(a.part_counts + base, N_ACTIONS, cols, G,
                                               reinterpret_cast<unsigned int*>(red), a.epoch);
            if (tid < cols && c > 0) {
                const double p = (double)c / (double)B;
                term -= p * log(p);
            }
        }
        const double entropy = block_sum(term, scratch);
        if (tid == 0) {  // phase 1 left this slot to this block
            const int s = a.entropy_slot;
            const float h = (float)entropy;
            head[0] = h;
            a.isv_next[s] = a.observed[s] ? a.ent_keep * a.isv[s] + a.ent_alpha * h : h;
            a.observed_next[s] = 1;
        }
    }

    float scale = 1.f;
    const bool clipping = a.max_norm > 0.0;
    if (clipping) {  // clipping needs the global norm now: one more grid barrier
        sq = block_sum(sq, scratch);
        if (tid == 0) a.part_sq[blk] = sq;
        grid_barrier(a.arrivals, a.epoch + 1);
        if (tid < 32) {  // lane l adds blocks [l·G/32, (l+1)·G/32), then a fixed butterfly
            const double total =
                warp_sum(strided_sum(a.part_sq, 1, tid * G / 32, (tid + 1) * G / 32));
            if (tid == 0) shared_scale = (float)fmin(1.0, a.max_norm / (sqrt(total) + 1e-6));
        }
        __syncthreads();
        scale = shared_scale;
    }

    float* theta_next = a.next;
    float* target_next = a.next + PARAM_STRIDE;
    float* m_next = a.next + 2 * PARAM_STRIDE;
    float* v_next = a.next + 3 * PARAM_STRIDE;
    const bool update_target = a.update_target != 0;
    bool finite = true;
    for (int p = p_first; p < p_end; p += THREADS) {
        const bool first = p == p_first;
        const float g = (first ? g0 : a.grad[p]) * scale;
        const float th_old = first ? th0 : theta[p], tg_old = first ? tg0 : target[p];
        float m1 = first ? m0 : m[p], v1 = first ? v0 : v[p], update;
        if (a.adam) {  // torch.optim.Adam: m.lerp_(g, 1 − β1), v.mul_(β2).addcmul_(g, g, 1 − β2)
            const float w1 = a.one_minus_beta1;
            m1 = w1 < 0.5f ? fmaf(w1, g - m1, m1) : fmaf(w1 - 1.f, g - m1, g);
            v1 = fmaf(a.one_minus_beta2 * g, g, a.beta2 * v1);
            update = (a.step_size * m1) / (sqrtf(v1) / a.sqrt_bc2 + a.adam_eps);
        } else {
            update = a.lr * g;
        }
        const float th = th_old - update;
        const float tg = update_target ? tg_old + a.tau * (th - tg_old) : tg_old;
        theta_next[p] = th;
        target_next[p] = tg;
        m_next[p] = m1;
        v_next[p] = v1;
        finite = finite && isfinite(g) && isfinite(th) && isfinite(tg) && isfinite(m1) &&
                 isfinite(v1);
    }
    if (!clipping) {  // the slice norm is only reported: its block sum shares the last barrier
        sq = warp_sum(sq);
        if (lane == 0) slice_sq[warp] = sq;
    }
    finite = __syncthreads_and(finite);
    if (tid == 0) {
        if (!clipping) {
            sq = 0.0;
            for (int w = 0; w < THREADS / 32; ++w) sq += slice_sq[w];
        }
        head[1 + blk] = finite ? 1.f : 0.f;
        head[1 + G + blk] = (float)sqrt(sq);
    }
}

// Q-values of Act: q[r][a] = V + A[a] − mean A under one parameter set, rows in tiles.
extern "C" __global__ void __launch_bounds__(THREADS)
q_values(const float* __restrict__ params, const float* __restrict__ h, float* __restrict__ q,
         int rows) {
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);  // [ROW_TILE][HS]
    float* va = xs + ROW_TILE * HS;               // [ROW_TILE][N_OUT] V, A
    float* mean = va + ROW_TILE * N_OUT;          // [ROW_TILE]
    const int row0 = blockIdx.x * ROW_TILE;
    vec_t regs[FETCH_PER_THREAD];
    fetch_rows<0>(regs, h, row0, rows);
    stash_rows(regs, xs);
    __syncthreads();
    for (int item = threadIdx.x; item < N_OUT * ROW_TILE; item += THREADS) {
        const int r = item % ROW_TILE, j = item / ROW_TILE;
        va[r * N_OUT + j] = dot_row(xs + r * HS, params + j * HIDDEN_DIM) + params[N_WEIGHTS + j];
    }
    __syncthreads();
    if (threadIdx.x < ROW_TILE) mean[threadIdx.x] = mean_advantage(va + threadIdx.x * N_OUT);
    __syncthreads();
    for (int i = threadIdx.x; i < ROW_TILE * N_ACTIONS; i += THREADS) {
        const int r = i / N_ACTIONS, k = i - r * N_ACTIONS;
        if (row0 + r < rows)
            q[(size_t)(row0 + r) * N_ACTIONS + k] =
                (va[r * N_OUT] + va[r * N_OUT + 1 + k]) - mean[r];
    }
}
