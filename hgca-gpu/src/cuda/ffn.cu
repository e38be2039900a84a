// hgca CUDA kernels: the dense side of a hybrid FFN (the hot neurons,
// every one computed), weights f16, neuron-major `[n_ff, d]` each (gate,
// up, and down transposed), rows padded to an even length and read as
// 32-bit pairs, low half first. Two passes:
//   hgca_ffn_gate_up: h[t, i] = act(gate_i . x_t) * (up_i . x_t), one warp
//     per (token, neuron) pair, a strided dot product and a shuffle
//     reduction; act 0 = SiLU, 1 = ReLU;
//   hgca_ffn_down: out[t, r] = sum_i h[t, i] down_t[i, r], one thread per
//     token and pair of output columns, neurons in order (consecutive
//     threads read consecutive words).
// No CUDA header is needed: f16 is widened with cvt.

__device__ __forceinline__ float ffn_f16(unsigned int h) {
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

__device__ __forceinline__ float ffn_act(float g, int act) {
    if (act == 1) return fmaxf(g, 0.f);
    if (g < -80.f) return 0.f;
    return g / (1.f + __expf(-g));
}

extern "C" __global__ void __launch_bounds__(128) hgca_ffn_gate_up(
    const unsigned int* __restrict__ gate, const unsigned int* __restrict__ up,
    const float* __restrict__ x, float* __restrict__ h, int n, int n_ff, int d, int rw, int act) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= n * n_ff) return;
    const int t = warp / n_ff, i = warp % n_ff;
    const float* xt = x + (size_t)t * d;
    const unsigned int* gr = gate + (size_t)i * rw;
    const unsigned int* ur = up + (size_t)i * rw;
    float g = 0.f, u = 0.f;
    for (int w = lane; w < rw; w += 32) {
        const unsigned int gw = __ldg(gr + w), uw = __ldg(ur + w);
        const int k = 2 * w;
        const float x0 = xt[k];
        const float x1 = k + 1 < d ? xt[k + 1] : 0.f;
        g = fmaf(ffn_f16(gw >> 16), x1, fmaf(ffn_f16(gw & 0xffffu), x0, g));
        u = fmaf(ffn_f16(uw >> 16), x1, fmaf(ffn_f16(uw & 0xffffu), x0, u));
    }
    for (int s = 16; s > 0; s >>= 1) {
        g += __shfl_xor_sync(0xffffffffu, g, s);
        u += __shfl_xor_sync(0xffffffffu, u, s);
    }
    if (lane == 0) h[(size_t)t * n_ff + i] = ffn_act(g, act) * u;
}

extern "C" __global__ void __launch_bounds__(128) hgca_ffn_down(
    const unsigned int* __restrict__ down, const float* __restrict__ h, float* __restrict__ out,
    int n, int n_ff, int d, int rw) {
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (w >= rw || t >= n) return;
    const float* ht = h + (size_t)t * n_ff;
    float a0 = 0.f, a1 = 0.f;
    for (int i = 0; i < n_ff; ++i) {
        const float hv = ht[i];
        const unsigned int dw = __ldg(down + (size_t)i * rw + w);
        a0 = fmaf(hv, ffn_f16(dw & 0xffffu), a0);
        a1 = fmaf(hv, ffn_f16(dw >> 16), a1);
    }
    float* o = out + (size_t)t * d + 2 * w;
    o[0] = a0;
    if (2 * w + 1 < d) o[1] = a1;
}
