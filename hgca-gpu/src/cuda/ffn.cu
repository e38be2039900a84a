// hgca CUDA kernels: the dense side of a hybrid FFN (the hot neurons,
// every one computed), weights f16, neuron-major `[n_ff, d]` each (gate,
// up, and down transposed), rows padded to an even length and read as
// 32-bit pairs, low half first. A decode step's few tokens take one pass
// per token; a prompt chunk's tokens go in tiles of FFN_TT, so that a
// weight word read once serves every token of the tile:
//   hgca_ffn_gate_up: h[t, i] = act(gate_i . x_t) * (up_i . x_t), one warp
//     per (token, neuron), a lane's strided dot products and a shuffle
//     reduction; act 0 = SiLU, 1 = ReLU;
//   hgca_ffn_gate_up_tiled: the same sums in the same order, a warp per
//     (neuron, tile), FFN_WARPS neurons a block sharing the tile's tokens
//     staged in shared memory FFN_KC words at a time; grid (ceil(n_ff /
//     FFN_WARPS), tiles);
//   hgca_ffn_down: part[s, t, r] = sum_i h[t, i] down_t[i, r] over split
//     s's `chunk` neurons, one thread per (pair of output columns, token,
//     split), neurons in order (consecutive threads read consecutive
//     words); grid (ceil(rw / 128), tokens, splits): splits give a decode
//     step's few columns enough blocks to fill the device;
//   hgca_ffn_down_tiled: the same per tile of tokens, the tile's
//     activations staged FFN_HC neurons at a time; grid (ceil(rw / 128),
//     tiles, splits);
//   hgca_ffn_down_sum: out = sum over the splits, in split order (with one
//     split the down pass writes out itself).
// Sums run in fixed orders, no atomics: a call gives the same bits on every
// run. No CUDA header is needed: f16 is widened with cvt.

#define FFN_TT 8
#define FFN_WARPS 8
#define FFN_KC 128
#define FFN_HC 128

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

extern "C" __global__ void __launch_bounds__(128)
hgca_ffn_gate_up(
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

extern "C" __global__ void __launch_bounds__(128)
hgca_ffn_down(
    const unsigned int* __restrict__ down, const float* __restrict__ h, float* __restrict__ part,
    int n, int n_ff, int d, int rw, int chunk) {
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    const int s = blockIdx.z;
    if (w >= rw || t >= n) return;
    const float* ht = h + (size_t)t * n_ff;
    const int i0 = s * chunk;
    const int i1 = min(n_ff, i0 + chunk);
    float a0 = 0.f, a1 = 0.f;
    for (int i = i0; i < i1; ++i) {
        const float hv = ht[i];
        const unsigned int dw = __ldg(down + (size_t)i * rw + w);
        a0 = fmaf(hv, ffn_f16(dw & 0xffffu), a0);
        a1 = fmaf(hv, ffn_f16(dw >> 16), a1);
    }
    float* o = part + ((size_t)s * n + t) * d + 2 * w;
    o[0] = a0;
    if (2 * w + 1 < d) o[1] = a1;
}

extern "C" __global__ void __launch_bounds__(256)
hgca_ffn_gate_up_tiled(
    const unsigned int* __restrict__ gate, const unsigned int* __restrict__ up,
    const float* __restrict__ x, float* __restrict__ h, int n, int n_ff, int d, int rw, int act) {
    __shared__ float2 xs[FFN_TT][FFN_KC];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.x * FFN_WARPS + warp;
    const int t0 = blockIdx.y * FFN_TT;
    const int nt = min(FFN_TT, n - t0);
    const bool live = i < n_ff;
    const unsigned int* gr = gate + (size_t)(live ? i : 0) * rw;
    const unsigned int* ur = up + (size_t)(live ? i : 0) * rw;
    float g[FFN_TT], u[FFN_TT];
#pragma unroll
    for (int j = 0; j < FFN_TT; ++j) {
        g[j] = 0.f;
        u[j] = 0.f;
    }
    for (int k0 = 0; k0 < rw; k0 += FFN_KC) {
        const int kw = min(FFN_KC, rw - k0);
        __syncthreads();
        for (int e = threadIdx.x; e < FFN_TT * FFN_KC; e += blockDim.x) {
            const int j = e / FFN_KC, w = e % FFN_KC;
            float2 v = make_float2(0.f, 0.f);
            if (j < nt && w < kw) {
                const float* xt = x + (size_t)(t0 + j) * d;
                const int k = 2 * (k0 + w);
                v.x = xt[k];
                if (k + 1 < d) v.y = xt[k + 1];
            }
            xs[j][w] = v;
        }
        __syncthreads();
        if (!live) continue;
        for (int w = lane; w < kw; w += 32) {
            const unsigned int gw = __ldg(gr + k0 + w), uw = __ldg(ur + k0 + w);
            const float g0 = ffn_f16(gw & 0xffffu), g1 = ffn_f16(gw >> 16);
            const float u0 = ffn_f16(uw & 0xffffu), u1 = ffn_f16(uw >> 16);
#pragma unroll
            for (int j = 0; j < FFN_TT; ++j) {
                if (j < nt) {
                    const float2 v = xs[j][w];
                    g[j] = fmaf(g1, v.y, fmaf(g0, v.x, g[j]));
                    u[j] = fmaf(u1, v.y, fmaf(u0, v.x, u[j]));
                }
            }
        }
    }
    if (!live) return;
#pragma unroll
    for (int j = 0; j < FFN_TT; ++j) {
        if (j < nt) {
            for (int s = 16; s > 0; s >>= 1) {
                g[j] += __shfl_xor_sync(0xffffffffu, g[j], s);
                u[j] += __shfl_xor_sync(0xffffffffu, u[j], s);
            }
            if (lane == 0) h[(size_t)(t0 + j) * n_ff + i] = ffn_act(g[j], act) * u[j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
hgca_ffn_down_tiled(
    const unsigned int* __restrict__ down, const float* __restrict__ h, float* __restrict__ part,
    int n, int n_ff, int d, int rw, int chunk) {
    __shared__ float hs[FFN_HC][FFN_TT];
    const int w = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.y * FFN_TT;
    const int s = blockIdx.z;
    const int nt = min(FFN_TT, n - t0);
    const int i0 = s * chunk;
    const int i1 = min(n_ff, i0 + chunk);
    float a0[FFN_TT], a1[FFN_TT];
#pragma unroll
    for (int j = 0; j < FFN_TT; ++j) {
        a0[j] = 0.f;
        a1[j] = 0.f;
    }
    for (int c0 = i0; c0 < i1; c0 += FFN_HC) {
        const int cn = min(FFN_HC, i1 - c0);
        __syncthreads();
        for (int e = threadIdx.x; e < FFN_TT * FFN_HC; e += blockDim.x) {
            const int j = e / FFN_HC, c = e % FFN_HC;
            hs[c][j] = j < nt && c < cn ? h[(size_t)(t0 + j) * n_ff + c0 + c] : 0.f;
        }
        __syncthreads();
        if (w >= rw) continue;
        for (int c = 0; c < cn; ++c) {
            const unsigned int dw = __ldg(down + (size_t)(c0 + c) * rw + w);
            const float f0 = ffn_f16(dw & 0xffffu), f1 = ffn_f16(dw >> 16);
#pragma unroll
            for (int j = 0; j < FFN_TT; ++j) {
                if (j < nt) {
                    const float hv = hs[c][j];
                    a0[j] = fmaf(hv, f0, a0[j]);
                    a1[j] = fmaf(hv, f1, a1[j]);
                }
            }
        }
    }
    if (w >= rw) return;
#pragma unroll
    for (int j = 0; j < FFN_TT; ++j) {
        if (j < nt) {
            float* o = part + ((size_t)s * n + t0 + j) * d + 2 * w;
            o[0] = a0[j];
            if (2 * w + 1 < d) o[1] = a1[j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
hgca_ffn_down_sum(
    const float* __restrict__ part, float* __restrict__ out, int splits, long long len) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < len;
         e += (long long)gridDim.x * blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < splits; ++s) a += part[(size_t)s * len + e];
        out[e] = a;
    }
}
