//! Fuzzes the hybrid layer (CPU in both roles) with an arbitrary
//! configuration and an arbitrary sequence of operations: append, attend,
//! forward (decode and prompt chunks), extend, with arbitrary lengths
//! (zero, mismatched) and special values. Checks: no panic; a refused call
//! changes nothing; from finite data no NaN, and each decode output equals
//! hgca-ref over the set it attended (the window and the selection), each
//! prompt chunk the exact causal attention over every token held.
#![no_main]

use arbitrary::Arbitrary;
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
use hgca_kernels::AttnShape;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Op {
    Append { n: u8, short: bool },
    Attend { short_out: bool },
    Forward { n: u8 },
    Extend { n: u8 },
}

#[derive(Debug, Arbitrary)]
struct Case {
    kv_heads: u8,
    group: u8,
    head_dim: u8,
    window: u8,
    block: u8,
    sinks: u8,
    beta: u8,
    alpha: u8,
    recovery: u8,
    param: u8,
    refresh: u8,
    specials: bool,
    ops: Vec<Op>,
    data: Vec<i8>,
}

const SPECIAL: [f32; 6] = [
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    1e30,
    -1e30,
    1e-40,
];

fuzz_target!(|c: Case| {
    let (kvh, d) = (
        1 + usize::from(c.kv_heads % 2),
        1 + usize::from(c.head_dim % 12),
    );
    let Ok(shape) = AttnShape::new(kvh * (1 + usize::from(c.group % 3)), kvh, d) else {
        return;
    };
    let beta = match c.beta % 8 {
        6 => f32::NAN,
        7 => -1.0,
        b => f32::from(b) * 0.5,
    };
    let cfg = HybridConfig {
        window: usize::from(c.window % 40),
        block: usize::from(c.block % 17),
        sinks: usize::from(c.sinks % 6),
        beta,
        beta_per_head: None,
        alpha: f32::from(c.alpha) / 200.0,
        recovery: match c.recovery % 4 {
            0 => Recovery::Frozen,
            1 => Recovery::Rescore {
                every: usize::from(c.param % 4),
            },
            2 => Recovery::BlockBounds {
                top: usize::from(c.param % 4),
            },
            // Fields set directly (not through MassTarget::new): 0 is
            // refused by the layer's validation, the rest in (0, 1].
            _ => Recovery::Mass(hgca_kernels::MassTarget {
                target: f32::from(c.param % 8) / 7.0,
                max_share: f32::from(c.refresh % 5) / 4.0,
            }),
        },
        refresh_queries: usize::from(c.refresh % 4),
        key_codes: if c.param % 2 == 0 {
            hgca_hybrid::KeyCodes::Int4
        } else {
            hgca_hybrid::KeyCodes::Int8
        },
    };
    let Ok(mut layer) = HybridAttention::<_, _, f32>::cpu(shape, cfg.clone()) else {
        return;
    };
    let mut next = 0usize;
    let mut val = |special: bool| {
        next += 1;
        let x = c.data.get(next % c.data.len().max(1)).copied().unwrap_or(1);
        if special && c.specials && x % 17 == 0 {
            SPECIAL[(next / 3) % SPECIAL.len()]
        } else {
            f32::from(x) / 32.0
        }
    };
    let (ql, kl) = (shape.q_len(), shape.kv_token_len());
    // Every K and V appended so far, token-major, for the reference.
    let (mut all_k, mut all_v) = (Vec::<f32>::new(), Vec::<f32>::new());
    let mut finite = true;
    let scale = f64::from(shape.scale());
    let group = shape.group();
    for op in c.ops.iter().take(24) {
        let before = layer.len();
        match *op {
            Op::Append { n, short } => {
                let n = usize::from(n % 48);
                let k: Vec<f32> = (0..n * kl).map(|_| val(true)).collect();
                let mut v: Vec<f32> = (0..n * kl).map(|_| val(true)).collect();
                if short {
                    v.pop();
                }
                match layer.append(&k, &v, n) {
                    Ok(()) => {
                        finite &= k.iter().chain(&v).all(|x| x.is_finite());
                        all_k.extend(&k);
                        all_v.extend(&v);
                    }
                    Err(_) => assert_eq!(layer.len(), before, "a refused append changed the layer"),
                }
            }
            Op::Attend { short_out } => {
                let q: Vec<f32> = (0..ql).map(|_| val(false)).collect();
                let mut out = vec![f32::NAN; ql - usize::from(short_out)];
                let r = layer.attend(&q, &mut out);
                if short_out {
                    assert!(r.is_err(), "a short out was accepted");
                    continue;
                }
                r.expect("a valid attend");
                check_decode(&layer, &q, &out, &all_k, &all_v, finite, d, group, scale);
            }
            Op::Forward { n } => {
                let n = usize::from(n % 40);
                let q: Vec<f32> = (0..n * ql).map(|_| val(false)).collect();
                let k: Vec<f32> = (0..n * kl).map(|_| val(true)).collect();
                let v: Vec<f32> = (0..n * kl).map(|_| val(true)).collect();
                let mut out = vec![f32::NAN; n * ql];
                layer
                    .forward(&q, &k, &v, n, &mut out)
                    .expect("a valid forward");
                finite &= k.iter().chain(&v).all(|x| x.is_finite());
                all_k.extend(&k);
                all_v.extend(&v);
                if n == 1 {
                    check_decode(&layer, &q, &out, &all_k, &all_v, finite, d, group, scale);
                } else if finite && n > 1 {
                    // A prompt chunk is exact: query i sees every token up to its own.
                    for i in 0..n {
                        let upto = before + i + 1;
                        for hq in 0..shape.q_heads() {
                            let g = hq / group;
                            let (kk, vv) = head_rows(&all_k, &all_v, kvh, d, g, upto);
                            let set: Vec<usize> = (0..upto).collect();
                            let qr = &q[i * ql + hq * d..][..d];
                            let want = hgca_ref::attend_row(qr, &kk, &vv, d, scale, &set);
                            let got = &out[i * ql + hq * d..][..d];
                            close(got, &want.out, &vv, "prompt chunk");
                        }
                    }
                }
            }
            Op::Extend { n } => {
                let n = usize::from(n % 40);
                let k: Vec<f32> = (0..n * kl).map(|_| val(true)).collect();
                let v: Vec<f32> = (0..n * kl).map(|_| val(true)).collect();
                let probe: Vec<f32> = (0..ql).map(|_| val(false)).collect();
                layer.extend(&k, &v, n, &probe).expect("a valid extend");
                finite &= k.iter().chain(&v).all(|x| x.is_finite());
                all_k.extend(&k);
                all_v.extend(&v);
            }
        }
        assert_eq!(layer.len() * kl, all_k.len(), "tokens held");
    }
});

/// Rows of KV head `g` of the first `n` tokens, `[n, d]` each.
fn head_rows(
    k: &[f32],
    v: &[f32],
    kvh: usize,
    d: usize,
    g: usize,
    n: usize,
) -> (Vec<f32>, Vec<f32>) {
    let pick = |x: &[f32]| {
        (0..n)
            .flat_map(|t| x[(t * kvh + g) * d..][..d].iter().copied())
            .collect()
    };
    (pick(k), pick(v))
}

fn close(got: &[f32], want: &[f64], v: &[f32], what: &str) {
    let vmax = f64::from(v.iter().fold(0f32, |m, x| m.max(x.abs()))).max(1e-30);
    for (x, w) in got.iter().zip(want) {
        assert!(x.is_finite(), "{what}: non-finite output from finite data");
        assert!(
            (f64::from(*x) - w).abs() <= 2e-5 * vmax + 1e-30,
            "{what}: {x} vs {w}"
        );
    }
}

/// A decode step's output against hgca-ref over what it attended: the
/// window's tokens and the last selection of the CPU store.
#[allow(clippy::too_many_arguments)]
fn check_decode(
    layer: &HybridAttention<hgca_cpu::CpuBackend, hgca_cpu::CpuBackend, f32>,
    q: &[f32],
    out: &[f32],
    all_k: &[f32],
    all_v: &[f32],
    finite: bool,
    d: usize,
    group: usize,
    scale: f64,
) {
    if !finite || q.iter().any(|x| !x.is_finite()) {
        return;
    }
    let n = layer.len();
    let kvh = layer.shape().kv_heads();
    if n == 0 {
        assert!(out.iter().all(|&x| x == 0.0), "empty attention is zeros");
        return;
    }
    let cpu = layer.cpu_tokens();
    let sel = layer.last_selection();
    for g in 0..kvh {
        let (kk, vv) = head_rows(all_k, all_v, kvh, d, g, n);
        let mut set: Vec<usize> = if cpu > 0 {
            sel.head(g).iter().map(|&j| j as usize).collect()
        } else {
            vec![]
        };
        assert!(
            set.iter().all(|&j| j < cpu),
            "a selected index past the CPU store"
        );
        set.extend(cpu..n);
        for h in 0..group {
            let hq = g * group + h;
            let want = hgca_ref::attend_row(&q[hq * d..][..d], &kk, &vv, d, scale, &set);
            close(&out[hq * d..][..d], &want.out, &vv, "decode");
        }
    }
}
