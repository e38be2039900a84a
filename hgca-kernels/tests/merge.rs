//! The merge contract: exactness against hgca-ref over random partitions,
//! order invariance, the empty identity, extreme values, and an edge table.

use hgca_kernels::{
    AttnShape, Error, Partial, PartialLayout, PartialRef, ScalarMerge, lse_from_log2, lse_to_log2,
    merge, merge_into,
};
use hgca_testkit::{Rng, arb_shape, arb_spread, conformance::check_merge_partition};
use proptest::prelude::*;

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 1000,
        ..ProptestConfig::default()
    }
}

fn random_partial(
    layout: PartialLayout,
    rng: &mut Rng,
    lse_center: f32,
    lse_spread: f32,
) -> Partial {
    let out = (0..layout.out_len()).map(|_| rng.sym()).collect();
    let lse = (0..layout.rows())
        .map(|_| match rng.below(8) {
            0 => f32::NEG_INFINITY,
            _ => lse_center + lse_spread * rng.sym(),
        })
        .collect();
    Partial::from_vecs(layout, out, lse).unwrap()
}

proptest! {
    #![proptest_config(cfg())]

    /// Merging the parts of a random partition equals attention over the union.
    #[test]
    fn partition_merge_equals_union(
        shape in arb_shape(),
        tokens in 0usize..96,
        spread in arb_spread(),
        n_parts in 1usize..=8,
        seed in any::<u64>(),
    ) {
        let r = check_merge_partition(&ScalarMerge, shape, tokens, spread, n_parts, seed);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    /// The order of the parts does not matter (up to rounding).
    #[test]
    fn merge_is_order_invariant(
        shape in arb_shape(),
        n_parts in 1usize..=8,
        seed in any::<u64>(),
        center in prop::sample::select(vec![0.0f32, 50.0, -1e30, 1e30]),
    ) {
        let layout = PartialLayout::decode(&shape);
        let mut rng = Rng::new(seed);
        let parts: Vec<Partial> = (0..n_parts).map(|_| random_partial(layout, &mut rng, center, 20.0)).collect();
        let mut perm: Vec<usize> = (0..n_parts).collect();
        for i in (1..n_parts).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        let a: Vec<PartialRef<'_>> = parts.iter().map(Partial::as_ref).collect();
        let b: Vec<PartialRef<'_>> = perm.iter().map(|&i| parts[i].as_ref()).collect();
        let (mut x, mut y) = (Partial::poisoned(layout), Partial::poisoned(layout));
        merge(&a, x.as_mut()).unwrap();
        merge(&b, y.as_mut()).unwrap();
        for (u, v) in x.out().iter().zip(y.out()) {
            prop_assert!(u.is_finite() && (u - v).abs() <= 1e-5 * (1.0 + u.abs()), "{u} vs {v}");
        }
        for (u, v) in x.lse().iter().zip(y.lse()) {
            prop_assert!(u == v || (u - v).abs() <= 1e-6 * u.abs().max(1.0), "lse {u} vs {v}");
        }
    }

    /// The empty partial is an identity, bit for bit, on either side and in both forms.
    #[test]
    fn empty_is_identity(shape in arb_shape(), seed in any::<u64>()) {
        let layout = PartialLayout::decode(&shape);
        let p = random_partial(layout, &mut Rng::new(seed), 3.0, 40.0);
        let e = Partial::empty(layout);
        for parts in [[p.as_ref(), e.as_ref()], [e.as_ref(), p.as_ref()]] {
            let mut out = Partial::poisoned(layout);
            merge(&parts, out.as_mut()).unwrap();
            // Rows whose lse is -inf come out as the canonical empty (0, -inf).
            let mut want = p.clone();
            let (wo, wl) = (want.as_mut()).into_parts();
            for (r, l) in wl.iter().enumerate() {
                if *l == f32::NEG_INFINITY {
                    wo[r * layout.head_dim..(r + 1) * layout.head_dim].fill(0.0);
                }
            }
            prop_assert_eq!(&out, &want);
        }
        let mut acc = p.clone();
        merge_into(acc.as_mut(), e.as_ref()).unwrap();
        prop_assert_eq!(acc.lse(), p.lse());
    }

    /// Huge lse values (±1e30) and score spreads: no overflow, no NaN,
    /// and the f64 textbook merge of the same inputs agrees.
    #[test]
    fn extreme_lse_no_overflow(
        n_parts in 1usize..=8,
        seed in any::<u64>(),
        center in prop::sample::select(vec![-1e30f32, 1e30, 3e38, -3e38, 0.0]),
        spread in prop::sample::select(vec![1.0f32, 1e4, 1e30]),
    ) {
        let shape = AttnShape::new(4, 2, 9).unwrap();
        let layout = PartialLayout::decode(&shape);
        let mut rng = Rng::new(seed);
        let parts: Vec<Partial> = (0..n_parts).map(|_| random_partial(layout, &mut rng, center, spread)).collect();
        let refs: Vec<PartialRef<'_>> = parts.iter().map(Partial::as_ref).collect();
        let mut out = Partial::poisoned(layout);
        merge(&refs, out.as_mut()).unwrap();
        let d = layout.head_dim;
        for r in 0..layout.rows() {
            let rows: Vec<(Vec<f64>, f64)> = parts.iter().map(|p| {
                let l = p.lse()[r];
                (p.out()[r * d..(r + 1) * d].iter().map(|&x| x as f64).collect(),
                 if l.is_infinite() { f64::NEG_INFINITY } else { l as f64 })
            }).collect();
            let view: Vec<(&[f64], f64)> = rows.iter().map(|(o, l)| (o.as_slice(), *l)).collect();
            let (wo, wl) = hgca_ref::merge_rows(&view, d);
            let got_l = out.lse()[r] as f64;
            prop_assert!(!got_l.is_nan());
            if wl == f64::NEG_INFINITY {
                prop_assert_eq!(got_l, f64::NEG_INFINITY);
            } else {
                prop_assert!(got_l.is_finite() && (got_l - wl).abs() <= 1e-6 * wl.abs().max(1.0), "lse {got_l} vs {wl}");
            }
            for (g, w) in out.out()[r * d..(r + 1) * d].iter().zip(&wo) {
                prop_assert!(g.is_finite() && (*g as f64 - w).abs() <= 1e-5, "out {g} vs {w}");
            }
        }
    }
}

fn one_row(out: Vec<f32>, lse: f32) -> Partial {
    let layout = PartialLayout {
        n_tokens: 1,
        q_heads: 1,
        head_dim: out.len(),
    };
    Partial::from_vecs(layout, out, vec![lse]).unwrap()
}

fn merged(parts: &[Partial]) -> Partial {
    let refs: Vec<PartialRef<'_>> = parts.iter().map(Partial::as_ref).collect();
    let mut out = Partial::poisoned(parts[0].layout());
    merge(&refs, out.as_mut()).unwrap();
    // The two-way form must agree bit for bit on two parts.
    if parts.len() == 2 {
        let mut acc = parts[0].clone();
        merge_into(acc.as_mut(), parts[1].as_ref()).unwrap();
        assert_eq!(
            format!("{:?}", acc),
            format!("{:?}", out),
            "2-way and n-way forms disagree"
        );
    }
    out
}

#[test]
fn edge_both_neg_inf_is_empty_not_nan() {
    let out = merged(&[
        one_row(vec![0.0; 3], f32::NEG_INFINITY),
        one_row(vec![0.0; 3], f32::NEG_INFINITY),
    ]);
    assert_eq!(out.out(), &[0.0; 3]);
    assert_eq!(out.lse(), &[f32::NEG_INFINITY]);
}

#[test]
fn edge_pos_inf_reads_as_empty() {
    // FlashAttention-2 writes lse = +inf for a row that saw no token.
    let p = one_row(vec![1.0, -2.0], 0.75);
    let out = merged(&[one_row(vec![9.0, 9.0], f32::INFINITY), p.clone()]);
    assert_eq!(out, p);
    let out = merged(&[
        one_row(vec![9.0], f32::INFINITY),
        one_row(vec![7.0], f32::INFINITY),
    ]);
    assert_eq!(out.lse(), &[f32::NEG_INFINITY]);
    assert_eq!(out.out(), &[0.0]);
}

#[test]
fn edge_nan_propagates() {
    let out = merged(&[
        one_row(vec![1.0, 2.0], f32::NAN),
        one_row(vec![1.0, 2.0], 0.0),
    ]);
    assert!(out.lse()[0].is_nan() && out.out().iter().all(|x| x.is_nan()));
    // NaN in out shows through even with weight exp(-200) == 0 in f32.
    let out = merged(&[
        one_row(vec![f32::NAN, 2.0], -200.0),
        one_row(vec![1.0, 2.0], 0.0),
    ]);
    assert!(out.out()[0].is_nan());
    assert_eq!(out.out()[1], 2.0);
    assert_eq!(out.lse()[0], 0.0);
    // ... and from an empty partial too.
    let out = merged(&[
        one_row(vec![f32::NAN], f32::NEG_INFINITY),
        one_row(vec![1.0], f32::NEG_INFINITY),
    ]);
    assert!(out.out()[0].is_nan());
}

#[test]
fn edge_infinite_out_with_zero_weight_is_not_nan() {
    // exp(-1e30) is 0 in any precision: the infinite output is hidden.
    let out = merged(&[one_row(vec![f32::INFINITY], -1e30), one_row(vec![3.0], 0.0)]);
    assert_eq!(out.out(), &[3.0]);
    // exp(-500) underflows f32 but not the f64 the merge weighs in: the
    // exact result is +inf (a positive weight of +inf), never NaN.
    let out = merged(&[
        one_row(vec![f32::INFINITY], -500.0),
        one_row(vec![3.0], 0.0),
    ]);
    assert_eq!(out.out(), &[f32::INFINITY]);
}

#[test]
fn edge_equal_lse_is_mean() {
    let out = merged(&[one_row(vec![1.0], 5.0), one_row(vec![3.0], 5.0)]);
    assert_eq!(out.out(), &[2.0]);
    assert!((out.lse()[0] - (5.0 + 2f32.ln())).abs() < 1e-6);
}

#[test]
fn edge_d1_and_d257() {
    for d in [1usize, 257] {
        let shape = AttnShape::new(3, 1, d).unwrap();
        for n_parts in [1, 2, 8] {
            check_merge_partition(&ScalarMerge, shape, 40, 10.0, n_parts, 7 + d as u64).unwrap();
        }
    }
}

#[test]
fn edge_no_parts_gives_empty() {
    let layout = PartialLayout {
        n_tokens: 2,
        q_heads: 2,
        head_dim: 3,
    };
    let mut out = Partial::poisoned(layout);
    merge(&[], out.as_mut()).unwrap();
    assert_eq!(out, Partial::empty(layout));
}

#[test]
fn layout_mismatch_is_a_typed_error() {
    let a = one_row(vec![0.0; 3], 0.0);
    let b = one_row(vec![0.0; 4], 0.0);
    let mut out = Partial::poisoned(a.layout());
    let e = merge(&[a.as_ref(), b.as_ref()], out.as_mut()).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let mut acc = a.clone();
    assert!(
        merge_into(acc.as_mut(), b.as_ref()).is_err_and(|e| matches!(
            e,
            Error::ShapeMismatch {
                what: "partial layout",
                ..
            }
        ))
    );
    assert!(
        PartialRef::new(a.layout(), &[0.0; 2], &[0.0]).is_err_and(|e| matches!(
            e,
            Error::Length {
                what: "partial out",
                expected: 3,
                found: 2
            }
        ))
    );
}

#[test]
fn log2_conversions_round_trip() {
    // ln(8) = 3 ln(2): lse2 = 3.
    assert!((lse_to_log2(8f32.ln()) - 3.0).abs() < 1e-6);
    assert!((lse_from_log2(3.0) - 8f32.ln()).abs() < 1e-6);
    assert_eq!(lse_from_log2(f32::NEG_INFINITY), f32::NEG_INFINITY);
    for x in [-1e30f32, -3.5, 0.0, 1.25, 1e30] {
        assert!((lse_from_log2(lse_to_log2(x)) - x).abs() <= 1e-6 * x.abs().max(1.0));
    }
}

/// `merge_states` / `merge_states_into` in every LSE convention (base e or
/// 2, `[tokens, heads]` or `[heads, tokens]`) equal the natural-log merge of
/// the same partials given in hgca's own format; a base mixed up (a base-2
/// lse read as natural) is caught.
#[test]
fn merge_states_in_every_lse_convention() {
    use hgca_kernels::{LseBase, LseFormat, LseLayout, merge_states, merge_states_into};
    let mut rng = Rng::new(31);
    for (tokens, heads, d) in [(1usize, 1usize, 1usize), (3, 4, 8), (5, 2, 17)] {
        let layout = PartialLayout {
            n_tokens: tokens,
            q_heads: heads,
            head_dim: d,
        };
        let parts: Vec<Partial> = (0..3)
            .map(|_| random_partial(layout, &mut rng, 2.0, 6.0))
            .collect();
        let refs: Vec<PartialRef<'_>> = parts.iter().map(Partial::as_ref).collect();
        let mut want = Partial::poisoned(layout);
        merge(&refs, want.as_mut()).unwrap();
        for base in [LseBase::E, LseBase::Two] {
            for lay in [LseLayout::TokensHeads, LseLayout::HeadsTokens] {
                let fmt = LseFormat { base, layout: lay };
                let conv: Vec<Vec<f32>> = parts
                    .iter()
                    .map(|p| {
                        let mut l = vec![0.0; layout.rows()];
                        fmt.write(p.lse(), tokens, heads, &mut l).unwrap();
                        l
                    })
                    .collect();
                let views: Vec<(&[f32], &[f32])> = parts
                    .iter()
                    .zip(&conv)
                    .map(|(p, l)| (p.out(), l.as_slice()))
                    .collect();
                let (mut o, mut l) = (
                    vec![f32::NAN; layout.out_len()],
                    vec![f32::NAN; layout.rows()],
                );
                merge_states(layout, fmt, &views, &mut o, &mut l).unwrap();
                let mut nat = vec![0.0; layout.rows()];
                fmt.read(&l, tokens, heads, &mut nat).unwrap();
                let close = |a: f32, b: f32| a == b || (a - b).abs() <= 1e-5 * (1.0 + b.abs());
                assert!(
                    o.iter().zip(want.out()).all(|(&a, &b)| close(a, b)),
                    "{fmt:?} out"
                );
                assert!(
                    nat.iter().zip(want.lse()).all(|(&a, &b)| close(a, b)),
                    "{fmt:?} lse"
                );
                // In place, folding the parts left.
                let (mut acc_o, mut acc_l) =
                    (vec![0.0; layout.out_len()], vec![0.0; layout.rows()]);
                fmt.write(
                    &vec![f32::NEG_INFINITY; layout.rows()],
                    tokens,
                    heads,
                    &mut acc_l,
                )
                .unwrap();
                for (po, pl) in &views {
                    merge_states_into(layout, fmt, &mut acc_o, &mut acc_l, po, pl).unwrap();
                }
                assert!(
                    acc_o.iter().zip(want.out()).all(|(&a, &b)| close(a, b)),
                    "{fmt:?} in place"
                );
                // The field's common bug: base-2 lses read as natural ones.
                if base == LseBase::Two && heads * tokens > 1 {
                    let wrong = LseFormat {
                        base: LseBase::E,
                        layout: lay,
                    };
                    merge_states(layout, wrong, &views, &mut o, &mut l).unwrap();
                    assert!(
                        o.iter().zip(want.out()).any(|(&a, &b)| !close(a, b)),
                        "a mixed-up base must change the result"
                    );
                }
            }
        }
        // Wrong lengths are errors.
        let short = vec![0.0; layout.rows() - 1];
        let bad = vec![(parts[0].out(), short.as_slice())];
        let (mut o, mut l) = (vec![0.0; layout.out_len()], vec![0.0; layout.rows()]);
        assert!(matches!(
            merge_states(layout, LseFormat::FLASHINFER, &bad, &mut o, &mut l),
            Err(Error::Length { .. })
        ));
    }
}

/// The gap between adjacent f32 values at `|x|` (at least the smallest
/// normal's).
fn ulp_at(x: f64) -> f64 {
    let f = (x.abs() as f32).max(f32::MIN_POSITIVE);
    f64::from(f32::from_bits(f.to_bits() + 1)) - f64::from(f)
}

/// The f64 textbook merge of one-row partials (hgca-ref), of the outputs or
/// of their absolute values.
fn exact(parts: &[Partial], abs: bool) -> (Vec<f64>, f64) {
    let rows: Vec<(Vec<f64>, f64)> = parts
        .iter()
        .map(|p| {
            let o = p.out().iter().map(|&x| {
                if abs {
                    f64::from(x).abs()
                } else {
                    f64::from(x)
                }
            });
            (o.collect(), f64::from(p.lse()[0]))
        })
        .collect();
    let view: Vec<(&[f64], f64)> = rows.iter().map(|(o, l)| (o.as_slice(), *l)).collect();
    hgca_ref::merge_rows(&view, parts[0].layout().head_dim)
}

/// Up to 1024 parts, the N-way merge (and so the CPU kernels' chunk merge,
/// the same routine) stays within 4 ulp of the exact merge, out and lse: for
/// same-signed outputs the measure is the ulp of the result; for mixed signs
/// (cancellation) the ulp of `Σ c_i |o_i|`, the size of what is summed.
/// f32 accumulation was 23 ulp off at 1024 parts on this test.
#[test]
fn thousand_part_merge_is_within_4_ulp() {
    let d = 16;
    let layout = PartialLayout {
        n_tokens: 1,
        q_heads: 1,
        head_dim: d,
    };
    let mut worst = (0.0f64, 0.0f64);
    for (seed, n_parts) in [
        (1u64, 2usize),
        (2, 8),
        (3, 100),
        (4, 513),
        (5, 1000),
        (6, 1024),
    ] {
        for signed in [false, true] {
            let mut rng = Rng::new(seed * 2 + u64::from(signed));
            let parts: Vec<Partial> = (0..n_parts)
                .map(|_| {
                    let out = (0..d)
                        .map(|_| {
                            if signed {
                                rng.sym()
                            } else {
                                1.0 + rng.sym().abs()
                            }
                        })
                        .collect();
                    // lse spread over a few units: every part carries weight.
                    Partial::from_vecs(layout, out, vec![3.0 * rng.sym()]).unwrap()
                })
                .collect();
            let got = merged(&parts);
            let (want, want_lse) = exact(&parts, false);
            let (size, _) = exact(&parts, true);
            for j in 0..d {
                let measure = if signed { size[j] } else { want[j] };
                let err = (f64::from(got.out()[j]) - want[j]).abs() / ulp_at(measure);
                worst.0 = worst.0.max(err);
                assert!(
                    err <= 4.0,
                    "{n_parts} parts, signed {signed}, out[{j}]: {} vs {} ({err:.2} ulp)",
                    got.out()[j],
                    want[j]
                );
            }
            let err = (f64::from(got.lse()[0]) - want_lse).abs() / ulp_at(want_lse);
            worst.1 = worst.1.max(err);
            assert!(
                err <= 4.0,
                "{n_parts} parts: lse {} vs {want_lse} ({err:.2} ulp)",
                got.lse()[0]
            );
        }
    }
    println!(
        "merge up to 1024 parts: worst out {:.2} ulp, lse {:.2} ulp",
        worst.0, worst.1
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random part counts up to 1024, head dims and lse spreads: within 4
    /// ulp of the exact merge (of `Σ c_i |o_i|` where signs mix).
    #[test]
    fn many_part_merge_is_within_4_ulp(
        n_parts in 1usize..=1024,
        d in 1usize..=40,
        spread in prop::sample::select(vec![0.0f32, 1.0, 8.0, 60.0]),
        seed in any::<u64>(),
    ) {
        let layout = PartialLayout { n_tokens: 1, q_heads: 1, head_dim: d };
        let mut rng = Rng::new(seed);
        let parts: Vec<Partial> = (0..n_parts)
            .map(|_| {
                let out = (0..d).map(|_| 4.0 * rng.sym()).collect();
                Partial::from_vecs(layout, out, vec![spread * rng.sym()]).unwrap()
            })
            .collect();
        let got = merged(&parts);
        let (want, want_lse) = exact(&parts, false);
        let (size, _) = exact(&parts, true);
        for j in 0..d {
            let err = (f64::from(got.out()[j]) - want[j]).abs() / ulp_at(size[j]);
            prop_assert!(err <= 4.0, "out[{}]: {} vs {} ({:.2} ulp)", j, got.out()[j], want[j], err);
        }
        let err = (f64::from(got.lse()[0]) - want_lse).abs() / ulp_at(want_lse);
        prop_assert!(err <= 4.0, "lse {} vs {} ({:.2} ulp)", got.lse()[0], want_lse, err);
    }
}
