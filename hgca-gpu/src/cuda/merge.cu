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

// One warp per row (row = token * q_heads + head); 8 rows per 256-thread block.
// parts_o [n_parts, rows, d], parts_lse [n_parts, rows]; out [rows, d], lse [rows].
extern "C" __global__ void __launch_bounds__(256)
hgca_merge(const float* __restrict__ parts_o, const float* __restrict__ parts_lse,
           float* __restrict__ out, float* __restrict__ lse, int n_parts, int rows, int d)
{
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;  // whole warps leave together; no shuffles below
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
                const float4 y = reinterpret_cast<const float4*>(prow + i * rstride)[c];
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
