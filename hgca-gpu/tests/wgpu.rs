//! The wgpu backend: hgca-testkit's suite (`dense_backend_suite!`), and what
//! only wgpu has (its options, split plans, the prefetch counter).
//!
//! Runs on any wgpu adapter; in CI on Mesa's software Vulkan driver
//! (lavapipe, `scripts/setup-vulkan.sh`). Without an adapter the tests skip
//! with a printed reason, unless `wgpu` is listed in `HGCA_REQUIRE`
//! (`hgca_testkit::require`). Few proptest cases: lavapipe is slow.
#![cfg(feature = "wgpu")]

mod common;

use std::sync::OnceLock;

use hgca_gpu::wgpu::{MAX_HEAD_DIM, WgpuBackend, WgpuOptions};
use hgca_kernels::{
    AttnShape, DType, DenseAttention, Error, KvWindow, Partial, PartialLayout, WindowBackend,
    WindowSpec, f16,
};
use hgca_testkit::conformance::check_dense;
use hgca_testkit::{Rng, require};

fn make(opts: WgpuOptions) -> Option<WgpuBackend> {
    require::available("wgpu", WgpuBackend::with_options(opts))
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

/// A longer window with the default split plan (several splits of 256+ tokens).
#[test]
fn long_window_default_splits() {
    let b = need!(backend());
    let s = shape(32, 8, 128);
    check_dense(b, s, DType::F16, 1024, 1500, 500, 300, 100.0, 5)
        .unwrap_or_else(|e| panic!("{s:?}: {e}"));
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

/// Invalid options are typed errors.
#[test]
fn bad_options_are_typed_errors() {
    need!(backend());
    assert!(matches!(
        WgpuBackend::with_options(WgpuOptions {
            min_split_tokens: 0,
            ..WgpuOptions::default()
        }),
        Err(Error::Zero {
            what: "min_split_tokens"
        })
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

/// In a hybrid layer, the decode steps that fill the window start the
/// read-back of the next eviction's block, and the eviction uses it (the
/// window counts it). Exactness is the suite's hybrid test.
#[test]
fn hybrid_decode_uses_prefetched_evictions() {
    use hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
    let b = need!(backend());
    let s = shape(8, 2, 32);
    let (ql, kl) = (s.q_len(), s.kv_token_len());
    let cfg = HybridConfig {
        window: 64,
        block: 16,
        recovery: Recovery::BlockBounds { top: 1 },
        ..HybridConfig::default()
    };
    let mut l = HybridAttention::<_, _, f16>::new(s, cfg, b, hgca_cpu::CpuBackend::new()).unwrap();
    let mut rng = Rng::new(17);
    let mut rows = |n: usize, w: usize| -> Vec<f32> { (0..n * w).map(|_| rng.sym()).collect() };
    let n = 150;
    let mut out = vec![f32::NAN; n * ql];
    l.forward(&rows(n, ql), &rows(n, kl), &rows(n, kl), n, &mut out)
        .unwrap();
    for _ in 0..40 {
        let mut out = vec![f32::NAN; ql];
        l.forward(&rows(1, ql), &rows(1, kl), &rows(1, kl), 1, &mut out)
            .unwrap();
    }
    let w = l.window();
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

/// A second backend on the same adapter, for the suite's foreign objects.
fn other_backend() -> Option<&'static WgpuBackend> {
    split_backend()
}

hgca_testkit::dense_backend_suite! {
    mod suite;
    backend: backend,
    other: other_backend,
    shared_windows: false,
    max_head_dim: MAX_HEAD_DIM,
    cases: 32,
    stress_steps: 1000,
}

/// The dense FFN (a hybrid FFN's hot neurons) against hgca-ref: the edge
/// table, both activations, typed errors; weights of another backend are
/// refused.
#[test]
fn dense_ffn_matches_the_reference() {
    let b = need!(backend());
    let other = need!(other_backend());
    hgca_testkit::ffn::check_dense_ffn_backend(b, other, &[]).unwrap();
}

/// A hybrid FFN whose hot neurons run on the GPU equals the reference over
/// hot and passing cold neurons (threshold 0: the dense FFN).
#[test]
fn hybrid_ffn_with_the_gpu_dense_side() {
    common::hybrid_ffn_dense_side(need!(backend()));
}
