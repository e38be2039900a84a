//! Fuzzes the LSE merge with arbitrary partials (±inf, NaN, huge, denormal
//! values, up to 32 parts): checks it never panics, never makes NaN from
//! non-NaN input, agrees with the f64 reference within 4 ulp on finite input, and that the two-way
//! in-place form agrees with the N-way form.
#![no_main]

use arbitrary::Arbitrary;
use hgca_kernels::{Partial, PartialLayout, PartialRef, merge, merge_into};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Case {
    q_heads: u8,
    head_dim: u8,
    n_parts: u16,
    /// Raw f32 bit patterns: every special value is reachable.
    bits: Vec<u32>,
    /// Sparse special values mixed into lse: -inf, +inf, NaN, ±1e30, denormal.
    specials: Vec<(u16, u8)>,
}

const SPECIAL: [f32; 8] = [
    f32::NEG_INFINITY,
    f32::INFINITY,
    f32::NAN,
    1e30,
    -1e30,
    1e-40,
    0.0,
    -3e38,
];

/// The gap between adjacent f32 values at `x >= 0` (at least the smallest
/// subnormal's).
fn ulp_at(x: f64) -> f64 {
    let f = x as f32;
    f64::from(f32::from_bits(f.to_bits() + 1)) - f64::from(f)
}

fuzz_target!(|c: Case| {
    let layout = PartialLayout {
        n_tokens: 1,
        q_heads: 1 + (c.q_heads % 4) as usize,
        head_dim: 1 + (c.head_dim % 20) as usize,
    };
    // 0-32 parts: a run stays cheap (the fuzzer keeps the inputs that loop
    // longest); 1024 parts are checked by the merge tests' proptest.
    let n_parts = (c.n_parts % 33) as usize;
    if c.bits.is_empty() {
        return;
    }
    let mut it = c.bits.iter().cycle().map(|&b| f32::from_bits(b));
    let mut parts: Vec<Partial> = (0..n_parts)
        .map(|_| {
            let out = (&mut it).take(layout.out_len()).collect();
            // Half of the lse values are tamed to a realistic range, so that
            // weights are neither all 0 nor all 1.
            let lse = (&mut it)
                .take(layout.rows())
                .map(|x| {
                    if x.is_finite() && x.abs() > 1e3 {
                        x.rem_euclid(200.0) - 100.0
                    } else {
                        x
                    }
                })
                .collect();
            Partial::from_vecs(layout, out, lse).expect("lengths by construction")
        })
        .collect();
    for &(at, which) in &c.specials {
        if n_parts > 0 {
            let p = (at as usize) % n_parts;
            let (_, lse) = parts[p].as_mut().into_parts();
            let r = (at as usize / 7) % lse.len();
            lse[r] = SPECIAL[which as usize % SPECIAL.len()];
        }
    }
    let refs: Vec<PartialRef<'_>> = parts.iter().map(Partial::as_ref).collect();
    let mut out = Partial::poisoned(layout);
    merge(&refs, out.as_mut()).expect("layouts agree");

    let d = layout.head_dim;
    for r in 0..layout.rows() {
        fn row_of<'a>(p: &PartialRef<'a>, r: usize, d: usize) -> (&'a [f32], f32) {
            (&p.out()[r * d..(r + 1) * d], p.lse()[r])
        }
        let got = &out.out()[r * d..(r + 1) * d];
        let got_lse = out.lse()[r];
        let any_nan = refs.iter().any(|p| {
            let (o, l) = row_of(p, r, d);
            l.is_nan() || o.iter().any(|x| x.is_nan())
        });
        let all_finite_out = refs
            .iter()
            .all(|p| row_of(p, r, d).0.iter().all(|x| x.is_finite()));
        if !any_nan && all_finite_out {
            assert!(!got_lse.is_nan(), "NaN lse from non-NaN input: {refs:?}");
            assert!(
                got.iter().all(|x| !x.is_nan()),
                "NaN out from non-NaN input: {refs:?} -> {got:?}"
            );
        }
        if any_nan || !all_finite_out {
            continue;
        }
        // Finite outputs: compare with the f64 textbook merge (+inf read as empty).
        let rows64: Vec<(Vec<f64>, f64)> = refs
            .iter()
            .map(|p| {
                let (o, l) = row_of(p, r, d);
                let l = if l == f32::INFINITY {
                    f64::NEG_INFINITY
                } else {
                    l as f64
                };
                (o.iter().map(|&x| x as f64).collect(), l)
            })
            .collect();
        let view: Vec<(&[f64], f64)> = rows64.iter().map(|(o, l)| (o.as_slice(), *l)).collect();
        let (want, want_lse) = hgca_ref::merge_rows(&view, d);
        if want_lse == f64::NEG_INFINITY {
            assert_eq!(got_lse, f32::NEG_INFINITY);
            assert!(
                got.iter().all(|&x| x == 0.0),
                "empty merge must give 0: {got:?}"
            );
            continue;
        }
        let lse_err = (got_lse as f64 - want_lse).abs();
        assert!(
            lse_err <= 1e-6 * want_lse.abs().max(1.0),
            "lse {got_lse} vs {want_lse}: {refs:?}"
        );
        // Within 4 ulp of the size of what is summed, Σ c_i |o_i| (the
        // result's own ulp when nothing cancels).
        let abs64: Vec<(Vec<f64>, f64)> = rows64
            .iter()
            .map(|(o, l)| (o.iter().map(|x| x.abs()).collect(), *l))
            .collect();
        let abs_view: Vec<(&[f64], f64)> = abs64.iter().map(|(o, l)| (o.as_slice(), *l)).collect();
        let (size, _) = hgca_ref::merge_rows(&abs_view, d);
        for ((g, w), s) in got.iter().zip(&want).zip(&size) {
            // f32 cannot hold the convex combination when it rounds past f32::MAX.
            if *s < 3.0e38 {
                let bound = 4.0 * ulp_at(*s);
                assert!(
                    (*g as f64 - w).abs() <= bound,
                    "out {g} vs {w} (bound {bound}): {refs:?}"
                );
            }
        }
    }

    // The two-way in-place fold agrees with the N-way form, up to rounding
    // relative to the size of the inputs (cancellation is allowed).
    let mut acc = Partial::empty(layout);
    for p in &refs {
        merge_into(acc.as_mut(), *p).expect("layouts agree");
    }
    for r in 0..layout.rows() {
        let vmax = refs
            .iter()
            .flat_map(|p| p.out()[r * d..(r + 1) * d].iter())
            .fold(0.0f32, |m, x| m.max(x.abs()));
        // Each fold step rounds the running lse; its ulp becomes a relative
        // error of the weights (at |lse| = 3e38, ln 2 is below one ulp).
        let lse_max = refs
            .iter()
            .map(|p| p.lse()[r])
            .filter(|l| l.is_finite())
            .fold(0.0f32, |m, l| m.max(l.abs()));
        let lse_ulp = lse_max * f32::EPSILON;
        // Each fold step rounds to f32: about an ulp of the inputs per part.
        let slack = 8e-6 + 1.2e-7 * n_parts as f32 + 4.0 * n_parts as f32 * lse_ulp;
        // With an infinite output among the inputs, whether it shows (and
        // meets one of the other sign: NaN) hangs on whether its weight
        // underflows, near exp(-745), which the fold's rounded running lse
        // and the N-way form's exact differences may decide differently.
        let inf_in = refs
            .iter()
            .any(|p| p.out()[r * d..(r + 1) * d].iter().any(|x| x.is_infinite()));
        for (a, b) in acc.out()[r * d..(r + 1) * d]
            .iter()
            .zip(&out.out()[r * d..(r + 1) * d])
        {
            if inf_in && (a.is_nan() || b.is_nan() || a.is_infinite() || b.is_infinite()) {
                continue;
            }
            assert_eq!(a.is_nan(), b.is_nan(), "fold {a} vs n-way {b}: {refs:?}");
            let close = a.is_nan()
                || a == b
                || a.is_infinite()
                || b.is_infinite()
                || (a - b).abs() <= slack * vmax + 1e-37;
            assert!(close, "fold {a} vs n-way {b}: {refs:?}");
        }
    }
});
