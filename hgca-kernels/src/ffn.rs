//! The sparse FFN contract (PowerInfer's split): a gated FFN
//! `y = Σ_{i ∈ A} act(g_i) u_i d_i` over an active neuron set `A`, where
//! `g_i = W_gate[i]·x`, `u_i = W_up[i]·x` and `d_i` is row `i` of
//! `W_downᵀ` (neuron `i`'s output column). With `A` every neuron it is the
//! dense FFN; for any partition of the neurons (hot on the dense side, cold
//! on the CPU) the partial outputs sum to it.
//!
//! Weights are **neuron-major**: three `[n_ff, d_model]` matrices (`W_down`
//! transposed once at load), so that an active neuron reads three
//! contiguous rows. A row is stored as floats (`f32`, `f16`, `bf16`) or in
//! GGUF's block formats ([`BlockQ8_0`], [`BlockQ4_0`], [`BlockQ4_1`],
//! [`BlockQ5_0`]: 32 values per block; [`BlockQ4K`], [`BlockQ6K`]: 256),
//! dequantised on the fly.

use crate::{Error, Result, bf16, check_len_of, f16};
use std::borrow::Cow;

/// The gate's activation: `y` sums `act(g_i) * u_i` over the neurons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnAct {
    /// `silu(g) = g / (1 + exp(-g))` (SwiGLU: Llama, Qwen2, SmolLM2).
    Silu,
    /// `max(g, 0)` (ReGLU; ReLU-fied models, where sparsity is native).
    Relu,
}

impl FfnAct {
    /// The activation of `g`, in f32 (the kernels' form).
    ///
    /// ```
    /// use hgca_kernels::FfnAct;
    /// assert_eq!(FfnAct::Silu.apply(0.0), 0.0);
    /// assert_eq!(FfnAct::Relu.apply(-2.0), 0.0);
    /// ```
    #[inline(always)]
    pub fn apply(self, g: f32) -> f32 {
        match self {
            FfnAct::Silu => g / (1.0 + (-g).exp()),
            FfnAct::Relu => g.max(0.0),
        }
    }

    /// The activation of `g`, in f64 (the reference's form).
    pub fn apply_f64(self, g: f64) -> f64 {
        match self {
            FfnAct::Silu => g / (1.0 + (-g).exp()),
            FfnAct::Relu => g.max(0.0),
        }
    }
}

/// Which neurons a sparse FFN call computes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Neurons<'a> {
    /// These neurons (each `< n_ff`, distinct), for every token.
    List(&'a [u32]),
    /// Every neuron (the dense FFN; the dense side of a hybrid split).
    All,
    /// Per token, the neurons whose activation passes `|act(g_i)| > t`
    /// (CATS: the gate rows are read for every neuron, the up and down rows
    /// only for those that pass). `t` must be finite and `>= 0`.
    Threshold(f32),
}

/// A weight row format: how many values an element of a row holds, and
/// how it dequantises (the scalar form; the CPU kernels have their own).
pub trait WeightElem: bytemuck::Pod + Send + Sync + std::fmt::Debug + 'static {
    /// Values per element (1 for floats, 32 for GGUF blocks).
    const VALUES: usize;
    /// A short name (`f32`, `q8_0`, ...).
    const NAME: &'static str;
    /// Writes the `VALUES` values of `self` into `out`.
    fn dequant(&self, out: &mut [f32]);
    /// Writes the values of `src` into `out` (`src.len() * VALUES` of
    /// them): [`WeightElem::dequant`] element by element unless a format
    /// has a faster form (the half floats convert a slice at a time).
    #[inline(always)]
    fn dequant_slice(src: &[Self], out: &mut [f32]) {
        for (e, o) in src.iter().zip(out.chunks_exact_mut(Self::VALUES)) {
            e.dequant(o);
        }
    }
}

impl WeightElem for f32 {
    const VALUES: usize = 1;
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn dequant(&self, out: &mut [f32]) {
        out[0] = *self;
    }
}

impl WeightElem for f16 {
    const VALUES: usize = 1;
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn dequant_slice(src: &[Self], out: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(&mut out[..src.len()]);
    }
    #[inline(always)]
    fn dequant(&self, out: &mut [f32]) {
        out[0] = self.to_f32();
    }
}

impl WeightElem for bf16 {
    const VALUES: usize = 1;
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn dequant_slice(src: &[Self], out: &mut [f32]) {
        // bf16 is the high half of an f32: a shift, which vectorises.
        for (o, v) in out.iter_mut().zip(src) {
            *o = f32::from_bits(u32::from(v.to_bits()) << 16);
        }
    }
    #[inline(always)]
    fn dequant(&self, out: &mut [f32]) {
        out[0] = self.to_f32();
    }
}

/// GGUF's `Q8_0` block: 32 values `d * qs[i]`.
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// The scale.
    pub d: f16,
    /// The codes.
    pub qs: [i8; 32],
}

/// GGUF's `Q4_0` block: 32 values `d * (q_i - 8)`, `q_i` the low nibbles
/// of `qs` for values 0..16 and the high nibbles for 16..32.
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// The scale.
    pub d: f16,
    /// The codes, two per byte.
    pub qs: [u8; 16],
}

impl WeightElem for BlockQ8_0 {
    const VALUES: usize = 32;
    const NAME: &'static str = "q8_0";
    #[inline(always)]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * f32::from(q);
        }
    }
}

impl WeightElem for BlockQ4_0 {
    const VALUES: usize = 32;
    const NAME: &'static str = "q4_0";
    #[inline(always)]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (i, &b) in self.qs.iter().enumerate() {
            out[i] = d * (f32::from(b & 0x0F) - 8.0);
            out[i + 16] = d * (f32::from(b >> 4) - 8.0);
        }
    }
}

/// The value of largest magnitude (the first of equals), with its sign.
fn largest_magnitude(x: &[f32]) -> f32 {
    x.iter()
        .copied()
        .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m })
}

/// `x.round()` (halves away from zero) for `|x| < 2^31`, without the call
/// to libm's `roundf` that `f32::round` is where SSE4.1 is not a target
/// feature (x86-64's baseline): in a profile of Gemma 3's decode that call
/// was 1.6% of the main thread's samples. NaN gives 0.
#[inline(always)]
fn round_half_away(x: f32) -> f32 {
    // Truncation toward zero (exact for the |x| this takes), then the
    // fraction left, itself exact.
    let t = x as i32 as f32;
    let f = x - t;
    if f >= 0.5 {
        t + 1.0
    } else if f <= -0.5 {
        t - 1.0
    } else {
        t
    }
}

impl BlockQ8_0 {
    /// Quantises 32 values (round to nearest, halves away from zero; scale
    /// `max |x| / 127`).
    pub fn quantize(x: &[f32; 32]) -> Self {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; 32];
        for (q, &v) in qs.iter_mut().zip(x) {
            *q = round_half_away(v * inv).clamp(-127.0, 127.0) as i8;
        }
        Self {
            d: f16::from_f32(d),
            qs,
        }
    }
}

impl BlockQ4_0 {
    /// Quantises 32 values (GGUF's rule: the value of largest magnitude
    /// maps to code 0, scale `that value / -8`).
    pub fn quantize(x: &[f32; 32]) -> Self {
        let d = largest_magnitude(x) / -8.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        let code = |v: f32| ((v * inv + 8.5) as i32).clamp(0, 15) as u8;
        let mut qs = [0u8; 16];
        for (i, q) in qs.iter_mut().enumerate() {
            *q = code(x[i]) | (code(x[i + 16]) << 4);
        }
        Self {
            d: f16::from_f32(d),
            qs,
        }
    }
}

/// GGUF's `Q4_1` block: 32 values `d * q_i + m`, `q_i` the low nibbles of
/// `qs` for values 0..16 and the high nibbles for 16..32.
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// The scale.
    pub d: f16,
    /// The offset (the block's minimum).
    pub m: f16,
    /// The codes, two per byte.
    pub qs: [u8; 16],
}

/// GGUF's `Q5_0` block: 32 values `d * (q_i - 16)`, `q_i` five bits: the
/// low four from the nibbles of `qs` (low nibbles values 0..16, high ones
/// 16..32) and the fifth from bit `i` of `qh` (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// The scale.
    pub d: f16,
    /// The fifth bits of the 32 codes.
    pub qh: [u8; 4],
    /// The low four bits of the codes, two per byte.
    pub qs: [u8; 16],
}

impl WeightElem for BlockQ4_1 {
    const VALUES: usize = 32;
    const NAME: &'static str = "q4_1";
    #[inline(always)]
    fn dequant(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (i, &b) in self.qs.iter().enumerate() {
            out[i] = d.mul_add(f32::from(b & 0x0F), m);
            out[i + 16] = d.mul_add(f32::from(b >> 4), m);
        }
    }
}

impl WeightElem for BlockQ5_0 {
    const VALUES: usize = 32;
    const NAME: &'static str = "q5_0";
    #[inline(always)]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let qh = u32::from_le_bytes(self.qh);
        for (i, &b) in self.qs.iter().enumerate() {
            let lo = u32::from(b & 0x0F) | (((qh >> i) & 1) << 4);
            let hi = u32::from(b >> 4) | (((qh >> (i + 16)) & 1) << 4);
            out[i] = d * (lo as f32 - 16.0);
            out[i + 16] = d * (hi as f32 - 16.0);
        }
    }
}

impl BlockQ4_1 {
    /// Quantises 32 values (GGUF's rule: offset the minimum, scale
    /// `(max - min) / 15`, round to nearest).
    pub fn quantize(x: &[f32; 32]) -> Self {
        let (lo, hi) = x
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| {
                (l.min(v), h.max(v))
            });
        let d = (hi - lo) / 15.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        let code = |v: f32| (((v - lo) * inv + 0.5) as i32).clamp(0, 15) as u8;
        let mut qs = [0u8; 16];
        for (i, q) in qs.iter_mut().enumerate() {
            *q = code(x[i]) | (code(x[i + 16]) << 4);
        }
        Self {
            d: f16::from_f32(d),
            m: f16::from_f32(lo),
            qs,
        }
    }
}

impl BlockQ5_0 {
    /// Quantises 32 values (GGUF's rule: the value of largest magnitude
    /// maps to code 0, scale `that value / -16`).
    pub fn quantize(x: &[f32; 32]) -> Self {
        let d = largest_magnitude(x) / -16.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        let code = |v: f32| ((v * inv + 16.5) as i32).clamp(0, 31) as u32;
        let (mut qs, mut qh) = ([0u8; 16], 0u32);
        for (i, q) in qs.iter_mut().enumerate() {
            let (a, b) = (code(x[i]), code(x[i + 16]));
            *q = (a & 0x0F) as u8 | (((b & 0x0F) as u8) << 4);
            qh |= ((a >> 4) << i) | ((b >> 4) << (i + 16));
        }
        Self {
            d: f16::from_f32(d),
            qh: qh.to_le_bytes(),
            qs,
        }
    }
}

/// GGUF's `Q4_K` block: 256 values in 8 sub-blocks of 32, value
/// `d * sc_j * q - dmin * m_j` with 4-bit codes `q` and 6-bit sub-block
/// scales `sc_j` and mins `m_j` packed in `scales` (sub-blocks 0..4: the
/// low 6 bits of bytes `j` and `j + 4`; 4..8: a nibble of byte `j + 4`
/// and the top 2 bits of bytes `j - 4` and `j`). Codes: each 32 bytes of
/// `qs` hold a pair of sub-blocks, the first in the low nibbles.
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    /// The scale of the sub-block scales.
    pub d: f16,
    /// The scale of the sub-block mins.
    pub dmin: f16,
    /// The packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// The codes, two per byte.
    pub qs: [u8; 128],
}

/// GGUF's `Q6_K` block: 256 values in 16 sub-blocks of 16, value
/// `d * scales[j] * (q - 32)` with 6-bit codes `q`: in each half of 128
/// values, value `32 k + l` (`k < 4`, `l < 32`) has its low 4 bits in byte
/// `l` (`k` even) or `32 + l` (`k` odd) of the half's 64 `ql` bytes (low
/// nibble for `k < 2`) and its top 2 bits at bit `2 k` of the half's `qh`
/// byte `l`.
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low 4 bits of the codes.
    pub ql: [u8; 128],
    /// Top 2 bits of the codes.
    pub qh: [u8; 64],
    /// Sub-block scales.
    pub scales: [i8; 16],
    /// The scale of the scales.
    pub d: f16,
}

impl BlockQ4K {
    /// The eight 6-bit sub-block scales and the eight 6-bit mins, unpacked
    /// from `scales` (whole 32-bit words at a time: sub-blocks 0..4 are the
    /// low 6 bits of words 0 and 1, sub-blocks 4..8 a nibble of word 2 with
    /// the top 2 bits of words 0 and 1 above it).
    ///
    /// ```
    /// use hgca_kernels::{BlockQ4K, WeightElem};
    /// let x: [f32; 256] = core::array::from_fn(|i| (i % 32) as f32 * (1.0 + (i / 32) as f32));
    /// let b = BlockQ4K::quantize(&x);
    /// let (sc, _mins) = b.scales_mins();
    /// // The sub-block of the largest range takes the largest scale code.
    /// assert_eq!(sc[7], 63);
    /// ```
    #[inline(always)]
    pub fn scales_mins(&self) -> ([u8; 8], [u8; 8]) {
        let w = |i: usize| u32::from_le_bytes(self.scales[4 * i..4 * i + 4].try_into().expect("4"));
        let (w0, w1, w2) = (w(0), w(1), w(2));
        const LOW6: u32 = 0x3f3f_3f3f;
        const NIB: u32 = 0x0f0f_0f0f;
        const TOP2: u32 = 0x0303_0303;
        let sc_hi = (w2 & NIB) | (((w0 >> 6) & TOP2) << 4);
        let mn_hi = ((w2 >> 4) & NIB) | (((w1 >> 6) & TOP2) << 4);
        let join = |a: u32, b: u32| -> [u8; 8] {
            let mut o = [0u8; 8];
            o[..4].copy_from_slice(&a.to_le_bytes());
            o[4..].copy_from_slice(&b.to_le_bytes());
            o
        };
        (join(w0 & LOW6, sc_hi), join(w1 & LOW6, mn_hi))
    }
}

impl WeightElem for BlockQ4K {
    const VALUES: usize = 256;
    const NAME: &'static str = "q4_k";
    #[inline(always)]
    fn dequant(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d.to_f32(), self.dmin.to_f32());
        let (sc, mn) = self.scales_mins();
        for j in 0..4 {
            let (s1, m1) = (sc[2 * j], mn[2 * j]);
            let (s2, m2) = (sc[2 * j + 1], mn[2 * j + 1]);
            let (d1, o1) = (d * f32::from(s1), dmin * f32::from(m1));
            let (d2, o2) = (d * f32::from(s2), dmin * f32::from(m2));
            for (l, &q) in self.qs[32 * j..32 * j + 32].iter().enumerate() {
                out[64 * j + l] = d1 * f32::from(q & 0x0F) - o1;
                out[64 * j + 32 + l] = d2 * f32::from(q >> 4) - o2;
            }
        }
    }
}

impl WeightElem for BlockQ6K {
    const VALUES: usize = 256;
    const NAME: &'static str = "q6_k";
    #[inline(always)]
    fn dequant(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for h in 0..2 {
            let (ql, qh) = (&self.ql[64 * h..64 * h + 64], &self.qh[32 * h..32 * h + 32]);
            let sc = &self.scales[8 * h..8 * h + 8];
            for l in 0..32 {
                let q = [
                    (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (k, &qk) in q.iter().enumerate() {
                    let scale = d * f32::from(sc[l / 16 + 2 * k]);
                    out[128 * h + 32 * k + l] = scale * f32::from(i16::from(qk) - 32);
                }
            }
        }
    }
}

impl BlockQ4K {
    /// Quantises 256 values (a simple rule, not llama.cpp's search: per
    /// sub-block the range from `min(0, min x)` to `max x` in 15 steps,
    /// scales and mins in 6 bits of `d` and `dmin`).
    pub fn quantize(x: &[f32; 256]) -> Self {
        let mut scale = [0.0f32; 8];
        let mut min = [0.0f32; 8];
        for j in 0..8 {
            let c = &x[32 * j..32 * j + 32];
            let lo = c.iter().fold(0.0f32, |m, &v| m.min(v));
            let hi = c.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            scale[j] = (hi - lo).max(0.0) / 15.0;
            min[j] = -lo;
        }
        let d = scale.iter().fold(0.0f32, |m, &v| m.max(v)) / 63.0;
        let dmin = min.iter().fold(0.0f32, |m, &v| m.max(v)) / 63.0;
        let code6 = |v: f32, s: f32| {
            if s > 0.0 {
                (v / s).round().clamp(0.0, 63.0) as u8
            } else {
                0
            }
        };
        let sc: [u8; 8] = std::array::from_fn(|j| code6(scale[j], d));
        let mn: [u8; 8] = std::array::from_fn(|j| code6(min[j], dmin));
        let mut scales = [0u8; 12];
        for j in 0..4 {
            scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            scales[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
        }
        let (d16, dmin16) = (f16::from_f32(d), f16::from_f32(dmin));
        let mut q = [0u8; 256];
        for j in 0..8 {
            let step = d16.to_f32() * f32::from(sc[j]);
            let off = dmin16.to_f32() * f32::from(mn[j]);
            for l in 0..32 {
                let v = x[32 * j + l] + off;
                q[32 * j + l] = if step > 0.0 {
                    (v / step).round().clamp(0.0, 15.0) as u8
                } else {
                    0
                };
            }
        }
        let mut qs = [0u8; 128];
        for j in 0..4 {
            for l in 0..32 {
                qs[32 * j + l] = q[64 * j + l] | (q[64 * j + 32 + l] << 4);
            }
        }
        Self {
            d: d16,
            dmin: dmin16,
            scales,
            qs,
        }
    }
}

impl BlockQ6K {
    /// Quantises 256 values (a simple rule: per sub-block of 16 the scale
    /// `max |x| / 31`, stored as a multiple of `d` in 8 bits).
    pub fn quantize(x: &[f32; 256]) -> Self {
        let amax: [f32; 16] = std::array::from_fn(|j| {
            x[16 * j..16 * j + 16]
                .iter()
                .fold(0.0f32, |m, v| m.max(v.abs()))
        });
        let big = amax.iter().fold(0.0f32, |m, &v| m.max(v)) / 31.0;
        let d = f16::from_f32(big / 127.0);
        let scales: [i8; 16] = std::array::from_fn(|j| {
            if d.to_f32() > 0.0 {
                (amax[j] / 31.0 / d.to_f32()).round().clamp(0.0, 127.0) as i8
            } else {
                0
            }
        });
        let mut q = [32u8; 256];
        for (i, qv) in q.iter_mut().enumerate() {
            let s = d.to_f32() * f32::from(scales[i / 16]);
            if s > 0.0 {
                *qv = ((x[i] / s).round().clamp(-32.0, 31.0) + 32.0) as u8;
            }
        }
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for h in 0..2 {
            for l in 0..32 {
                let v = |k: usize| q[128 * h + 32 * k + l];
                ql[64 * h + l] = (v(0) & 0x0F) | ((v(2) & 0x0F) << 4);
                ql[64 * h + 32 + l] = (v(1) & 0x0F) | ((v(3) & 0x0F) << 4);
                qh[32 * h + l] =
                    (v(0) >> 4) | ((v(1) >> 4) << 2) | ((v(2) >> 4) << 4) | ((v(3) >> 4) << 6);
            }
        }
        Self { ql, qh, scales, d }
    }
}

/// The three neuron-major weight matrices of one gated FFN, rows of
/// `d_model / W::VALUES` elements: three matrices of their own
/// ([`FfnWeights::new`]); one neuron's three rows side by side
/// ([`FfnWeights::interleaved`], `[n_ff, 3, row]`), so that a neuron of a
/// sparse set is one contiguous read instead of three in three places; or
/// the gate matrix of its own and each neuron's up and down rows side by
/// side ([`FfnWeights::paired`]), for the threshold form, whose gate pass
/// reads every gate row and the kept neurons' up and down rows.
/// Read a neuron's rows with [`FfnWeights::rows`] and whole matrices with
/// [`FfnWeights::matrices`]; the fields hold the matrices as given.
#[derive(Debug, Clone, Copy)]
pub struct FfnWeights<'a, W> {
    /// Model width (a multiple of `W::VALUES`).
    pub d_model: usize,
    /// Neurons.
    pub n_ff: usize,
    /// `W_gate`, `[n_ff, d_model]`; interleaved weights: the whole
    /// `[n_ff, 3, row]` array.
    pub gate: &'a [W],
    /// `W_up`, `[n_ff, d_model]`; interleaved or paired weights: the array
    /// from neuron 0's up row on.
    pub up: &'a [W],
    /// `W_downᵀ`, `[n_ff, d_model]` (row `i`: neuron `i`'s output column);
    /// interleaved or paired weights: the array from neuron 0's down row on.
    pub down_t: &'a [W],
    /// Elements from one neuron's row to the next's in the gate, up and
    /// down arrays: `row` in a matrix of its own, `3 * row` interleaved,
    /// `2 * row` paired.
    strides: [usize; 3],
}

impl<'a, W: WeightElem> FfnWeights<'a, W> {
    /// Checks the lengths.
    ///
    /// # Errors
    /// [`Error::Param`] when `d_model` is not a multiple of the format's
    /// block; [`Error::Length`] for a matrix of another length.
    pub fn new(
        d_model: usize,
        n_ff: usize,
        gate: &'a [W],
        up: &'a [W],
        down_t: &'a [W],
    ) -> Result<Self> {
        if !d_model.is_multiple_of(W::VALUES) {
            return Err(Error::Param {
                what: "d_model (a multiple of the weight format's block)",
                value: d_model as f64,
                expected: "a multiple of 32 for the block formats, 256 for the K formats",
            });
        }
        let row = d_model / W::VALUES;
        for (what, m) in [("gate", gate), ("up", up), ("down_t", down_t)] {
            check_len_of(what, &[n_ff, row], m.len())?;
        }
        Ok(Self {
            d_model,
            n_ff,
            gate,
            up,
            down_t,
            strides: [row; 3],
        })
    }

    /// Weights whose neuron `i` holds its gate, up and down rows side by
    /// side: `rows` is `[n_ff, 3, row]` (see [`FfnWeights::interleave`]).
    /// A neuron of a sparse set is then one contiguous read of
    /// [`FfnWeights::neuron_bytes`]: on scattered active lists from DRAM
    /// that read up to 1.4x faster than three rows in three matrices (README).
    ///
    /// ```
    /// use hgca_kernels::FfnWeights;
    /// // d_model 2, 2 neurons: neuron i's rows hold 10 i + (1, 2, 3).
    /// let rows = [1.0f32, 1.0, 2.0, 2.0, 3.0, 3.0, 11.0, 11.0, 12.0, 12.0, 13.0, 13.0];
    /// let w = FfnWeights::interleaved(2, 2, &rows)?;
    /// assert_eq!(w.rows(1), [&[11.0, 11.0][..], &[12.0, 12.0], &[13.0, 13.0]]);
    /// assert_eq!(w.matrices()[2].as_ref(), &[3.0, 3.0, 13.0, 13.0]);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`FfnWeights::new`]; [`Error::Length`] when `rows` is not
    /// `n_ff * 3 * row` elements.
    pub fn interleaved(d_model: usize, n_ff: usize, rows: &'a [W]) -> Result<Self> {
        if !d_model.is_multiple_of(W::VALUES) {
            return FfnWeights::new(d_model, n_ff, rows, rows, rows);
        }
        let row = d_model / W::VALUES;
        check_len_of("interleaved rows", &[n_ff, 3, row], rows.len())?;
        let from = |m: usize| rows.get(m * row..).unwrap_or(&[]);
        Ok(Self {
            d_model,
            n_ff,
            gate: rows,
            up: from(1),
            down_t: from(2),
            strides: [3 * row; 3],
        })
    }

    /// Weights whose gate matrix stands alone (`[n_ff, row]`) and whose
    /// neuron `i` holds its up and down rows side by side: `up_down` is
    /// `[n_ff, 2, row]` (see [`FfnWeights::pair`]). The threshold form's
    /// gate pass then reads the gate rows alone and contiguous (from
    /// interleaved rows it would stream the skipped up and down rows too:
    /// 2.5x slower, README), and a kept neuron's up and down rows are one
    /// read.
    ///
    /// ```
    /// use hgca_kernels::FfnWeights;
    /// // d_model 2, 2 neurons: neuron i's rows hold 10 i + (1, 2, 3).
    /// let gate = [1.0f32, 1.0, 11.0, 11.0];
    /// let up_down = [2.0f32, 2.0, 3.0, 3.0, 12.0, 12.0, 13.0, 13.0];
    /// let w = FfnWeights::paired(2, 2, &gate, &up_down)?;
    /// assert_eq!(w.rows(1), [&[11.0, 11.0][..], &[12.0, 12.0], &[13.0, 13.0]]);
    /// assert_eq!(w.matrices()[1].as_ref(), &[2.0, 2.0, 12.0, 12.0]);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`FfnWeights::new`]; [`Error::Length`] when `gate` is not
    /// `n_ff * row` elements or `up_down` not `n_ff * 2 * row`.
    pub fn paired(d_model: usize, n_ff: usize, gate: &'a [W], up_down: &'a [W]) -> Result<Self> {
        if !d_model.is_multiple_of(W::VALUES) {
            return FfnWeights::new(d_model, n_ff, gate, up_down, up_down);
        }
        let row = d_model / W::VALUES;
        check_len_of("gate", &[n_ff, row], gate.len())?;
        check_len_of("paired up and down rows", &[n_ff, 2, row], up_down.len())?;
        Ok(Self {
            d_model,
            n_ff,
            gate,
            up: up_down,
            down_t: up_down.get(row..).unwrap_or(&[]),
            strides: [row, 2 * row, 2 * row],
        })
    }

    /// The `[n_ff, 2, row]` array of [`FfnWeights::paired`] from the up
    /// and down matrices of `n_ff` rows of `row` elements each.
    ///
    /// # Errors
    /// [`Error::Length`] when a matrix is not `n_ff * row` elements.
    pub fn pair(n_ff: usize, row: usize, up: &[W], down_t: &[W]) -> Result<Vec<W>> {
        for (what, m) in [("up", up), ("down_t", down_t)] {
            check_len_of(what, &[n_ff, row], m.len())?;
        }
        let mut v = Vec::with_capacity(2 * n_ff * row);
        for i in 0..n_ff {
            for m in [up, down_t] {
                v.extend_from_slice(&m[i * row..(i + 1) * row]);
            }
        }
        Ok(v)
    }

    /// The `[n_ff, 3, row]` array of [`FfnWeights::interleaved`] from three
    /// matrices of `n_ff` rows of `row` elements each.
    ///
    /// # Errors
    /// [`Error::Length`] when a matrix is not `n_ff * row` elements.
    pub fn interleave(
        n_ff: usize,
        row: usize,
        gate: &[W],
        up: &[W],
        down_t: &[W],
    ) -> Result<Vec<W>> {
        for (what, m) in [("gate", gate), ("up", up), ("down_t", down_t)] {
            check_len_of(what, &[n_ff, row], m.len())?;
        }
        let mut v = Vec::with_capacity(3 * n_ff * row);
        for i in 0..n_ff {
            for m in [gate, up, down_t] {
                v.extend_from_slice(&m[i * row..(i + 1) * row]);
            }
        }
        Ok(v)
    }

    /// Whether the rows are [`FfnWeights::interleaved`].
    pub fn is_interleaved(&self) -> bool {
        self.strides[0] != self.row_len()
    }

    /// Whether the rows are [`FfnWeights::paired`].
    pub fn is_paired(&self) -> bool {
        self.strides[0] == self.row_len() && self.strides[1] != self.row_len()
    }

    /// Neuron `i`'s gate, up and down rows (`i < n_ff`).
    ///
    /// # Panics
    /// When `i >= n_ff`.
    #[inline]
    pub fn rows(&self, i: usize) -> [&'a [W]; 3] {
        let r = self.row_len();
        let [g, u, d] = self.strides.map(|s| i * s);
        [
            &self.gate[g..g + r],
            &self.up[u..u + r],
            &self.down_t[d..d + r],
        ]
    }

    /// The gate, up and down matrices, `[n_ff, d_model]` each: borrowed
    /// where a matrix stands alone, gathered from interleaved or paired
    /// rows.
    pub fn matrices(&self) -> [Cow<'a, [W]>; 3] {
        let whole = [self.gate, self.up, self.down_t];
        core::array::from_fn(|m| {
            if self.strides[m] == self.row_len() {
                return Cow::Borrowed(whole[m]);
            }
            (0..self.n_ff)
                .flat_map(|i| self.rows(i)[m].iter().copied())
                .collect::<Vec<W>>()
                .into()
        })
    }

    /// Elements per row.
    pub fn row_len(&self) -> usize {
        self.d_model / W::VALUES
    }

    /// Bytes of one neuron's three rows.
    pub fn neuron_bytes(&self) -> usize {
        3 * self.row_len() * core::mem::size_of::<W>()
    }
}

/// Checks a neuron list: every index `< n_ff` and none twice.
///
/// # Errors
/// [`Error::Index`] for an index out of range, [`Error::Param`] for a repeat.
pub fn check_neurons(list: &[u32], n_ff: usize) -> Result<()> {
    let mut seen = vec![false; n_ff];
    for &i in list {
        let s = seen.get_mut(i as usize).ok_or(Error::Index {
            what: "neuron",
            index: i as usize,
            len: n_ff,
        })?;
        if *s {
            return Err(Error::Param {
                what: "neuron list (a repeated neuron)",
                value: f64::from(i),
                expected: "distinct neurons",
            });
        }
        *s = true;
    }
    Ok(())
}

/// A layer's neurons split in two (PowerInfer): the **hot** ones, computed
/// densely on the dense side (GPU), and the **cold** rest, computed
/// sparsely on the CPU. Both lists are ascending; together they are every
/// neuron once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FfnSplit {
    n_ff: usize,
    hot: Vec<u32>,
    cold: Vec<u32>,
}

impl FfnSplit {
    /// The split whose hot set is `hot` (any order) and cold set the rest.
    ///
    /// # Errors
    /// As [`check_neurons`]: an index `>= n_ff` or a repeat.
    ///
    /// ```
    /// let s = hgca_kernels::FfnSplit::new(6, &[4, 1])?;
    /// assert_eq!(s.hot(), &[1, 4]);
    /// assert_eq!(s.cold(), &[0, 2, 3, 5]);
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    pub fn new(n_ff: usize, hot: &[u32]) -> Result<Self> {
        check_neurons(hot, n_ff)?;
        let mut is_hot = vec![false; n_ff];
        for &i in hot {
            is_hot[i as usize] = true;
        }
        let (mut h, mut c) = (Vec::with_capacity(hot.len()), Vec::new());
        for (i, &x) in is_hot.iter().enumerate() {
            if x { &mut h } else { &mut c }.push(i as u32);
        }
        Ok(Self {
            n_ff,
            hot: h,
            cold: c,
        })
    }

    /// Neurons in all.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// The hot neurons, ascending.
    pub fn hot(&self) -> &[u32] {
        &self.hot
    }

    /// The cold neurons, ascending.
    pub fn cold(&self) -> &[u32] {
        &self.cold
    }
}

/// Owned neuron-major FFN weights: a subset of a layer's neurons, the gate
/// rows in a matrix of their own and each neuron's up and down rows side
/// by side ([`FfnWeights::paired`]): the threshold form's gate pass reads
/// contiguous gate rows, and a kept neuron's up and down rows are one
/// contiguous read.
#[derive(Debug, Clone, PartialEq)]
pub struct FfnOwned<W> {
    d_model: usize,
    n_ff: usize,
    /// `[n_ff, row]`.
    gate: Vec<W>,
    /// `[n_ff, 2, row]`.
    up_down: Vec<W>,
}

impl<W: WeightElem> FfnOwned<W> {
    /// Owned matrices of `n_ff` neurons.
    ///
    /// # Errors
    /// As [`FfnWeights::new`].
    pub fn new(
        d_model: usize,
        n_ff: usize,
        gate: Vec<W>,
        up: Vec<W>,
        down_t: Vec<W>,
    ) -> Result<Self> {
        FfnWeights::new(d_model, n_ff, &gate, &up, &down_t)?;
        let up_down = FfnWeights::pair(n_ff, d_model / W::VALUES, &up, &down_t)?;
        Ok(Self {
            d_model,
            n_ff,
            gate,
            up_down,
        })
    }

    /// The rows of `neurons` (in that order) of `w`: neuron `j` of the
    /// result is neuron `neurons[j]` of `w`.
    ///
    /// # Errors
    /// As [`check_neurons`].
    pub fn gather(w: &FfnWeights<'_, W>, neurons: &[u32]) -> Result<Self> {
        check_neurons(neurons, w.n_ff)?;
        let mut gate = Vec::with_capacity(neurons.len() * w.row_len());
        let mut up_down = Vec::with_capacity(neurons.len() * 2 * w.row_len());
        for &i in neurons {
            let [g, u, d] = w.rows(i as usize);
            gate.extend_from_slice(g);
            up_down.extend_from_slice(u);
            up_down.extend_from_slice(d);
        }
        Ok(Self {
            d_model: w.d_model,
            n_ff: neurons.len(),
            gate,
            up_down,
        })
    }

    /// The weights as a view ([`FfnWeights::paired`]).
    pub fn view(&self) -> FfnWeights<'_, W> {
        let row = self.d_model / W::VALUES;
        FfnWeights {
            d_model: self.d_model,
            n_ff: self.n_ff,
            gate: &self.gate,
            up: &self.up_down,
            down_t: self.up_down.get(row..).unwrap_or(&[]),
            strides: [row, 2 * row, 2 * row],
        }
    }

    /// Neurons held.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// Bytes of the three matrices.
    pub fn bytes(&self) -> usize {
        (self.gate.len() + self.up_down.len()) * core::mem::size_of::<W>()
    }
}

/// The dense side of a hybrid FFN (PowerInfer's GPU part): every neuron of
/// weights it holds, computed for a chunk of tokens. Weights are uploaded
/// once ([`DenseFfnBackend::upload_ffn`]) in f16 and stay resident; a call
/// moves only the tokens and the output.
pub trait DenseFfnBackend: Send + Sync {
    /// Weights as the backend holds them.
    type Resident: Send + Sync;

    /// Makes `w` resident.
    ///
    /// # Errors
    /// Device errors (out of memory, a binding larger than the device
    /// allows).
    fn upload_ffn(&self, w: &FfnWeights<'_, f16>) -> Result<Self::Resident>;

    /// `out = Σ_i act(gate_i·x) (up_i·x) down_t_i` over every neuron of
    /// `w`, for the `n` tokens `x` (`[n, d_model]`; `out` the same).
    /// With no neuron it writes zeros.
    ///
    /// # Errors
    /// [`Error::Length`] for `x` or `out` of another length; device errors.
    fn dense_ffn(
        &self,
        act: FfnAct,
        w: &Self::Resident,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()>;

    /// Whether a call runs off the CPU's cores (a device), so the CPU side
    /// of a split can run at the same time; `false` for the CPU fallback.
    fn runs_beside_cpu(&self) -> bool {
        false
    }
}

impl<T: DenseFfnBackend + ?Sized> DenseFfnBackend for &T {
    type Resident = T::Resident;

    fn upload_ffn(&self, w: &FfnWeights<'_, f16>) -> Result<Self::Resident> {
        (**self).upload_ffn(w)
    }

    fn dense_ffn(
        &self,
        act: FfnAct,
        w: &Self::Resident,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        (**self).dense_ffn(act, w, x, n, out)
    }

    fn runs_beside_cpu(&self) -> bool {
        (**self).runs_beside_cpu()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rounding of Q8_0's quantiser is `f32::round`'s: on halves (both
    /// signs), their neighbours one ulp either side, every code's range
    /// and values past it, and NaN (0 after the cast, as `round` gives).
    #[test]
    fn rounding_is_round_half_away_from_zero() {
        let mut xs = vec![0.0f32, -0.0, f32::NAN, 1e9, -1e9, 2.0e9, -2.0e9];
        for i in -300..=300 {
            let h = i as f32 + 0.5;
            xs.extend([
                h,
                h.next_up(),
                h.next_down(),
                i as f32,
                (i as f32).next_up(),
            ]);
            xs.push(i as f32 * 0.37);
        }
        xs.extend([
            0.5f32.next_down(),
            (-0.5f32).next_up(),
            8_388_607.5,
            8_388_609.0,
        ]);
        for x in xs {
            let (got, want) = (round_half_away(x), x.round());
            assert!(
                got == want || (x.is_nan() && got == 0.0),
                "{x:e}: {got} != {want}"
            );
        }
    }

    /// Relative RMS error of quantising then dequantising `x` in `W`.
    fn rms_error<W: WeightElem, const N: usize>(x: &[f32], q: fn(&[f32; N]) -> W) -> f64 {
        let mut out = vec![0.0f32; x.len()];
        for (c, o) in x.chunks_exact(N).zip(out.chunks_exact_mut(N)) {
            q(c.try_into().unwrap()).dequant(o);
        }
        let err: f64 = x
            .iter()
            .zip(&out)
            .map(|(&a, &b)| f64::from(a - b).powi(2))
            .sum();
        let all: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
        (err / all).sqrt()
    }

    #[test]
    fn quantisers_round_trip_within_their_precision() {
        // A deterministic spread of values, magnitudes varying by block.
        let x: Vec<f32> = (0..4096)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 + i / 256 % 4) as f32)
            .collect();
        let e8 = rms_error(&x, BlockQ8_0::quantize);
        let e40 = rms_error(&x, BlockQ4_0::quantize);
        let e41 = rms_error(&x, BlockQ4_1::quantize);
        let e50 = rms_error(&x, BlockQ5_0::quantize);
        let e4k = rms_error(&x, BlockQ4K::quantize);
        let e6k = rms_error(&x, BlockQ6K::quantize);
        // Uniform values: about step / sqrt(12) over an RMS of range / sqrt(12).
        assert!(e8 < 0.01, "q8_0 {e8}");
        assert!(e50 < 0.04, "q5_0 {e50}");
        assert!(e6k < 0.03, "q6_k {e6k}");
        for (name, e) in [("q4_0", e40), ("q4_1", e41), ("q4_k", e4k)] {
            assert!(e < 0.09, "{name} {e}");
        }
        assert!(e6k < e4k && e50 < e40 && e8 < e50);
        // Zeros stay zeros.
        let z = [0.0f32; 256];
        let mut out = [1.0f32; 256];
        BlockQ4K::quantize(&z).dequant(&mut out);
        assert!(out.iter().all(|&v| v == 0.0));
        BlockQ6K::quantize(&z).dequant(&mut out);
        assert!(out.iter().all(|&v| v == 0.0));
    }
}
