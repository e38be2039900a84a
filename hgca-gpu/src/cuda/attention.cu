// hgca CUDA kernels: dense attention with LSE over the circular KV window,
// ring writes and eviction gathers.
//
// Compiled at run time by NVRTC. The host prepends the specialisation
// (see `KernelSpec::source` in spec.rs):
//   HGCA_DT     0 = f32, 1 = f16, 2 = bf16 storage of K and V
//   HGCA_HD     head dim d
//   HGCA_VEC    elements per vector load (16 bytes when a row allows it, else 1)
//   HGCA_LANES  lanes that share one K/V row in the decode kernel (power of 2, <= 32)
//   HGCA_E      vector loads per lane per row
//   HGCA_GB     query heads per decode block (one K/V load serves all of them)
//   HGCA_U      tokens per row per decode iteration (their loads are in flight together)
//   HGCA_MINB   decode blocks per multiprocessor the registers must allow (launch bounds)
//   HGCA_ASYNC  1: the decode loop stages K/V in shared memory with cp.async (sm_80+)
//
// No CUDA header is needed: f16/bf16 are widened by hand (cvt / shift), all
// arithmetic is f32. Scores are kept in the log2 domain (q is pre-scaled by
// scale * log2(e)) so every exponential is one exp2f; lse leaves the decode
// split kernel in log2 and is converted to natural log exactly once.
//
// Window layout: K and V are [kv_heads, cap, d]; logical token i (0 = oldest)
// lives in slot (start_slot + i) % cap.

#define HD HGCA_HD
#define NEG_INF (__int_as_float(0xff800000))
#define FULL_MASK 0xffffffffu
#define LN2_F 0.693147180559945309f

#if HGCA_DT == 0
typedef float kv_t;
#else
typedef unsigned short kv_t;
#endif

constexpr int kVec = HGCA_VEC;
constexpr int kNv = HD / kVec;
constexpr int kL = HGCA_LANES;
constexpr int kE = HGCA_E;
constexpr int kEV = kE * kVec;
constexpr int kR = 32 / kL;
constexpr int kWarps = 4;
constexpr int kNS = kWarps * kR;
constexpr int kGB = HGCA_GB;
constexpr int kU = HGCA_U;
constexpr int kTI = kU * kNS;  // tokens per decode iteration
constexpr int kStages = 3;                          // cp.async pipeline depth
constexpr int kPieces = HD * (int)sizeof(kv_t) / 16;  // 16-byte pieces per row (async path)
constexpr int kChunks = 2 * kTI * kPieces;          // 16-byte copies per stage

static_assert(HD % kVec == 0, "vector width must divide d");
static_assert(kVec == 1 || kVec * sizeof(kv_t) == 16, "vector loads are 16 bytes");
static_assert(kL >= 1 && kL <= 32 && (kL & (kL - 1)) == 0, "lanes per row: power of 2");
static_assert(kE * kL >= kNv, "lanes cover a row");
static_assert(kGB >= 1 && kGB <= 8, "heads per block");
static_assert(kU >= 1 && kU <= 8, "tokens per row and iteration");
static_assert(!HGCA_ASYNC || (kVec > 1 && HD * sizeof(kv_t) % 16 == 0), "async rows are 16-byte pieces");

__device__ __forceinline__ float f16_bits_to_f32(unsigned int h) {
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

// Widens the low / high 16-bit element of a 32-bit word.
__device__ __forceinline__ float lo16(unsigned int w) {
#if HGCA_DT == 1
    return f16_bits_to_f32(w & 0xffffu);
#else
    return __uint_as_float(w << 16);
#endif
}
__device__ __forceinline__ float hi16(unsigned int w) {
#if HGCA_DT == 1
    return f16_bits_to_f32(w >> 16);
#else
    return __uint_as_float(w & 0xffff0000u);
#endif
}

__device__ __forceinline__ float to_f32(kv_t x) {
#if HGCA_DT == 0
    return x;
#else
    return lo16((unsigned int)x);
#endif
}

// One vector of kVec elements, as raw bits.
__device__ __forceinline__ uint4 load_vec(const kv_t* __restrict__ p) {
    uint4 r;
    if constexpr (kVec > 1) {
        r = *reinterpret_cast<const uint4*>(p);
    } else {
#if HGCA_DT == 0
        r.x = __float_as_uint(*p);
#else
        r.x = (unsigned int)(*p);
#endif
        r.y = 0u; r.z = 0u; r.w = 0u;
    }
    return r;
}

__device__ __forceinline__ void unpack(const uint4 r, float* f) {
    if constexpr (kVec == 1) {
#if HGCA_DT == 0
        f[0] = __uint_as_float(r.x);
#else
        f[0] = lo16(r.x);
#endif
    } else {
#if HGCA_DT == 0
        f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
        f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
#else
        f[0] = lo16(r.x); f[1] = hi16(r.x); f[2] = lo16(r.y); f[3] = hi16(r.y);
        f[4] = lo16(r.z); f[5] = hi16(r.z); f[6] = lo16(r.w); f[7] = hi16(r.w);
#endif
    }
}

__device__ __forceinline__ int ring_slot(int start_slot, int t, int cap) {
    int s = start_slot + t;  // start_slot < cap and t < cap: no overflow past 2 cap
    return s >= cap ? s - cap : s;
}

// One decode iteration of a row: tokens base + u * kNS + slot (u < kU).
// load_k(u, e) / load_v(u, e) give the lane's e-th 16-byte vector of
// token u's K / V row (zeros past the end). Scores, one online-softmax
// rescale per kU tokens, and the V accumulation for all kGB heads.
// Every lane of the warp must call it (shuffles).
template <typename LK, typename LV>
__device__ __forceinline__ void decode_iter(
    int base, int t_end, int slot, int li, int nh, int h0, int len, float* __restrict__ scores,
    const float (&qr)[kGB][kEV], float (&m)[kGB], float (&l)[kGB], float (&acc)[kGB][kEV],
    LK load_k, LV load_v)
{
    // Scores of the kU tokens (the shuffles of all of them in flight together).
    float sc[kU][kGB];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        float kf[kEV];
#pragma unroll
        for (int e = 0; e < kE; ++e) unpack(load_k(u, e), &kf[e * kVec]);
#pragma unroll
        for (int gi = 0; gi < kGB; ++gi) {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < kEV; ++i) s = fmaf(qr[gi][i], kf[i], s);
            sc[u][gi] = s;
        }
    }
#pragma unroll
    for (int off = kL / 2; off > 0; off >>= 1) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
            for (int gi = 0; gi < kGB; ++gi)
                sc[u][gi] += __shfl_xor_sync(FULL_MASK, sc[u][gi], off);
        }
    }
    // Token u is in range iff base + u * kNS + slot < t_end: monotone in u,
    // so a row with no token here skips the update.
    if (base + slot >= t_end) return;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int t = base + u * kNS + slot;
        if (t >= t_end) {
#pragma unroll
            for (int gi = 0; gi < kGB; ++gi) sc[u][gi] = NEG_INF;
        } else if (scores != nullptr && li == 0) {
#pragma unroll
            for (int gi = 0; gi < kGB; ++gi)
                if (gi < nh) scores[(size_t)(h0 + gi) * len + t] = sc[u][gi];
        }
    }
    // One rescale per kU tokens: the max over the group first, then the
    // accumulators are scaled once and the weights (in sc) added.
    // NaN scores are kept out of the max but poison l and acc.
#pragma unroll
    for (int gi = 0; gi < kGB; ++gi) {
        float mx = sc[0][gi];
#pragma unroll
        for (int u = 1; u < kU; ++u) mx = fmaxf(mx, sc[u][gi]);
        const float mn = fmaxf(m[gi], mx);
        const float corr = exp2f(m[gi] - mn);
        float ps = 0.f;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            sc[u][gi] = exp2f(sc[u][gi] - mn);
            ps += sc[u][gi];
        }
        l[gi] = fmaf(l[gi], corr, ps);
#pragma unroll
        for (int i = 0; i < kEV; ++i) acc[gi][i] *= corr;
        m[gi] = mn;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        float vf[kEV];
#pragma unroll
        for (int e = 0; e < kE; ++e) unpack(load_v(u, e), &vf[e * kVec]);
#pragma unroll
        for (int gi = 0; gi < kGB; ++gi) {
#pragma unroll
            for (int i = 0; i < kEV; ++i) acc[gi][i] = fmaf(sc[u][gi], vf[i], acc[gi][i]);
        }
    }
}

// cp.async (sm_80+): a 16-byte global -> shared copy that zero-fills when
// src_bytes is 0 (rows past the end); commit / wait group the copies.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((unsigned)a), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------------------
// Split-K decode. Grid (splits, kv_heads, ceil(group / kGB)), 128 threads.
//
// Block (s, g, z) attends query heads g*group + z*kGB .. (+kGB) over the
// logical tokens [s*chunk, min(len, (s+1)*chunk)). Each warp holds kR rows
// of kL lanes; a row reads one token's K and V with 16-byte loads (kE per
// lane) and serves all kGB query heads from those registers. Rows keep an
// online softmax each; the block merges its rows in shared memory and
// writes one normalised partial (o, lse2) per head and split.
//
// With `scores` non-null, the raw log2-domain score of every token is
// stored at scores[h * len + t] (turned into weights by hgca_decode_weights).
// Dynamic shared memory: kNS * kGB * (HD + 2) floats.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(128, HGCA_MINB)
hgca_decode_split(const kv_t* __restrict__ kc, const kv_t* __restrict__ vc,
                  const float* __restrict__ q, float* __restrict__ part_o,
                  float* __restrict__ part_lse, float* __restrict__ scores,
                  int cap, int start_slot, int len, int chunk, int group,
                  int q_heads, float qscale)
{
    extern __shared__ __align__(16) float smem[];
    const int split = blockIdx.x;
    const int g = blockIdx.y;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int sub = lane / kL;
    const int li = lane % kL;
    const int slot = warp * kR + sub;
    const int hz = blockIdx.z * kGB;
    const int nh = min(kGB, group - hz);
    const int h0 = g * group + hz;

    float qr[kGB][kEV];
#pragma unroll
    for (int gi = 0; gi < kGB; ++gi) {
#pragma unroll
        for (int e = 0; e < kE; ++e) {
            const int vi = e * kL + li;
#pragma unroll
            for (int v = 0; v < kVec; ++v) {
                const bool ok = gi < nh && vi < kNv;
                qr[gi][e * kVec + v] =
                    ok ? q[(size_t)(h0 + gi) * HD + vi * kVec + v] * qscale : 0.f;
            }
        }
    }

    float m[kGB], l[kGB], acc[kGB][kEV];
#pragma unroll
    for (int gi = 0; gi < kGB; ++gi) {
        m[gi] = NEG_INF;
        l[gi] = 0.f;
#pragma unroll
        for (int i = 0; i < kEV; ++i) acc[gi][i] = 0.f;
    }

    const size_t head_off = (size_t)g * (size_t)cap * HD;
    const kv_t* __restrict__ kb = kc + head_off;
    const kv_t* __restrict__ vb = vc + head_off;
    const int t_begin = split * chunk;
    const int t_end = min(len, t_begin + chunk);

#if HGCA_ASYNC && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    // K and V of kTI tokens per iteration are copied into shared memory by
    // cp.async, kStages - 1 iterations ahead: the bytes in flight are not
    // bounded by registers, and the loads overlap the arithmetic.
    const int n_it = t_end > t_begin ? (t_end - t_begin + kTI - 1) / kTI : 0;  // block-uniform
    kv_t* const stages = reinterpret_cast<kv_t*>(smem);
    auto issue = [&](int it) {
        kv_t* dst = stages + (size_t)(it % kStages) * 2 * kTI * HD;
        const int tb = t_begin + it * kTI;
        for (int c = threadIdx.x; c < kChunks; c += blockDim.x) {
            const int r = c / kPieces;        // row of the stage: K rows, then V rows
            const int piece = c - r * kPieces;
            const bool is_v = r >= kTI;
            const int j = is_v ? r - kTI : r;
            const int t = tb + j;
            const bool ok = t < t_end;
            const kv_t* src = (is_v ? vb : kb) + (size_t)ring_slot(start_slot, ok ? t : 0, cap) * HD;
            cp_async16(dst + (size_t)r * HD + piece * kVec, src + piece * kVec, ok ? 16 : 0);
        }
    };
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < n_it) issue(st);
        cp_async_commit();
    }
    for (int it = 0; it < n_it; ++it) {
        cp_async_wait<kStages - 2>();  // this thread's copies of stage `it` landed
        __syncthreads();               // everyone's; and stage it - 1 is free again
        if (it + kStages - 1 < n_it) issue(it + kStages - 1);
        cp_async_commit();
        const kv_t* st = stages + (size_t)(it % kStages) * 2 * kTI * HD;
        const int base = t_begin + it * kTI;
        decode_iter(base, t_end, slot, li, nh, h0, len, scores, qr, m, l, acc,
            [&](int u, int e) {
                const int vi = e * kL + li;
                return vi < kNv ? *reinterpret_cast<const uint4*>(st + (size_t)(u * kNS + slot) * HD + vi * kVec)
                                : make_uint4(0u, 0u, 0u, 0u);
            },
            [&](int u, int e) {
                const int vi = e * kL + li;
                return vi < kNv ? *reinterpret_cast<const uint4*>(st + (size_t)(kTI + u * kNS + slot) * HD + vi * kVec)
                                : make_uint4(0u, 0u, 0u, 0u);
            });
    }
    cp_async_wait<0>();
    __syncthreads();  // the stages' memory is the merge scratch below
#else
    // kU tokens per row and iteration: 2 kU kE 16-byte loads in flight per
    // lane, all issued before the first is used (decode is bound by how many
    // bytes are in flight). The loop bound is block-uniform, so every lane
    // reaches the shuffles.
    for (int base = t_begin; base < t_end; base += kU * kNS) {
        uint4 kr[kU][kE], vr[kU][kE];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int t = base + u * kNS + slot;
            const bool ok = t < t_end;
            const size_t row = (size_t)ring_slot(start_slot, ok ? t : 0, cap) * HD;
#pragma unroll
            for (int e = 0; e < kE; ++e) {
                const int vi = e * kL + li;
                if (ok && vi < kNv) {
                    kr[u][e] = load_vec(kb + row + vi * kVec);
                    vr[u][e] = load_vec(vb + row + vi * kVec);
                } else {
                    kr[u][e] = make_uint4(0u, 0u, 0u, 0u);
                    vr[u][e] = make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }
        decode_iter(base, t_end, slot, li, nh, h0, len, scores, qr, m, l, acc,
                    [&](int u, int e) { return kr[u][e]; },
                    [&](int u, int e) { return vr[u][e]; });
    }
#endif

    // Merge the block's kNS rows.
    float* sm_m = smem;                 // [kNS][kGB]
    float* sm_l = sm_m + kNS * kGB;     // [kNS][kGB]
    float* sm_a = sm_l + kNS * kGB;     // [kNS][kGB][HD]
    if (li == 0) {
#pragma unroll
        for (int gi = 0; gi < kGB; ++gi) {
            sm_m[slot * kGB + gi] = m[gi];
            sm_l[slot * kGB + gi] = l[gi];
        }
    }
    __syncthreads();
#pragma unroll
    for (int gi = 0; gi < kGB; ++gi) {
        float bm = NEG_INF;
        for (int s = 0; s < kNS; ++s) bm = fmaxf(bm, sm_m[s * kGB + gi]);
        const float f = m[gi] == NEG_INF ? 0.f : exp2f(m[gi] - bm);
#pragma unroll
        for (int e = 0; e < kE; ++e) {
            const int vi = e * kL + li;
            if (vi < kNv) {
#pragma unroll
                for (int v = 0; v < kVec; ++v)
                    sm_a[(slot * kGB + gi) * HD + vi * kVec + v] = acc[gi][e * kVec + v] * f;
            }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nh * HD; idx += blockDim.x) {
        const int gi = idx / HD;
        const int c = idx - gi * HD;
        float bm = NEG_INF;
        for (int s = 0; s < kNS; ++s) bm = fmaxf(bm, sm_m[s * kGB + gi]);
        float ls = 0.f, o = 0.f;
        for (int s = 0; s < kNS; ++s) {
            const float ms = sm_m[s * kGB + gi];
            const float f = ms == NEG_INF ? 0.f : exp2f(ms - bm);
            ls = fmaf(sm_l[s * kGB + gi], f, ls);  // a NaN l poisons ls even with f = 0
            o += sm_a[(s * kGB + gi) * HD + c];
        }
        float lse2;
        if (ls != ls) {
            o = __int_as_float(0x7fc00000);
            lse2 = o;
        } else if (bm == NEG_INF) {
            o = 0.f;
            lse2 = NEG_INF;
        } else {
            o = o / ls;
            lse2 = bm + log2f(ls);
        }
        const size_t row = (size_t)split * q_heads + h0 + gi;
        part_o[row * HD + c] = o;
        if (c == 0) part_lse[row] = lse2;
    }
}

// ---------------------------------------------------------------------------
// Combine of the split partials. Grid (q_heads), 128 threads.
// Writes out [q_heads, HD], lse [q_heads] (natural log) and lse2 (log2).
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(128)
hgca_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                    float* __restrict__ out, float* __restrict__ lse_out,
                    float* __restrict__ lse2_out, int splits, int q_heads)
{
    // 128 threads = 4 warps: max, NaN flag and weight sum of the splits are
    // reduced across the block (fixed order: the same result every run).
    __shared__ float red_m[4], red_w[4];
    __shared__ int red_nan[4];
    const int h = blockIdx.x;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    float bm = NEG_INF;
    bool nan = false;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        const float x = part_lse[(size_t)s * q_heads + h];
        nan |= x != x;
        bm = fmaxf(bm, x);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) bm = fmaxf(bm, __shfl_xor_sync(FULL_MASK, bm, off));
    nan = __any_sync(FULL_MASK, nan);
    if (lane == 0) {
        red_m[warp] = bm;
        red_nan[warp] = nan ? 1 : 0;
    }
    __syncthreads();
    bm = fmaxf(fmaxf(red_m[0], red_m[1]), fmaxf(red_m[2], red_m[3]));
    nan = (red_nan[0] | red_nan[1] | red_nan[2] | red_nan[3]) != 0;
    float w = 0.f;
    if (!nan && bm != NEG_INF) {
        for (int s = threadIdx.x; s < splits; s += blockDim.x) {
            const float x = part_lse[(size_t)s * q_heads + h];
            w += x == NEG_INF ? 0.f : exp2f(x - bm);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) w += __shfl_xor_sync(FULL_MASK, w, off);
    }
    if (lane == 0) red_w[warp] = w;
    __syncthreads();
    w = (red_w[0] + red_w[1]) + (red_w[2] + red_w[3]);
    for (int c = threadIdx.x; c < HD; c += blockDim.x) {
        float o;
        if (nan) {
            o = __int_as_float(0x7fc00000);
        } else if (bm == NEG_INF) {
            o = 0.f;
        } else {
            o = 0.f;
            // Independent loads across splits: several in flight per thread.
#pragma unroll 8
            for (int s = 0; s < splits; ++s) {
                const float x = part_lse[(size_t)s * q_heads + h];
                const float ws = x == NEG_INF ? 0.f : exp2f(x - bm);
                o = fmaf(ws, part_o[((size_t)s * q_heads + h) * HD + c], o);
            }
            o = o / w;
        }
        out[(size_t)h * HD + c] = o;
    }
    if (threadIdx.x == 0) {
        const float l2 = nan ? __int_as_float(0x7fc00000)
                             : (bm == NEG_INF ? NEG_INF : bm + log2f(w));
        lse2_out[h] = l2;
        lse_out[h] = l2 * LN2_F;
    }
}

// ---------------------------------------------------------------------------
// Weights of the window tokens: w[h, t] = exp2(score2[h, t] - lse2[h]), in place.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
hgca_decode_weights(float* __restrict__ scores, const float* __restrict__ lse2,
                    int len, int q_heads)
{
    const size_t total = (size_t)len * q_heads;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int h = (int)(i / (size_t)len);
        scores[i] = exp2f(scores[i] - lse2[h]);
    }
}

// ---------------------------------------------------------------------------
// Causal append attention. Grid (ceil(n_q * group / 16), kv_heads), 128 threads.
//
// A block owns 16 query rows (row = token * group + head-in-group) of one KV
// head, 4 per warp. K and V tiles of 32 tokens are staged in shared memory
// as f32 (pitch HD + 1: conflict-free); lane j scores token j of the tile
// against the warp's 4 rows, the warp runs one online softmax per row, and
// lane c accumulates output dims c, c + 32, ...
// Query i sees logical tokens t < vis(i) = clamp(rel + i + 1, 0, len), with
// rel = p0 - start_pos. Dynamic shared memory: (16 * HD + 32 * (HD + 1)) floats.
// ---------------------------------------------------------------------------
constexpr int kAppRows = 16;
constexpr int kAppRW = 4;
constexpr int kBK = 32;
constexpr int kDL = (HD + 31) / 32;
constexpr int kPitch = HD + 1;

__device__ __forceinline__ int visible(long long rel, int qi, int len) {
    const long long v = rel + (long long)qi + 1;
    return v <= 0 ? 0 : (v >= (long long)len ? len : (int)v);
}

extern "C" __global__ void __launch_bounds__(128)
hgca_append(const kv_t* __restrict__ kc, const kv_t* __restrict__ vc,
            const float* __restrict__ q, float* __restrict__ out,
            float* __restrict__ lse_out, int cap, int start_slot, int len,
            long long rel, int n_q, int group, int q_heads, float qscale)
{
    extern __shared__ __align__(16) float smem[];
    float* sq = smem;                        // [16][HD]
    float* skv = sq + kAppRows * HD;         // [32][kPitch]
    const int g = blockIdx.y;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int rows = n_q * group;
    const int row0 = blockIdx.x * kAppRows;

    for (int idx = threadIdx.x; idx < kAppRows * HD; idx += blockDim.x) {
        const int r = idx / HD;
        const int c = idx - r * HD;
        const int row = row0 + r;
        float x = 0.f;
        if (row < rows) {
            const int qt = row / group;
            const int hi = row - qt * group;
            x = q[((size_t)qt * q_heads + (size_t)g * group + hi) * HD + c] * qscale;
        }
        sq[idx] = x;
    }

    int vis[kAppRW];
#pragma unroll
    for (int i = 0; i < kAppRW; ++i) {
        const int row = row0 + warp * kAppRW + i;
        vis[i] = row < rows ? visible(rel, row / group, len) : 0;
    }
    const int last_row = min(rows, row0 + kAppRows) - 1;
    const int n_tiles = (visible(rel, last_row / group, len) + kBK - 1) / kBK;

    float m[kAppRW], l[kAppRW], acc[kAppRW][kDL];
#pragma unroll
    for (int i = 0; i < kAppRW; ++i) {
        m[i] = NEG_INF;
        l[i] = 0.f;
#pragma unroll
        for (int k = 0; k < kDL; ++k) acc[i][k] = 0.f;
    }

    const size_t head_off = (size_t)g * (size_t)cap * HD;
    const kv_t* __restrict__ kb = kc + head_off;
    const kv_t* __restrict__ vb = vc + head_off;

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int t0 = tile * kBK;
        __syncthreads();  // queries staged / previous V tile consumed
        for (int idx = threadIdx.x; idx < kBK * HD; idx += blockDim.x) {
            const int j = idx / HD;
            const int c = idx - j * HD;
            const int t = t0 + j;
            skv[j * kPitch + c] =
                t < len ? to_f32(kb[(size_t)ring_slot(start_slot, t, cap) * HD + c]) : 0.f;
        }
        __syncthreads();
        float s[kAppRW];
#pragma unroll
        for (int i = 0; i < kAppRW; ++i) s[i] = 0.f;
        const float* krow = skv + lane * kPitch;
        const float* qbase = sq + warp * kAppRW * HD;
        for (int c = 0; c < HD; ++c) {
            const float kv = krow[c];
#pragma unroll
            for (int i = 0; i < kAppRW; ++i) s[i] = fmaf(qbase[i * HD + c], kv, s[i]);
        }
        float p[kAppRW];
        const int t = t0 + lane;
#pragma unroll
        for (int i = 0; i < kAppRW; ++i) {
            const bool ok = t < vis[i];
            const float si = ok ? s[i] : NEG_INF;
            float mt = si;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, off));
            p[i] = 0.f;
            if (mt == NEG_INF) continue;  // warp-uniform: the row sees no token here
            const float mn = fmaxf(m[i], mt);
            const float corr = exp2f(m[i] - mn);
            const float pi = ok ? exp2f(si - mn) : 0.f;
            float ps = pi;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) ps += __shfl_xor_sync(FULL_MASK, ps, off);
            l[i] = fmaf(l[i], corr, ps);
#pragma unroll
            for (int k = 0; k < kDL; ++k) acc[i][k] *= corr;
            m[i] = mn;
            p[i] = pi;
        }
        __syncthreads();  // K tile consumed
        for (int idx = threadIdx.x; idx < kBK * HD; idx += blockDim.x) {
            const int j = idx / HD;
            const int c = idx - j * HD;
            const int tt = t0 + j;
            skv[j * kPitch + c] =
                tt < len ? to_f32(vb[(size_t)ring_slot(start_slot, tt, cap) * HD + c]) : 0.f;
        }
        __syncthreads();
        for (int j = 0; j < kBK; ++j) {
            const float* vrow = skv + j * kPitch;
#pragma unroll
            for (int i = 0; i < kAppRW; ++i) {
                const float pj = __shfl_sync(FULL_MASK, p[i], j);
#pragma unroll
                for (int k = 0; k < kDL; ++k) {
                    const int c = lane + 32 * k;
                    if (c < HD) acc[i][k] = fmaf(pj, vrow[c], acc[i][k]);
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < kAppRW; ++i) {
        const int row = row0 + warp * kAppRW + i;
        if (row >= rows) continue;
        const int qt = row / group;
        const int hi = row - qt * group;
        const size_t orow = (size_t)qt * q_heads + (size_t)g * group + hi;
        const bool empty = m[i] == NEG_INF && l[i] == 0.f;
#pragma unroll
        for (int k = 0; k < kDL; ++k) {
            const int c = lane + 32 * k;
            if (c < HD) out[orow * HD + c] = empty ? 0.f : acc[i][k] / l[i];
        }
        if (lane == 0) lse_out[orow] = empty ? NEG_INF : (m[i] + log2f(l[i])) * LN2_F;
    }
}

// ---------------------------------------------------------------------------
// Ring write: token-major staging [n, kv_heads, HD] into slots
// write_slot, write_slot + 1, ... (mod cap) of the head-major window.
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
hgca_ring_write(kv_t* __restrict__ kc, kv_t* __restrict__ vc,
                const kv_t* __restrict__ ks, const kv_t* __restrict__ vs,
                int cap, int write_slot, int n, int kv_heads)
{
    const size_t total = (size_t)n * kv_heads * HD;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t c = i % HD;
        const size_t h = (i / HD) % (size_t)kv_heads;
        const int t = (int)(i / ((size_t)HD * kv_heads));
        const size_t dst = (h * (size_t)cap + (size_t)ring_slot(write_slot, t, cap)) * HD + c;
        kc[dst] = ks[i];
        vc[dst] = vs[i];
    }
}

// ---------------------------------------------------------------------------
// Eviction gather: the n oldest tokens, head-major [kv_heads, n, HD].
// ---------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
hgca_evict_gather(const kv_t* __restrict__ kc, const kv_t* __restrict__ vc,
                  kv_t* __restrict__ ko, kv_t* __restrict__ vo,
                  int cap, int start_slot, int n, int kv_heads)
{
    const size_t total = (size_t)n * kv_heads * HD;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t c = i % HD;
        const int t = (int)((i / HD) % (size_t)n);
        const size_t h = i / ((size_t)HD * n);
        const size_t src = (h * (size_t)cap + (size_t)ring_slot(start_slot, t, cap)) * HD + c;
        ko[i] = kc[src];
        vo[i] = vc[src];
    }
}
