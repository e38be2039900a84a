//! Exact attention over a sliding window of the most recent tokens: the
//! local layers of models that interleave them with global ones (Gemma 3:
//! five 512-token local layers per global layer). A local layer's whole
//! cache is its window, so it stays dense where the window lives; only the
//! global layers take the hybrid split.

use hgca_cpu::CpuBackend;
use hgca_kernels::{AttnShape, Error, KvElem, KvSource, PartialLayout, PartialMut, Result};

use crate::SequenceAttention;

/// The last `window` tokens of every KV head, in a ring.
#[derive(Debug, Clone)]
struct Ring<T> {
    kv_heads: usize,
    d: usize,
    cap: usize,
    /// `[kv_heads, cap, d]` each.
    k: Vec<T>,
    v: Vec<T>,
    /// Slot of the oldest token held, and tokens held (`<= cap`).
    oldest: usize,
    held: usize,
}

impl<T: KvElem> Ring<T> {
    fn slot(&self, j: usize) -> usize {
        (self.oldest + j) % self.cap
    }

    /// Appends one token (`k`, `v`: `[kv_heads, d]`), dropping the oldest
    /// when full.
    fn push(&mut self, k: &[f32], v: &[f32]) {
        let s = if self.held < self.cap {
            self.held += 1;
            self.slot(self.held - 1)
        } else {
            let s = self.oldest;
            self.oldest = (self.oldest + 1) % self.cap;
            s
        };
        let d = self.d;
        for h in 0..self.kv_heads {
            let at = (h * self.cap + s) * d;
            for (dst, &x) in self.k[at..at + d].iter_mut().zip(&k[h * d..(h + 1) * d]) {
                *dst = T::from_f32(x);
            }
            for (dst, &x) in self.v[at..at + d].iter_mut().zip(&v[h * d..(h + 1) * d]) {
                *dst = T::from_f32(x);
            }
        }
    }
}

impl<T: KvElem> KvSource<T> for Ring<T> {
    fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    fn head_dim(&self) -> usize {
        self.d
    }
    fn tokens(&self) -> usize {
        self.held
    }
    #[inline(always)]
    fn k_row(&self, h: usize, j: usize) -> &[T] {
        let at = (h * self.cap + self.slot(j)) * self.d;
        &self.k[at..at + self.d]
    }
    #[inline(always)]
    fn v_row(&self, h: usize, j: usize) -> &[T] {
        let at = (h * self.cap + self.slot(j)) * self.d;
        &self.v[at..at + self.d]
    }
}

/// The ring's last `ring_n` tokens (from its `skip`-th) followed by a
/// chunk's own `n` (`[n, kv_heads, d]` each, as stored): what the queries
/// of a chunk see together.
struct Chained<'a, T> {
    ring: &'a Ring<T>,
    skip: usize,
    ring_n: usize,
    k: &'a [T],
    v: &'a [T],
}

impl<'a, T: KvElem> Chained<'a, T> {
    /// Row `j` of KV head `h`: the ring's (by `ring_row`) or the chunk's
    /// own (in `own`, `[n, kv_heads, d]`).
    #[inline(always)]
    fn row(
        &self,
        h: usize,
        j: usize,
        ring_row: impl Fn(&'a Ring<T>, usize, usize) -> &'a [T],
        own: &'a [T],
    ) -> &'a [T] {
        match j.checked_sub(self.ring_n) {
            None => ring_row(self.ring, h, self.skip + j),
            Some(i) => {
                let d = self.ring.d;
                &own[(i * self.ring.kv_heads + h) * d..][..d]
            }
        }
    }
}

impl<T: KvElem> KvSource<T> for Chained<'_, T> {
    fn kv_heads(&self) -> usize {
        self.ring.kv_heads
    }
    fn head_dim(&self) -> usize {
        self.ring.d
    }
    fn tokens(&self) -> usize {
        self.ring_n + self.k.len() / (self.ring.kv_heads * self.ring.d)
    }
    #[inline(always)]
    fn k_row(&self, h: usize, j: usize) -> &[T] {
        self.row(h, j, Ring::k_row, self.k)
    }
    #[inline(always)]
    fn v_row(&self, h: usize, j: usize) -> &[T] {
        self.row(h, j, Ring::v_row, self.v)
    }
}

/// Exact attention of each query over the most recent `window` tokens,
/// itself included (a token at position `p` sees positions `p - window + 1
/// ..= p`, as Gemma 3's local layers), on the CPU, KV stored as `T`. It
/// holds only those tokens; [`SequenceAttention::len`] counts every token
/// appended. A clone is a snapshot that goes on alone.
///
/// ```
/// use hgca_hybrid::{SequenceAttention, SlidingAttention};
/// use hgca_kernels::AttnShape;
/// let shape = AttnShape::new(1, 1, 2)?;
/// let mut att = SlidingAttention::<f32>::new(shape, 2, hgca_cpu::CpuBackend::new())?;
/// let mut out = [0.0; 2];
/// // Three tokens with equal scores (q = 0): the third query averages the
/// // values of the last two only.
/// for v in [[1.0, 0.0], [0.0, 1.0], [0.0, 3.0]] {
///     att.forward(&[0.0, 0.0], &[0.5, 0.5], &v, 1, &mut out)?;
/// }
/// assert_eq!(out, [0.0, 2.0]);
/// assert_eq!(att.len(), 3);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct SlidingAttention<T: KvElem> {
    shape: AttnShape,
    cpu: CpuBackend,
    ring: Ring<T>,
    seen: usize,
    lse: Vec<f32>,
    /// A chunk's own K and V as stored (scratch).
    ck: Vec<T>,
    cv: Vec<T>,
}

impl<T: KvElem> SlidingAttention<T> {
    /// An empty cache of a `window`-token sliding window.
    ///
    /// # Errors
    /// [`Error::Zero`] for a window of 0 tokens; [`Error::Capacity`] when
    /// the window's K and V would not fit in memory addressable here.
    pub fn new(shape: AttnShape, window: usize, cpu: CpuBackend) -> Result<Self> {
        if window == 0 {
            return Err(Error::Zero {
                what: "sliding window",
            });
        }
        let len = shape
            .kv_heads()
            .checked_mul(window)
            .and_then(|x| x.checked_mul(shape.head_dim()))
            .filter(|&x| x.checked_mul(2 * core::mem::size_of::<T>()).is_some())
            .ok_or(Error::Capacity {
                what: "sliding window elements",
                capacity: usize::MAX,
                requested: window,
            })?;
        Ok(Self {
            shape,
            cpu,
            ring: Ring {
                kv_heads: shape.kv_heads(),
                d: shape.head_dim(),
                cap: window,
                k: vec![T::from_f32(0.0); len],
                v: vec![T::from_f32(0.0); len],
                oldest: 0,
                held: 0,
            },
            seen: 0,
            lse: Vec::new(),
            ck: Vec::new(),
            cv: Vec::new(),
        })
    }

    /// The window in tokens.
    pub fn window(&self) -> usize {
        self.ring.cap
    }

    /// The shape.
    pub fn shape(&self) -> &AttnShape {
        &self.shape
    }
}

impl<T: KvElem> SequenceAttention for SlidingAttention<T> {
    fn forward(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        crate::check_forward(&self.shape, q, k, v, n, out)?;
        let s = self.shape;
        let (qr, kr) = (s.q_heads() * s.head_dim(), s.kv_heads() * s.head_dim());
        if n == 0 {
            return Ok(());
        }
        if n == 1 {
            // A decode step: the ring holds the window once the token is in.
            self.ring.push(k, v);
            self.seen += 1;
            self.lse.resize(s.q_heads(), 0.0);
            let part = PartialMut::new(PartialLayout::decode(&s), out, &mut self.lse)?;
            return self.cpu.dense_decode(&s, q, &self.ring, part, None);
        }
        // A chunk: its queries see the ring's last `window - 1` tokens and
        // the chunk's own, each its own band of them (the tiled kernel's
        // sliding-window form).
        let w = self.ring.cap;
        let ring_n = self.ring.held.min(w - 1);
        let to_t = |dst: &mut Vec<T>, src: &[f32]| {
            dst.clear();
            dst.extend(src.iter().map(|&x| T::from_f32(x)));
        };
        to_t(&mut self.ck, &k[..n * kr]);
        to_t(&mut self.cv, &v[..n * kr]);
        self.lse.resize(n * s.q_heads(), 0.0);
        let chain = Chained {
            ring: &self.ring,
            skip: self.ring.held - ring_n,
            ring_n,
            k: &self.ck,
            v: &self.cv,
        };
        let part = PartialMut::new(
            PartialLayout::append(&s, n),
            &mut out[..n * qr],
            &mut self.lse,
        )?;
        self.cpu
            .dense_append_window(&s, q, n, ring_n + 1, w, &chain, part)?;
        // Only the chunk's last `window` tokens stay.
        for i in n.saturating_sub(w)..n {
            self.ring
                .push(&k[i * kr..(i + 1) * kr], &v[i * kr..(i + 1) * kr]);
        }
        self.seen += n;
        Ok(())
    }

    fn len(&self) -> usize {
        self.seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hgca_kernels::f16;

    /// Against hgca-ref over each query's window (the last `w` tokens of
    /// the head, f16-rounded K/V as stored), chunks and single steps mixed,
    /// windows shorter and longer than the sequence.
    #[test]
    fn matches_the_reference_over_each_window() {
        let shape = AttnShape::new(4, 2, 16).unwrap();
        let (hq, hk, d) = (4usize, 2usize, 16usize);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for w in [1usize, 5, 16, 200] {
            let mut att = SlidingAttention::<f16>::new(shape, w, CpuBackend::new()).unwrap();
            // All keys and values so far, per KV head `[tokens, d]`, as stored.
            let (mut ks, mut vs) = (vec![Vec::new(); hk], vec![Vec::new(); hk]);
            let mut t = 0usize;
            for n in [3usize, 1, 1, 17, 1, 9, 1] {
                let q: Vec<f32> = (0..n * hq * d).map(|_| 2.0 * rnd()).collect();
                let k: Vec<f32> = (0..n * hk * d).map(|_| 2.0 * rnd()).collect();
                let v: Vec<f32> = (0..n * hk * d).map(|_| rnd()).collect();
                let mut out = vec![f32::NAN; n * hq * d];
                att.forward(&q, &k, &v, n, &mut out).unwrap();
                for i in 0..n {
                    for g in 0..hk {
                        let r = |x: f32| f16::from_f32(x).to_f32();
                        let at = (i * hk + g) * d;
                        ks[g].extend(k[at..at + d].iter().map(|&x| r(x)));
                        vs[g].extend(v[at..at + d].iter().map(|&x| r(x)));
                    }
                    let p = t + i;
                    let set: Vec<usize> = (p.saturating_sub(w - 1)..=p).collect();
                    for h in 0..hq {
                        let g = h / (hq / hk);
                        let qh = &q[(i * hq + h) * d..(i * hq + h + 1) * d];
                        let want =
                            hgca_ref::attend_row(qh, &ks[g], &vs[g], d, shape.scale() as f64, &set);
                        let got = &out[(i * hq + h) * d..(i * hq + h + 1) * d];
                        for (a, b) in got.iter().zip(&want.out) {
                            assert!(
                                (f64::from(*a) - b).abs() < 1e-4,
                                "window {w}, token {p}, head {h}: {a} vs {b}"
                            );
                        }
                    }
                }
                t += n;
                assert_eq!(att.len(), t);
            }
        }
    }

    #[test]
    fn refuses_a_zero_window_and_bad_lengths() {
        let shape = AttnShape::new(2, 1, 4).unwrap();
        assert!(matches!(
            SlidingAttention::<f32>::new(shape, 0, CpuBackend::new()),
            Err(Error::Zero { .. })
        ));
        let mut att = SlidingAttention::<f32>::new(shape, 4, CpuBackend::new()).unwrap();
        let mut out = [0.0; 8];
        assert!(
            att.forward(&[0.0; 8], &[0.0; 3], &[0.0; 4], 1, &mut out)
                .is_err()
        );
        assert_eq!(att.len(), 0, "a refused call appends nothing");
    }
}
