//! A record of every token a sequence layer was given, to check its decode
//! outputs against `hgca-ref` over the tokens it attended.

use hgca_kernels::{AttnShape, KvElem, Selection};

use crate::{Tolerance, within};

/// Every token's K and V per KV head (`[tokens, d]` each), rounded to the
/// storage type `T` as the layer stores them.
#[derive(Debug, Clone)]
pub struct KvLog<T> {
    shape: AttnShape,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    vmax: f64,
    _t: std::marker::PhantomData<T>,
}

impl<T: KvElem> KvLog<T> {
    /// An empty record for layers of `shape`.
    pub fn new(shape: AttnShape) -> Self {
        let hk = shape.kv_heads();
        Self {
            shape,
            k: vec![Vec::new(); hk],
            v: vec![Vec::new(); hk],
            vmax: 0.0,
            _t: std::marker::PhantomData,
        }
    }

    /// Tokens recorded.
    pub fn len(&self) -> usize {
        self.k[0].len() / self.shape.head_dim()
    }

    /// True before the first token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records `n` tokens given token-major (`[n, kv_heads, d]`), as a
    /// layer's `forward` or `append` takes them.
    ///
    /// # Panics
    /// When `k` or `v` is not `n` tokens long (a test's own mistake).
    pub fn push(&mut self, k: &[f32], v: &[f32], n: usize) {
        let (hk, d) = (self.shape.kv_heads(), self.shape.head_dim());
        assert_eq!(k.len(), n * hk * d, "k");
        assert_eq!(v.len(), n * hk * d, "v");
        let round = |x: &f32| T::from_f32(*x).to_f32();
        for i in 0..n {
            for g in 0..hk {
                let r = (i * hk + g) * d..(i * hk + g + 1) * d;
                self.k[g].extend(k[r.clone()].iter().map(round));
                self.v[g].extend(v[r.clone()].iter().map(round));
                self.vmax = v[r]
                    .iter()
                    .fold(self.vmax, |m, x| m.max(round(x).abs() as f64));
            }
        }
    }

    /// Keys of KV head `g`, `[tokens, d]`.
    pub fn keys(&self, g: usize) -> &[f32] {
        &self.k[g]
    }

    /// The token sets a hybrid decode step attended, per KV head: the CPU
    /// entries of `sel` (store positions `0..n_cpu`) and every token after
    /// them (the window).
    pub fn attended(&self, sel: &Selection, n_cpu: usize) -> Vec<Vec<usize>> {
        (0..self.shape.kv_heads())
            .map(|g| {
                let cpu = sel.head(g).iter().map(|&j| j as usize);
                cpu.chain(n_cpu..self.len()).collect()
            })
            .collect()
    }

    /// Checks a decode output `out` (`[q_heads, d]`) of query `q` against
    /// exact attention (hgca-ref, f64) over `sets`, the token indices each
    /// KV head attended, with the tolerance of two kernels and their merge
    /// (twice the kernel's `tol`).
    ///
    /// # Errors
    /// A message naming the first element out of bounds.
    pub fn check_decode(
        &self,
        q: &[f32],
        sets: &[Vec<usize>],
        out: &[f32],
        tol: Tolerance,
    ) -> Result<(), String> {
        let s = &self.shape;
        let d = s.head_dim();
        let want = hgca_ref::attend(
            q,
            &self.k.concat(),
            &self.v.concat(),
            s.q_heads(),
            s.kv_heads(),
            d,
            self.len(),
            s.scale() as f64,
            sets,
        );
        for (h, r) in want.iter().enumerate() {
            let bound = 2.0 * self.vmax.max(1e-30) * (tol.abs + tol.rel * r.score_mag);
            for (i, (&got, &w)) in out[h * d..(h + 1) * d].iter().zip(&r.out).enumerate() {
                let err = (got as f64 - w).abs();
                if !within(err, bound) {
                    return Err(format!(
                        "head {h} [{i}]: {got} vs {w} (err {err:.3e} > {bound:.3e}) over {} of {} tokens",
                        sets[h / s.group()].len(),
                        self.len()
                    ));
                }
            }
        }
        Ok(())
    }
}
