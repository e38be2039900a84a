//! # hgca-ref: the scalar f64 reference
//!
//! Obviously right, slow on purpose: no SIMD, no threads, f64 throughout,
//! compensated (Neumaier) sums. Every hgca kernel is tested against it.
//! Inputs are f32 (K/V already widened from their storage type, which is
//! exact), so the reference sees exactly the numbers a kernel sees.
//!
//! Layouts follow hgca: queries `[q_heads, d]`, K and V head-major
//! `[kv_heads, tokens, d]`, query head `h` reads KV head `h / (q_heads / kv_heads)`.
//!
//! ```
//! let (d, n) = (2, 2);
//! let k = [1.0f32, 0.0, 0.0, 1.0];
//! let v = [1.0f32, 2.0, 3.0, 4.0];
//! let q = [0.0f32, 0.0];
//! let r = hgca_ref::attend_row(&q, &k, &v, d, 1.0, &[0, 1]);
//! assert_eq!(r.out, vec![2.0, 3.0]); // equal scores: the mean of the values
//! assert!((r.lse - 2f64.ln()).abs() < 1e-15);
//! # let _ = n;
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

/// Neumaier's compensated sum.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sum {
    s: f64,
    c: f64,
}

impl Sum {
    /// Adds `x`.
    pub fn add(&mut self, x: f64) {
        let t = self.s + x;
        if self.s.abs() >= x.abs() {
            self.c += (self.s - t) + x;
        } else {
            self.c += (x - t) + self.s;
        }
        self.s = t;
    }
    /// The sum.
    pub fn get(&self) -> f64 {
        self.s + self.c
    }
}

/// Compensated dot product in f64.
pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut s = Sum::default();
    for (&x, &y) in a.iter().zip(b) {
        s.add(x as f64 * y as f64);
    }
    s.get()
}

/// `Σ |a_i b_i|` in f64.
pub fn dot_abs(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 * y as f64).abs())
        .sum()
}

/// One row of a reference partial: `out [d]` and natural-log `lse`.
#[derive(Debug, Clone, PartialEq)]
pub struct RefRow {
    /// Attention output.
    pub out: Vec<f64>,
    /// Log-sum-exp of the scores (natural log); `-inf` for the empty set.
    pub lse: f64,
    /// The conditioning of the scores, for error bounds: the largest
    /// `scale * Σ_i |q_i k_i|` over the set (an f32 dot product carries an
    /// error proportional to it, not to its result); 0 for the empty set.
    pub score_mag: f64,
}

/// Attention of one query `q [d]` over the tokens `set` of one KV head
/// (`k`, `v`: `[tokens, d]`), score scale `scale`.
pub fn attend_row(q: &[f32], k: &[f32], v: &[f32], d: usize, scale: f64, set: &[usize]) -> RefRow {
    let scores: Vec<f64> = set
        .iter()
        .map(|&j| scale * dot(q, &k[j * d..(j + 1) * d]))
        .collect();
    let w = softmax_parts(&scores);
    let Some((m, l)) = w.norm else {
        return RefRow {
            out: vec![0.0; d],
            lse: f64::NEG_INFINITY,
            score_mag: 0.0,
        };
    };
    let mut out = vec![Sum::default(); d];
    for (&j, &e) in set.iter().zip(&w.exp) {
        for (o, &x) in out.iter_mut().zip(&v[j * d..(j + 1) * d]) {
            o.add(e * x as f64);
        }
    }
    RefRow {
        out: out.iter().map(|s| s.get() / l).collect(),
        lse: m + l.ln(),
        score_mag: set
            .iter()
            .map(|&j| scale.abs() * dot_abs(q, &k[j * d..(j + 1) * d]))
            .fold(0.0, f64::max),
    }
}

struct SoftmaxParts {
    exp: Vec<f64>,
    norm: Option<(f64, f64)>,
}

fn softmax_parts(scores: &[f64]) -> SoftmaxParts {
    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if scores.is_empty() {
        return SoftmaxParts {
            exp: vec![],
            norm: None,
        };
    }
    let exp: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let mut l = Sum::default();
    exp.iter().for_each(|&e| l.add(e));
    SoftmaxParts {
        exp,
        norm: Some((m, l.get())),
    }
}

/// Softmax weights of `q` over `set` (same order as `set`), in f64.
pub fn weights_row(q: &[f32], k: &[f32], d: usize, scale: f64, set: &[usize]) -> Vec<f64> {
    let scores: Vec<f64> = set
        .iter()
        .map(|&j| scale * dot(q, &k[j * d..(j + 1) * d]))
        .collect();
    let w = softmax_parts(&scores);
    match w.norm {
        None => vec![],
        Some((_, l)) => w.exp.iter().map(|e| e / l).collect(),
    }
}

/// Attention of all query heads: `q [q_heads, d]`, `k`/`v` `[kv_heads, tokens, d]`,
/// `sets[g]` the token set of KV head `g`. Returns one row per query head.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    tokens: usize,
    scale: f64,
    sets: &[Vec<usize>],
) -> Vec<RefRow> {
    assert_eq!(q.len(), q_heads * d);
    assert_eq!(k.len(), kv_heads * tokens * d);
    assert_eq!(sets.len(), kv_heads);
    let group = q_heads / kv_heads;
    (0..q_heads)
        .map(|h| {
            let g = h / group;
            let kh = &k[g * tokens * d..(g + 1) * tokens * d];
            let vh = &v[g * tokens * d..(g + 1) * tokens * d];
            attend_row(&q[h * d..(h + 1) * d], kh, vh, d, scale, &sets[g])
        })
        .collect()
}

/// Merge of partial rows in f64 (the textbook formula): `M = max lse_i`;
/// `M = -inf` gives `(0, -inf)`; else `w_i = exp(lse_i - M)`,
/// `out = Σ w_i o_i / Σ w_i`, `lse = M + ln Σ w_i`. Inputs with `lse = -inf`
/// are empty and ignored.
pub fn merge_rows(parts: &[(&[f64], f64)], d: usize) -> (Vec<f64>, f64) {
    let m = parts.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return (vec![0.0; d], f64::NEG_INFINITY);
    }
    let mut w = Sum::default();
    let mut out = vec![Sum::default(); d];
    for &(o, l) in parts {
        if l == f64::NEG_INFINITY {
            continue;
        }
        let wi = (l - m).exp();
        w.add(wi);
        for (acc, &x) in out.iter_mut().zip(o) {
            acc.add(wi * x);
        }
    }
    let w = w.get();
    (out.iter().map(|s| s.get() / w).collect(), m + w.ln())
}

/// The reference of one token of a gated FFN over the neurons `active`:
/// `out = Σ_{i ∈ active} act(g_i) u_i down_t[i]` with `g_i = gate[i]·x`,
/// `u_i = up[i]·x` (rows of `d` values, dequantised by the caller), in
/// f64; and per output element `j` the magnitude an f32 computation's
/// error is proportional to, `Σ_i (|a_i| + e_i) |down_t[i][j]|`, where
/// `a_i = act(g_i) u_i` and `e_i = (1.1 G_i (|u_i| + U_i) + |act(g_i)|
/// U_i) / sqrt(d)` is the scale of the effect of rounding in the two dot
/// products (`G_i`, `U_i`: `Σ_k |w_ik x_k|` of the gate and up rows; the
/// slope of SiLU and ReLU is at most 1.1; a blocked f32 sum's error grows
/// like `sqrt(d)` eps times the absolute sum). A tolerance `rel * mag`
/// with `rel` a few hundred eps holds for f32 kernels with room to spare.
/// `act` maps `g` to the activation (`silu` or `relu` in f64).
pub fn ffn_row(
    act: impl Fn(f64) -> f64,
    d: usize,
    gate: &[f32],
    up: &[f32],
    down_t: &[f32],
    x: &[f32],
    active: &[usize],
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0f64; d];
    let mut mag = vec![0.0f64; d];
    for &i in active {
        fn row(m: &[f32], i: usize, d: usize) -> &[f32] {
            &m[i * d..(i + 1) * d]
        }
        let (gr, ur, dr) = (row(gate, i, d), row(up, i, d), row(down_t, i, d));
        let (g, u) = (dot(gr, x), dot(ur, x));
        let a = act(g) * u;
        let (ga, ua) = (dot_abs(gr, x), dot_abs(ur, x));
        // The dot products' rounding grows like sqrt(d) eps times their
        // absolute sums (a blocked f32 sum's typical error), not d eps.
        let err = (1.1 * ga * (u.abs() + ua) + act(g).abs() * ua) / (d as f64).sqrt().max(1.0);
        for ((o, m), &w) in out.iter_mut().zip(&mut mag).zip(dr) {
            *o += a * w as f64;
            *m += (a.abs() + err) * (w as f64).abs();
        }
    }
    (out, mag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_token_is_its_value() {
        let r = attend_row(&[3.0, -1.0], &[0.5, 0.25], &[7.0, -2.0], 2, 0.5, &[0]);
        assert_eq!(r.out, vec![7.0, -2.0]);
        assert!((r.lse - 0.5 * (1.5 - 0.25)).abs() < 1e-15);
    }

    #[test]
    fn merge_of_halves_is_whole() {
        let d = 3;
        let k: Vec<f32> = (0..15).map(|i| ((i * 7 % 5) as f32) - 2.0).collect();
        let v: Vec<f32> = (0..15).map(|i| (i as f32) * 0.3 - 1.0).collect();
        let q = [0.2f32, -0.4, 0.9];
        let all = attend_row(&q, &k, &v, d, 0.7, &[0, 1, 2, 3, 4]);
        let a = attend_row(&q, &k, &v, d, 0.7, &[0, 3]);
        let b = attend_row(&q, &k, &v, d, 0.7, &[1, 2, 4]);
        let e = attend_row(&q, &k, &v, d, 0.7, &[]);
        let (o, l) = merge_rows(&[(&a.out, a.lse), (&e.out, e.lse), (&b.out, b.lse)], d);
        assert!((l - all.lse).abs() < 1e-14);
        for (x, y) in o.iter().zip(&all.out) {
            assert!((x - y).abs() < 1e-14);
        }
        let w = weights_row(&q, &k, d, 0.7, &[0, 1, 2, 3, 4]);
        assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-15);
    }

    #[test]
    fn compensated_sum_beats_naive() {
        let mut s = Sum::default();
        for x in [1e16, 1.0, -1e16, 1.0] {
            s.add(x);
        }
        assert_eq!(s.get(), 2.0);
    }
}
