// hgca CUDA kernel: the exact LSE merge of partials (natural-log lse),
// with the special values of hgca_kernels::merge:
//   +inf lse is read as empty (FlashAttention-2), like -inf;
//   a NaN lse makes the whole row NaN; a NaN output element shows through
//   even when its part's weight is 0;
//   all parts empty gives (0, -inf); finite input never gives NaN.
// Compiled by NVRTC; needs no header.

#define NEG_INF (__int_as_float(0xff800000))
#define POS_INF (__int_as_float(0x7f800000))
#define QNAN (__int_as_float(0x7fc00000))

__device__ __forceinline__ float canon(float x) { return x == POS_INF ? NEG_INF : x; }

// o += ci * y, except that a zero weight lets a NaN element of y show
// through (NaN propagates even from a part that weighs nothing).
__device__ __forceinline__ void accumulate4(float4& o, float ci, const float4 y) {
    if (ci == 0.f) {
        if (y.x != y.x) o.x = QNAN;
        if (y.y != y.y) o.y = QNAN;
        if (y.z != y.z) o.z = QNAN;
        if (y.w != y.w) o.w = QNAN;
    } else {
        o.x = fmaf(ci, y.x, o.x);
        o.y = fmaf(ci, y.y, o.y);
        o.z = fmaf(ci, y.z, o.z);
        o.w = fmaf(ci, y.w, o.w);
    }
}

constexpr int kMP = 4;  // parts held in registers on the fast path
constexpr int kMC = 2;  // float4 columns per lane on the fast path (d <= 256)

// The fast path (d % 4 == 0, d <= 256, n_parts <= 4): every load of the row
// (the parts' lse and outputs) is issued before any is used, so a warp has
// up to 8 16-byte loads in flight per lane instead of one round trip per
// part. Same special values as the general path below.
__device__ __forceinline__ void merge_row_regs(
    const float* __restrict__ parts_o, const float* __restrict__ parts_lse,
    float* __restrict__ out, float* __restrict__ lse, int n_parts, int rows, int d,
    int row, int lane)
{
    const size_t rstride = (size_t)rows * d;
    const int d4 = d >> 2;
    float lp[kMP];
    float4 y[kMP][kMC];
#pragma unroll
    for (int i = 0; i < kMP; ++i) {
        lp[i] = i < n_parts ? canon(parts_lse[(size_t)i * rows + row]) : NEG_INF;
        const float4* prow = reinterpret_cast<const float4*>(parts_o + i * rstride + (size_t)row * d);
#pragma unroll
        for (int j = 0; j < kMC; ++j) {
            const int c = lane + 32 * j;
            y[i][j] = (i < n_parts && c < d4) ? prow[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    float m = NEG_INF;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < kMP; ++i) {
        nan |= lp[i] != lp[i];
        m = fmaxf(m, lp[i]);
    }
    float4* o4 = reinterpret_cast<float4*>(out + (size_t)row * d);
    if (nan) {
#pragma unroll
        for (int j = 0; j < kMC; ++j) {
            const int c = lane + 32 * j;
            if (c < d4) o4[c] = make_float4(QNAN, QNAN, QNAN, QNAN);
        }
        if (lane == 0) lse[row] = QNAN;
        return;
    }
    // Weights: the largest part's is exp(0) = 1 exactly (the first such part),
    // the rest sum into `rest`; all-empty rows keep weight 0 everywhere.
    float w[kMP];
    float rest = 0.f;
    bool seen = false;
#pragma unroll
    for (int i = 0; i < kMP; ++i) {
        if (m != NEG_INF && lp[i] == m && !seen) {
            w[i] = 1.f;
            seen = true;
        } else {
            w[i] = lp[i] == NEG_INF ? 0.f : expf(lp[i] - m);
            rest += w[i];
        }
    }
    const float total = 1.f + rest;
#pragma unroll
    for (int j = 0; j < kMC; ++j) {
        const int c = lane + 32 * j;
        if (c >= d4) continue;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < kMP; ++i) {
            if (i >= n_parts) break;
            accumulate4(o, m == NEG_INF ? 0.f : w[i] / total, y[i][j]);
        }
        o4[c] = o;
    }
    if (lane == 0) lse[row] = m == NEG_INF ? NEG_INF : m + log1pf(rest);
}

// One warp per row (row = token * q_heads + head); 8 rows per 256-thread block.
// parts_o [n_parts, rows, d], parts_lse [n_parts, rows]; out [rows, d], lse [rows].
extern "C" __global__ void __launch_bounds__(256)
hgca_merge(const float* __restrict__ parts_o, const float* __restrict__ parts_lse,
           float* __restrict__ out, float* __restrict__ lse, int n_parts, int rows, int d)
{
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;  // whole warps leave together; no shuffles below
    if ((d & 3) == 0 && d <= 32 * 4 * kMC && n_parts <= kMP) {
        merge_row_regs(parts_o, parts_lse, out, lse, n_parts, rows, d, row, lane);
        return;
    }
    const size_t rstride = (size_t)rows * d;
    float m = NEG_INF;
    int arg = -1;
    bool nan = false;
    for (int i = 0; i < n_parts; ++i) {
        const float x = canon(parts_lse[(size_t)i * rows + row]);
        nan |= x != x;
        if (x > m) { m = x; arg = i; }
    }
    float* orow = out + (size_t)row * d;
    const float* prow = parts_o + (size_t)row * d;
    if (nan) {
        for (int c = lane; c < d; c += 32) orow[c] = QNAN;
        if (lane == 0) lse[row] = QNAN;
        return;
    }
    if (m == NEG_INF) {
        for (int c = lane; c < d; c += 32) {
            float o = 0.f;
            for (int i = 0; i < n_parts; ++i) {
                const float y = prow[i * rstride + c];
                if (y != y) o = QNAN;
            }
            orow[c] = o;
        }
        if (lane == 0) lse[row] = NEG_INF;
        return;
    }
    float rest = 0.f;
    for (int i = 0; i < n_parts; ++i)
        if (i != arg) rest += expf(canon(parts_lse[(size_t)i * rows + row]) - m);
    const float total = 1.f + rest;
    if ((d & 3) == 0) {
        // 16-byte path: rows start at multiples of d floats, so d % 4 == 0 keeps them aligned.
        const int d4 = d >> 2;
        float4* o4 = reinterpret_cast<float4*>(orow);
        for (int c = lane; c < d4; c += 32) {
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int i = 0; i < n_parts; ++i) {
                const float ci = expf(canon(parts_lse[(size_t)i * rows + row]) - m) / total;
                accumulate4(o, ci, reinterpret_cast<const float4*>(prow + i * rstride)[c]);
            }
            o4[c] = o;
        }
    } else {
        for (int c = lane; c < d; c += 32) {
            float o = 0.f;
            for (int i = 0; i < n_parts; ++i) {
                const float ci = expf(canon(parts_lse[(size_t)i * rows + row]) - m) / total;
                const float y = prow[i * rstride + c];
                if (ci == 0.f) {
                    if (y != y) o = QNAN;
                } else {
                    o = fmaf(ci, y, o);
                }
            }
            orow[c] = o;
        }
    }
    if (lane == 0) lse[row] = m + log1pf(rest);
}

// Device-to-device copy used as the bandwidth yardstick of the benchmarks.
extern "C" __global__ void __launch_bounds__(256)
hgca_copy(const float4* __restrict__ src, float4* __restrict__ dst, size_t n4)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
