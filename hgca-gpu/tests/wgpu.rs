//! The conformance suite of hgca-testkit, instantiated for the wgpu backend.
//!
//! Runs on any wgpu adapter; in CI on Mesa's software Vulkan driver
//! (lavapipe, `scripts/setup-vulkan.sh`). Without an adapter the tests skip
//! with a printed reason, unless `HGCA_REQUIRE_WGPU=1`, which turns a missing
//! adapter into a failure. Few proptest cases: lavapipe is slow.
#![cfg(feature = "wgpu")]

use std::sync::OnceLock;

use hgca_gpu::wgpu::{MAX_HEAD_DIM, WgpuBackend, WgpuOptions};
use hgca_kernels::{
    AttnShape, DType, DenseAttention, Error, KvElem, KvWindow, MergeBackend, Partial,
    PartialLayout, PartialRef, WindowBackend, WindowSpec, bf16, f16,
};
use hgca_testkit::conformance::{check_dense, check_merge_partition};
use hgca_testkit::{EDGE_SHAPES, KvLog, Rng, Tolerance, arb_shape, arb_spread};
use proptest::prelude::*;

fn required() -> bool {
    std::env::var("HGCA_REQUIRE_WGPU").is_ok_and(|v| v == "1")
}

fn make(opts: WgpuOptions) -> Option<WgpuBackend> {
    match WgpuBackend::with_options(opts) {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(
                !required(),
                "HGCA_REQUIRE_WGPU=1 but the wgpu backend is unavailable: {e}"
            );
            eprintln!("SKIP wgpu tests (no adapter; set HGCA_REQUIRE_WGPU=1 to fail instead): {e}");
            None
        }
    }
}

/// The shared backend (default options), printed once.
fn backend() -> Option<&'static WgpuBackend> {
    static B: OnceLock<Option<WgpuBackend>> = OnceLock::new();
    B.get_or_init(|| {
        let b = make(WgpuOptions::default())?;
        let i = b.adapter_info();
        eprintln!(
            "wgpu adapter: {} | backend {} | device type {} | driver {} | SHADER_F16 {} | \
             max storage binding {} B | max workgroups/dim {}",
            i.name,
            i.backend,
            i.device_type,
            i.driver,
            i.shader_f16,
            i.max_storage_binding,
            i.max_workgroups_per_dim
        );
        Some(b)
    })
    .as_ref()
}

/// A backend with tiny splits, so that short windows run many of them.
fn split_backend() -> Option<&'static WgpuBackend> {
    static B: OnceLock<Option<WgpuBackend>> = OnceLock::new();
    B.get_or_init(|| {
        make(WgpuOptions {
            min_split_tokens: 7,
            target_workgroups: 4096,
            ..WgpuOptions::default()
        })
    })
    .as_ref()
}

macro_rules! need {
    ($b:expr) => {
        match $b {
            Some(b) => b,
            None => return,
        }
    };
}

fn shape(qh: usize, kh: usize, d: usize) -> AttnShape {
    AttnShape::new(qh, kh, d).expect("valid shape")
}

#[test]
fn types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<WgpuBackend>();
    send_sync::<hgca_gpu::wgpu::WgpuWindow>();
    send::<hgca_gpu::wgpu::WgpuPending>();
}

#[test]
fn adapter_is_present_and_named() {
    let b = need!(backend());
    let i = b.adapter_info();
    assert!(!i.name.is_empty());
    assert!(b.name().starts_with("wgpu "));
    eprintln!("backend name: {}", b.name());
}

/// Every edge shape, f32, with a window smaller than the tokens (eviction,
/// wrap-around), and d > 256 refused with a typed error.
#[test]
fn edge_table_f32() {
    let b = need!(backend());
    for (i, &(qh, kh, d, tokens)) in EDGE_SHAPES.iter().enumerate() {
        let s = shape(qh, kh, d);
        if d > MAX_HEAD_DIM {
            let spec = WindowSpec::new(s, 8, DType::F32).unwrap();
            assert!(matches!(
                b.new_window(spec),
                Err(Error::Capacity {
                    what: "wgpu head_dim",
                    ..
                })
            ));
            continue;
        }
        let cap = (tokens / 2 + 1).max(1);
        check_dense(b, s, DType::F32, cap, tokens, 7, 5, 10.0, 100 + i as u64)
            .unwrap_or_else(|e| panic!("{s:?} tokens {tokens}: {e}"));
    }
}

/// 16-bit storage (f16 and bf16) on the edge table.
#[test]
fn edge_table_f16_bf16() {
    let b = need!(backend());
    for (i, &(qh, kh, d, tokens)) in EDGE_SHAPES.iter().enumerate() {
        if d > MAX_HEAD_DIM {
            continue;
        }
        let s = shape(qh, kh, d);
        let dt = if i.is_multiple_of(2) {
            DType::F16
        } else {
            DType::BF16
        };
        let cap = (tokens / 3 + 2).max(1);
        check_dense(b, s, dt, cap, tokens, 5, 4, 1.0, 200 + i as u64)
            .unwrap_or_else(|e| panic!("{dt} {s:?} tokens {tokens}: {e}"));
    }
}

/// The ring written past its capacity many times, every dtype, several
/// chunk/evict patterns (single tokens, whole windows, odd sizes).
#[test]
fn ring_wraparound() {
    let b = need!(backend());
    let s = shape(4, 2, 17);
    for dt in DType::ALL {
        for (cap, tokens, chunk, evict) in [
            (16, 150, 5, 3),
            (16, 96, 16, 16),
            (5, 40, 1, 1),
            (13, 100, 6, 13),
        ] {
            check_dense(
                b,
                s,
                dt,
                cap,
                tokens,
                chunk,
                evict,
                3.0,
                cap as u64 * 31 + tokens as u64,
            )
            .unwrap_or_else(|e| panic!("{dt} cap {cap} tokens {tokens}: {e}"));
        }
    }
}

/// A longer window with the default split plan (several splits of 256+ tokens).
#[test]
fn long_window_default_splits() {
    let b = need!(backend());
    let s = shape(32, 8, 128);
    check_dense(b, s, DType::F16, 1024, 1500, 500, 300, 100.0, 5)
        .unwrap_or_else(|e| panic!("{s:?}: {e}"));
}

/// NaN in a query or a key makes the affected rows NaN (out and lse), the
/// other rows stay exact; never hidden by a max.
#[test]
fn nan_inputs_propagate() {
    let b = need!(backend());
    let s = shape(4, 2, 8);
    let mut w = b
        .new_window(WindowSpec::new(s, 8, DType::F32).unwrap())
        .unwrap();
    let mut rng = Rng::new(11);
    let mut k: Vec<f32> = (0..6 * s.kv_token_len()).map(|_| rng.sym()).collect();
    let v = k.clone();
    // Token 3, KV head 1, element 2: NaN (rows of query heads 2 and 3).
    k[(3 * 2 + 1) * 8 + 2] = f32::NAN;
    b.append(&mut w, 6, &k, &v).unwrap();
    let mut q: Vec<f32> = (0..s.q_len()).map(|_| rng.sym()).collect();
    q[8 + 5] = f32::NAN; // query head 1
    let p = b.submit_decode(&w, &q, false).unwrap();
    let mut out = Partial::poisoned(PartialLayout::decode(&s));
    b.wait(p, out.as_mut(), None).unwrap();
    for h in 0..4 {
        let nan = h != 0;
        assert_eq!(out.lse()[h].is_nan(), nan, "lse of head {h}");
        assert!(
            out.out()[h * 8..(h + 1) * 8]
                .iter()
                .all(|x| x.is_nan() == nan)
        );
    }
}

/// Many splits per row (tiny split length), with ragged last splits, and an
/// append whose queries see different numbers of splits.
#[test]
fn many_splits() {
    let b = need!(split_backend());
    for (qh, kh, d, tokens, cap) in [
        (8, 2, 64, 300, 300),
        (4, 1, 33, 500, 211),
        (3, 3, 256, 90, 64),
    ] {
        let s = shape(qh, kh, d);
        for dt in [DType::F32, DType::F16] {
            check_dense(b, s, dt, cap, tokens, 37, 29, 30.0, tokens as u64)
                .unwrap_or_else(|e| panic!("{dt} {s:?} tokens {tokens}: {e}"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 32,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn prop_dense(
        s in arb_shape(),
        spread in arb_spread(),
        dt in prop::sample::select(DType::ALL.to_vec()),
        tokens in 0usize..160,
        cap in 1usize..100,
        chunk in 1usize..24,
        evict in 1usize..24,
        seed in any::<u64>(),
    ) {
        let Some(b) = backend() else { return Ok(()) };
        if s.head_dim() > MAX_HEAD_DIM {
            let spec = WindowSpec::new(s, cap, dt).unwrap();
            let refused = matches!(b.new_window(spec), Err(Error::Capacity { .. }));
            prop_assert!(refused, "d > 256 must be refused");
            return Ok(());
        }
        let r = check_dense(b, s, dt, cap, tokens, chunk, evict, spread, seed);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    #[test]
    fn prop_merge(
        s in arb_shape(),
        spread in arb_spread(),
        tokens in 0usize..80,
        n_parts in 1usize..6,
        seed in any::<u64>(),
    ) {
        let Some(b) = backend() else { return Ok(()) };
        let r = check_merge_partition(b, s, tokens, spread, n_parts, seed);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

#[test]
fn merge_edge_table() {
    let b = need!(backend());
    for (i, &(qh, kh, d, tokens)) in EDGE_SHAPES.iter().enumerate() {
        let s = shape(qh, kh, d);
        for n_parts in [1, 3] {
            check_merge_partition(b, s, tokens, 100.0, n_parts, 300 + i as u64)
                .unwrap_or_else(|e| panic!("{s:?} tokens {tokens} parts {n_parts}: {e}"));
        }
    }
}

fn same_bits_or_close(got: &[f32], want: &[f32]) -> Result<(), String> {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= 1e-6 * (1.0 + w.abs())
        };
        if !ok {
            return Err(format!("element {i}: {g} vs {w}"));
        }
    }
    Ok(())
}

/// -inf, +inf (FlashAttention-2's empty), NaN lse and NaN outputs: the GPU
/// merge follows the CPU merge's contract row by row.
#[test]
fn merge_special_values() {
    let b = need!(backend());
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let layout = PartialLayout {
        n_tokens: 1,
        q_heads: 7,
        head_dim: 3,
    };
    // Rows: finite+finite, -inf+-inf, +inf+finite, NaN lse, NaN out at zero
    // weight, NaN out in an all-empty row, far-apart lse.
    let lse_a = vec![0.5, -inf, inf, nan, 1.0, -inf, 80.0];
    let lse_b = vec![-1.0, -inf, 2.0, 0.0, -inf, -inf, -80.0];
    let mut out_a: Vec<f32> = (0..21).map(|x| x as f32 * 0.1 - 1.0).collect();
    let mut out_b: Vec<f32> = (0..21).map(|x| 1.0 - x as f32 * 0.05).collect();
    out_b[4 * 3 + 1] = nan;
    out_a[5 * 3 + 2] = nan;
    let a = Partial::from_vecs(layout, out_a, lse_a).unwrap();
    let c = Partial::from_vecs(layout, out_b, lse_b).unwrap();
    let mut want = Partial::poisoned(layout);
    hgca_kernels::merge(&[a.as_ref(), c.as_ref()], want.as_mut()).unwrap();
    let mut got = Partial::poisoned(layout);
    b.merge(&[a.as_ref(), c.as_ref()], got.as_mut()).unwrap();
    same_bits_or_close(got.lse(), want.lse()).expect("n-way lse");
    same_bits_or_close(got.out(), want.out()).expect("n-way out");
    let mut acc = a.clone();
    b.merge_into(acc.as_mut(), c.as_ref()).unwrap();
    same_bits_or_close(acc.lse(), want.lse()).expect("2-way lse");
    same_bits_or_close(acc.out(), want.out()).expect("2-way out");
    // No parts: the empty partial.
    let mut e = Partial::poisoned(layout);
    b.merge(&[], e.as_mut()).unwrap();
    assert_eq!(e, Partial::empty(layout));
}

/// Several submissions in flight at once, waited for out of order, give the
/// same results as one at a time.
#[test]
fn submissions_overlap() {
    let b = need!(backend());
    let s = shape(8, 2, 32);
    let mut w = b
        .new_window(WindowSpec::new(s, 64, DType::F32).unwrap())
        .unwrap();
    let mut rng = Rng::new(7);
    let kv: Vec<f32> = (0..40 * s.kv_token_len()).map(|_| rng.sym()).collect();
    b.append(&mut w, 40, &kv, &kv).unwrap();
    let qs: Vec<Vec<f32>> = (0..3)
        .map(|_| (0..s.q_len()).map(|_| rng.sym()).collect())
        .collect();
    let layout = PartialLayout::decode(&s);
    let solo: Vec<Partial> = qs
        .iter()
        .map(|q| {
            let p = b.submit_decode(&w, q, false).unwrap();
            let mut o = Partial::poisoned(layout);
            b.wait(p, o.as_mut(), None).unwrap();
            o
        })
        .collect();
    let pending: Vec<_> = qs
        .iter()
        .map(|q| b.submit_decode(&w, q, false).unwrap())
        .collect();
    // Waited in reverse: each in-flight submission still gives its own
    // query's result, bit for bit what it gave alone.
    for (i, p) in pending.into_iter().enumerate().rev() {
        let mut o = Partial::poisoned(layout);
        b.wait(p, o.as_mut(), None).unwrap();
        assert!(
            o == solo[i],
            "in-flight submission {i} differs from its serial result"
        );
    }
}

/// Wrong inputs give typed errors, never a panic.
#[test]
fn bad_inputs_are_typed_errors() {
    let b = need!(backend());
    let s = shape(4, 2, 8);
    let spec = WindowSpec::new(s, 4, DType::F16).unwrap();
    let mut w = b.new_window(spec).unwrap();
    let tok = vec![0.5f32; s.kv_token_len()];
    // Wrong lengths, too many tokens.
    assert!(matches!(
        b.append(&mut w, 1, &tok[1..], &tok),
        Err(Error::Length { .. })
    ));
    let five = tok.repeat(5);
    assert!(matches!(
        b.append(&mut w, 5, &five, &five),
        Err(Error::Capacity { .. })
    ));
    b.append(&mut w, 3, &tok.repeat(3), &tok.repeat(3)).unwrap();
    assert_eq!(w.len(), 3);
    // Evict: more than held, wrong dtype, wrong output length.
    let mut k16 = vec![f16::ZERO; 2 * 4 * 8];
    let mut v16 = k16.clone();
    assert!(matches!(
        b.evict_oldest(&mut w, 4, &mut k16, &mut v16),
        Err(Error::Capacity { .. })
    ));
    let mut kb = vec![bf16::ZERO; 2 * 8];
    let mut vb = kb.clone();
    assert!(matches!(
        b.evict_oldest(&mut w, 1, &mut kb, &mut vb),
        Err(Error::UnsupportedDType { .. })
    ));
    assert!(matches!(
        b.evict_oldest(&mut w, 1, &mut k16, &mut v16),
        Err(Error::Length { .. })
    ));
    // Queries of the wrong length.
    assert!(matches!(
        b.submit_decode(&w, &[0.0; 3], false),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        b.submit_append(&w, &[0.0; 32], 2, 0),
        Err(Error::Length { .. })
    ));
    // Wait with the wrong layout, or weights that were not requested.
    let q = vec![0.25f32; s.q_len()];
    let p = b.submit_decode(&w, &q, false).unwrap();
    let mut wrong = Partial::poisoned(PartialLayout::append(&s, 2));
    assert!(matches!(
        b.wait(p, wrong.as_mut(), None),
        Err(Error::ShapeMismatch { .. })
    ));
    let p = b.submit_decode(&w, &q, false).unwrap();
    let mut out = Partial::poisoned(PartialLayout::decode(&s));
    let mut wts = vec![0.0; 4 * 3];
    assert!(matches!(
        b.wait(p, out.as_mut(), Some(&mut wts)),
        Err(Error::ShapeMismatch { .. })
    ));
    let p = b.submit_decode(&w, &q, true).unwrap();
    let mut short = vec![0.0; 5];
    assert!(matches!(
        b.wait(p, out.as_mut(), Some(&mut short)),
        Err(Error::Length { .. })
    ));
    // Append before the window's first position: every row empty.
    let mut w2 = b
        .new_window(WindowSpec::new(s, 4, DType::F32).unwrap())
        .unwrap();
    b.append(&mut w2, 4, &tok.repeat(4), &tok.repeat(4))
        .unwrap();
    let mut k32 = vec![0.0f32; 2 * 2 * 8];
    let mut v32 = k32.clone();
    b.evict_oldest(&mut w2, 2, &mut k32, &mut v32).unwrap();
    assert_eq!(w2.start_pos(), 2);
    let p = b
        .submit_append(&w2, &vec![1.0; 2 * s.q_len()], 2, 0)
        .unwrap();
    let mut out = Partial::poisoned(PartialLayout::append(&s, 2));
    b.wait(p, out.as_mut(), None).unwrap();
    assert_eq!(out, Partial::empty(PartialLayout::append(&s, 2)));
    // Merge layouts that differ.
    let l1 = PartialLayout::decode(&s);
    let p1 = Partial::empty(PartialLayout::append(&s, 2));
    let mut d1 = Partial::poisoned(l1);
    assert!(matches!(
        b.merge(&[p1.as_ref()], d1.as_mut()),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        b.merge_into(d1.as_mut(), p1.as_ref()),
        Err(Error::ShapeMismatch { .. })
    ));
    // A window of another backend is refused.
    if let Some(b2) = split_backend() {
        assert!(matches!(
            b2.submit_decode(&w, &q, false),
            Err(Error::ShapeMismatch { .. })
        ));
        let refs: Vec<PartialRef<'_>> = Vec::new();
        b2.merge(&refs, d1.as_mut()).unwrap();
    }
    // Invalid options.
    assert!(matches!(
        WgpuBackend::with_options(WgpuOptions {
            min_split_tokens: 0,
            ..WgpuOptions::default()
        }),
        Err(Error::Zero { .. })
    ));
}

/// Wall time of one decode (submit + wait) over a full window, printed.
/// Ignored by default; on lavapipe it measures the CPU, not a GPU.
#[test]
#[ignore = "timing report, run with --ignored"]
fn decode_timing() {
    let b = need!(backend());
    let s = shape(32, 8, 128);
    for (dt, cap) in [(DType::F32, 4096), (DType::F16, 4096)] {
        let mut w = b.new_window(WindowSpec::new(s, cap, dt).unwrap()).unwrap();
        let mut rng = Rng::new(3);
        let kv: Vec<f32> = (0..cap * s.kv_token_len()).map(|_| rng.sym()).collect();
        b.append(&mut w, cap, &kv, &kv).unwrap();
        let q: Vec<f32> = (0..s.q_len()).map(|_| rng.sym()).collect();
        let layout = PartialLayout::decode(&s);
        let mut out = Partial::poisoned(layout);
        let p = b.submit_decode(&w, &q, false).unwrap();
        b.wait(p, out.as_mut(), None).unwrap();
        let reps = 5;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            let p = b.submit_decode(&w, &q, false).unwrap();
            b.wait(p, out.as_mut(), None).unwrap();
        }
        let dtime = t.elapsed().as_secs_f64() / reps as f64;
        let bytes = w.spec().bytes() as f64;
        eprintln!(
            "decode {dt} {s:?} window {cap}: {:.3} ms, {:.2} GB/s of KV ({})",
            dtime * 1e3,
            bytes / dtime / 1e9,
            b.name()
        );
    }
}

/// The hybrid engine with this backend in the dense role: a batch of two
/// sequences on one backend shared by reference (`&WgpuBackend`), the CPU
/// attending the stores. A prompt's last query is exact attention over all
/// its tokens; every decode step is exact attention over what it attended
/// (window plus selected CPU entries), both against hgca-ref in f64.
#[test]
fn hybrid_batch_is_exact_over_the_attended_union() {
    let b = need!(backend());
    hybrid_batch_case::<f32>(b);
    hybrid_batch_case::<f16>(b);
}

fn hybrid_batch_case<T: KvElem>(gpu: &WgpuBackend) {
    use hgca_hybrid::{HybridBatch, HybridConfig, Recovery};
    let s = shape(8, 2, 32);
    let (ql, kl) = (s.q_len(), s.kv_token_len());
    let tol = Tolerance::of(T::DTYPE);
    let cfg = HybridConfig {
        window: 64,
        block: 16,
        beta: 0.5,
        recovery: Recovery::BlockBounds { top: 1 },
        ..HybridConfig::default()
    };
    let cpu = hgca_cpu::CpuBackend::new();
    let mut batch = HybridBatch::<_, _, T>::new(s, cfg, gpu, cpu).unwrap();
    let ids = [batch.add().unwrap(), batch.add().unwrap()];
    let mut logs = [KvLog::<T>::new(s), KvLog::<T>::new(s)];
    let mut rng = Rng::new(17);
    let mut rows =
        |n: usize, width: usize| -> Vec<f32> { (0..n * width).map(|_| 1.5 * rng.sym()).collect() };
    // A prompt longer than the window for the first sequence.
    let n = 150;
    let (q, k, v) = (rows(n, ql), rows(n, kl), rows(n, kl));
    let mut out = vec![f32::NAN; n * ql];
    batch.forward(ids[0], &q, &k, &v, n, &mut out).unwrap();
    logs[0].push(&k, &v, n);
    let all = vec![(0..n).collect::<Vec<_>>(); s.kv_heads()];
    if let Err(e) = logs[0].check_decode(&q[(n - 1) * ql..], &all, &out[(n - 1) * ql..], tol) {
        panic!("{}: prompt's last query: {e}", T::DTYPE);
    }
    let mut partial = 0;
    for step in 0..40 {
        let (q, k, v) = (rows(2, ql), rows(2, kl), rows(2, kl));
        let mut out = vec![f32::NAN; 2 * ql];
        batch.decode(&ids, &q, &k, &v, &mut out).unwrap();
        for (i, (&id, log)) in ids.iter().zip(&mut logs).enumerate() {
            log.push(&k[i * kl..(i + 1) * kl], &v[i * kl..(i + 1) * kl], 1);
            let sel = batch.last_selection(id).unwrap();
            let sets = log.attended(sel, batch.cpu_tokens(id).unwrap());
            partial += sets.iter().filter(|x| x.len() < log.len()).count();
            let (q, out) = (&q[i * ql..(i + 1) * ql], &out[i * ql..(i + 1) * ql]);
            if let Err(e) = log.check_decode(q, &sets, out, tol) {
                panic!("{} step {step} sequence {i}: {e}", T::DTYPE);
            }
        }
    }
    assert!(
        partial > 0,
        "{}: no step attended a partial selection",
        T::DTYPE
    );
    assert_eq!(batch.len(ids[1]).unwrap(), 40);
    // The decode steps that filled the window started the read-back of the
    // next eviction's block, and the eviction used it.
    let w = batch.window(ids[0]).unwrap();
    assert!(
        w.prefetched_evictions() >= 2,
        "{} prefetched evictions",
        w.prefetched_evictions()
    );
}

/// An eviction uses the rows a prefetch copied out (the window counts it)
/// and gives the same rows as one without; a prefetch of other rows is not
/// used.
#[test]
fn prefetched_evictions_are_used() {
    let b = need!(backend());
    let s = shape(4, 2, 24);
    let kl = s.kv_token_len();
    let mut rng = Rng::new(21);
    let kv: Vec<f32> = (0..16 * kl).map(|_| rng.sym()).collect();
    let mut evicted = Vec::new();
    for prefetch in [false, true] {
        let mut w = b
            .new_window(WindowSpec::new(s, 16, DType::F16).unwrap())
            .unwrap();
        b.append(&mut w, 16, &kv, &kv).unwrap();
        if prefetch {
            b.prefetch_oldest(&mut w, 4).unwrap();
            // The same rows again: the first copy stands.
            b.prefetch_oldest(&mut w, 4).unwrap();
        }
        let (mut k, mut v) = (vec![f16::ZERO; 2 * 4 * 24], vec![f16::ZERO; 2 * 4 * 24]);
        b.evict_oldest(&mut w, 4, &mut k, &mut v).unwrap();
        assert_eq!(w.prefetched_evictions(), u64::from(prefetch));
        evicted.push((k.clone(), v.clone()));
        // Prefetched 4, evicted 2 then 4: neither eviction matches it.
        b.prefetch_oldest(&mut w, 4).unwrap();
        let (mut k2, mut v2) = (vec![f16::ZERO; 2 * 2 * 24], vec![f16::ZERO; 2 * 2 * 24]);
        b.evict_oldest(&mut w, 2, &mut k2, &mut v2).unwrap();
        b.evict_oldest(&mut w, 4, &mut k, &mut v).unwrap();
        assert_eq!(w.prefetched_evictions(), u64::from(prefetch));
        assert!(matches!(
            b.prefetch_oldest(&mut w, 7),
            Err(Error::Capacity { .. })
        ));
    }
    assert_eq!(evicted[0], evicted[1]);
    assert!(evicted[0].0.iter().all(|x| x.to_f32().is_finite()));
}

/// Concurrency stress on one shared wgpu backend (the window side) with
/// one shared CPU backend: 8 threads x 1000 decode steps of distinct
/// sequences, each with its own hybrid layer, bit for bit what the same
/// sequences give one at a time, within a deadline (a deadlock fails).
#[test]
fn eight_threads_share_one_wgpu_backend() {
    use hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
    use hgca_testkit::stress::{shared_backend_stress, within_secs};
    let b = need!(backend());
    within_secs(900, move || {
        let s = shape(4, 2, 16);
        let cfg = HybridConfig {
            window: 64,
            block: 16,
            recovery: Recovery::BlockBounds { top: 4 },
            ..HybridConfig::default()
        };
        let cpu = hgca_cpu::CpuBackend::new();
        let make = || {
            let mut l = HybridAttention::<_, _, f32>::new(s, cfg.clone(), b, cpu.clone()).unwrap();
            move |q: &[f32], k: &[f32], v: &[f32], n: usize, out: &mut [f32]| {
                l.forward(q, k, v, n, out)
            }
        };
        let t = std::time::Instant::now();
        let steps = shared_backend_stress(&make, &s, 8, 96, 1000);
        println!(
            "wgpu: {steps} concurrent decode steps, equal bit for bit, in {:.1?}",
            t.elapsed()
        );
    });
}

/// Weights at wait without asking at submit: the error every backend gives.
#[test]
fn weights_request_errors_are_the_shared_ones() {
    let b = need!(backend());
    let r = hgca_testkit::conformance::check_weights_request(b);
    assert!(r.is_ok(), "{}", r.unwrap_err());
}
