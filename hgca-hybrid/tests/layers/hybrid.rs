//! The hybrid layer against full attention and the f64 reference.

use hgca_hybrid::{
    FullAttention, HybridAttention, HybridConfig, KeyCodes, Recovery, SequenceAttention,
};
use hgca_kernels::{AttnShape, DType, Error, MassTarget, bf16, f16};
use hgca_testkit::{KvLog, Rng, Tolerance};
use proptest::prelude::*;

fn tokens(rng: &mut Rng, n: usize, width: usize, scale: f32) -> Vec<f32> {
    (0..n * width).map(|_| scale * rng.sym()).collect()
}

/// Feeds the same sequence (a prompt in chunks, then decode steps) to the
/// hybrid layer and to full attention; returns the largest output difference.
fn run_both(shape: AttnShape, cfg: HybridConfig, chunks: &[usize], seed: u64) -> f32 {
    let mut rng = Rng::new(seed);
    let mut hy = HybridAttention::<_, _, f32>::cpu(shape, cfg).unwrap();
    let mut full = FullAttention::<f32>::new(shape, hgca_cpu::CpuBackend::new()).unwrap();
    let mut worst = 0.0f32;
    for &n in chunks {
        let q = tokens(&mut rng, n, shape.q_len(), 1.5);
        let k = tokens(&mut rng, n, shape.kv_token_len(), 1.5);
        let v = tokens(&mut rng, n, shape.kv_token_len(), 1.0);
        let mut a = vec![f32::NAN; n * shape.q_len()];
        let mut b = vec![f32::NAN; n * shape.q_len()];
        hy.forward(&q, &k, &v, n, &mut a).unwrap();
        full.forward(&q, &k, &v, n, &mut b).unwrap();
        assert_eq!(hy.len(), full.len());
        for (x, y) in a.iter().zip(&b) {
            assert!(x.is_finite(), "hybrid wrote a non-finite output");
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// With every CPU entry selected (all are sinks), hybrid attention is
    /// full attention up to float rounding, through window wrap-around,
    /// chunked prefill and decode.
    #[test]
    fn all_selected_equals_full(
        kv in 1usize..3, g in 1usize..4, d in prop::sample::select(vec![1usize, 8, 17, 64]),
        block_pow in 0u32..4, blocks in 1usize..5,
        chunks in prop::collection::vec(prop::sample::select(vec![1usize, 1, 1, 3, 20, 70]), 1..12),
        seed in any::<u64>(),
    ) {
        let shape = AttnShape::new(kv * g, kv, d).unwrap();
        let block = 1 << block_pow;
        let cfg = HybridConfig { window: block * blocks, block, sinks: usize::MAX, ..HybridConfig::default() };
        let worst = run_both(shape, cfg, &chunks, seed);
        prop_assert!(worst < 2e-5, "max |hybrid - full| = {worst}");
    }

    /// The mass selector with target 1 leaves out only entries of zero
    /// estimated weight (none, on these inputs): hybrid is full attention,
    /// with the sinks at their default (4), so the selection is the
    /// selector's own.
    #[test]
    fn mass_target_one_equals_full(
        kv in 1usize..3, g in 1usize..4, d in prop::sample::select(vec![1usize, 8, 17, 64]),
        block_pow in 0u32..5, blocks in 1usize..5,
        chunks in prop::collection::vec(prop::sample::select(vec![1usize, 1, 1, 3, 20, 70]), 1..12),
        seed in any::<u64>(),
    ) {
        let shape = AttnShape::new(kv * g, kv, d).unwrap();
        let block = 1 << block_pow;
        let cfg = HybridConfig {
            window: block * blocks,
            block,
            recovery: Recovery::Mass(MassTarget::new(1.0, 1.0).unwrap()),
            ..HybridConfig::default()
        };
        let worst = run_both(shape, cfg, &chunks, seed);
        prop_assert!(worst < 2e-5, "max |hybrid - full| = {worst}");
    }
}

/// A decode step with a partial selection is exact attention over what it
/// attended: the window plus the CPU entries it selected, per KV head
/// (checked against hgca-ref in f64 over that union), for each selection
/// rule, through prompt chunks (which re-evaluate the MAW) and window
/// evictions.
#[test]
fn decode_is_exact_attention_over_the_selected_union() {
    let (kvh, group, d) = (2usize, 2usize, 32usize);
    let shape = AttnShape::new(kvh * group, kvh, d).unwrap();
    for recovery in [
        Recovery::Frozen,
        Recovery::Rescore { every: 4 },
        Recovery::BlockBounds { top: 2 },
        // Random tokens attend flatly: a lower target and no dense fallback
        // keep the selections partial.
        Recovery::Mass(MassTarget::new(0.6, 1.0).unwrap()),
    ] {
        let cfg = HybridConfig {
            window: 64,
            block: 16,
            beta: 0.5,
            recovery,
            ..HybridConfig::default()
        };
        let mut hy = HybridAttention::<_, _, f32>::cpu(shape, cfg).unwrap();
        let mut rng = Rng::new(3);
        let mut log = KvLog::<f32>::new(shape);
        let (mut partial, mut checked) = (0, 0);
        for n in [100usize, 1, 1, 1, 1, 1, 1, 1, 1, 50, 1, 1, 1, 1, 1] {
            let q = tokens(&mut rng, n, shape.q_len(), 1.5);
            let k = tokens(&mut rng, n, shape.kv_token_len(), 1.5);
            let v = tokens(&mut rng, n, shape.kv_token_len(), 1.0);
            log.push(&k, &v, n);
            let mut out = vec![f32::NAN; n * shape.q_len()];
            hy.forward(&q, &k, &v, n, &mut out).unwrap();
            if n != 1 {
                continue;
            }
            let sets = log.attended(hy.last_selection(), hy.cpu_tokens());
            partial += sets.iter().filter(|s| s.len() < hy.len()).count();
            if let Err(e) = log.check_decode(&q, &sets, &out, Tolerance::of(DType::F32)) {
                panic!("{recovery:?}: {e}");
            }
            checked += 1;
        }
        assert!(
            checked >= 12 && partial > 0,
            "{recovery:?}: {partial} partial selections in {checked} steps"
        );
    }
}

#[test]
fn f16_and_bf16_storage() {
    let shape = AttnShape::new(4, 2, 16).unwrap();
    let mut rng = Rng::new(1);
    let cfg = |_dtype: DType| HybridConfig {
        window: 32,
        block: 8,
        sinks: usize::MAX,
        ..HybridConfig::default()
    };
    let mut a = HybridAttention::<_, _, f16>::cpu(shape, cfg(DType::F16)).unwrap();
    let mut b = HybridAttention::<_, _, bf16>::cpu(shape, cfg(DType::BF16)).unwrap();
    let mut f = FullAttention::<f16>::new(shape, hgca_cpu::CpuBackend::new()).unwrap();
    for n in [40usize, 1, 1, 30, 1] {
        let q = tokens(&mut rng, n, 64, 1.0);
        let k = tokens(&mut rng, n, 32, 1.0);
        let v = tokens(&mut rng, n, 32, 1.0);
        let (mut oa, mut ob, mut of) = (vec![0.0; n * 64], vec![0.0; n * 64], vec![0.0; n * 64]);
        a.forward(&q, &k, &v, n, &mut oa).unwrap();
        b.forward(&q, &k, &v, n, &mut ob).unwrap();
        f.forward(&q, &k, &v, n, &mut of).unwrap();
        for i in 0..oa.len() {
            assert!((oa[i] - of[i]).abs() < 1e-4, "f16 hybrid vs f16 full");
            assert!((ob[i] - of[i]).abs() < 0.05, "bf16 vs f16 storage");
        }
    }
    assert_eq!(a.cpu_tokens(), a.len() - a.stats().window_tokens);
}

#[test]
fn bad_config_and_input_are_typed_errors() {
    let shape = AttnShape::new(4, 2, 8).unwrap();
    let base = HybridConfig {
        window: 64,
        block: 16,
        ..HybridConfig::default()
    };
    // Each bad configuration with the error it must give (the variant and
    // the parameter it names, not merely an error).
    let with = |f: &dyn Fn(&mut HybridConfig)| {
        let mut c = base.clone();
        f(&mut c);
        c
    };
    let zero = |w: &'static str| move |e: &Error| matches!(e, Error::Zero { what } if *what == w);
    let param =
        |w: &'static str| move |e: &Error| matches!(e, Error::Param { what, .. } if *what == w);
    type Check = Box<dyn Fn(&Error) -> bool>;
    let bad: Vec<(HybridConfig, Check)> = vec![
        (with(&|c| c.block = 0), Box::new(zero("block"))),
        (with(&|c| c.block = 12), Box::new(param("block"))),
        (
            with(&|c| c.window = 8),
            Box::new(|e: &Error| matches!(e, Error::Capacity { .. })),
        ),
        (with(&|c| c.beta = f32::NAN), Box::new(param("beta"))),
        (with(&|c| c.beta = -1.0), Box::new(param("beta"))),
        (with(&|c| c.alpha = 1.5), Box::new(param("alpha"))),
        (
            with(&|c| c.recovery = Recovery::Rescore { every: 0 }),
            Box::new(zero("rescore period")),
        ),
        (
            with(&|c| c.recovery = Recovery::BlockBounds { top: 0 }),
            Box::new(zero("block bounds top")),
        ),
        (
            with(&|c| c.refresh_queries = 0),
            Box::new(zero("refresh queries")),
        ),
        (
            with(&|c| {
                c.recovery = Recovery::Mass(MassTarget {
                    target: f32::NAN,
                    max_share: 0.5,
                })
            }),
            Box::new(param("mass target")),
        ),
        (
            with(&|c| {
                c.recovery = Recovery::Mass(MassTarget {
                    target: 0.9,
                    max_share: 0.0,
                })
            }),
            Box::new(param("max page share")),
        ),
        (
            with(&|c| c.beta_per_head = Some(vec![1.0])),
            Box::new(|e: &Error| {
                matches!(
                    e,
                    Error::Length {
                        what: "beta_per_head",
                        expected: 2,
                        found: 1
                    }
                )
            }),
        ),
    ];
    for (cfg, want) in bad {
        match HybridAttention::<_, _, f32>::cpu(shape, cfg.clone()) {
            Err(e) => assert!(want(&e), "{cfg:?} gave {e:?}"),
            Ok(_) => panic!("{cfg:?} was accepted"),
        }
    }
    // Recovery parses from the command-line form.
    assert_eq!(
        "rescore:8".parse::<Recovery>().unwrap(),
        Recovery::Rescore { every: 8 }
    );
    assert_eq!("frozen".parse::<Recovery>().unwrap(), Recovery::Frozen);
    assert_eq!(
        "mass:0.9:0.25".parse::<Recovery>().unwrap(),
        Recovery::Mass(MassTarget::new(0.9, 0.25).unwrap())
    );
    assert!(matches!(
        "mass:0".parse::<Recovery>(),
        Err(Error::Param {
            what: "mass target",
            ..
        })
    ));
    assert!(matches!(
        "bounds:-1".parse::<Recovery>(),
        Err(Error::Param {
            what: "recovery",
            ..
        })
    ));
    // The KV dtype has one source, the type parameter: the window stores it.
    use hgca_kernels::KvWindow;
    let l16 = HybridAttention::<_, _, f16>::cpu(shape, base.clone()).unwrap();
    assert_eq!(l16.window().spec().dtype, DType::F16);
    let mut layer = HybridAttention::<_, _, f32>::cpu(shape, base).unwrap();
    // Nothing attended yet: a zero-token forward is a valid no-op.
    layer.forward(&[], &[], &[], 0, &mut []).unwrap();
    let mut out = vec![0.0; 32];
    layer
        .forward(&[0.0; 32], &[0.0; 16], &[0.0; 16], 1, &mut out)
        .unwrap();
    // Wrong lengths: error, and nothing lost or added.
    assert!(
        layer
            .forward(&[0.0; 32], &[0.0; 15], &[0.0; 16], 1, &mut out)
            .is_err_and(|e| matches!(
                e,
                Error::Length {
                    what: "k",
                    expected: 16,
                    found: 15
                }
            ))
    );
    assert!(
        layer
            .forward(&[0.0; 31], &[0.0; 16], &[0.0; 16], 1, &mut out)
            .is_err_and(|e| matches!(
                e,
                Error::Length {
                    what: "q",
                    expected: 32,
                    found: 31
                }
            ))
    );
    assert!(
        layer
            .forward(&[0.0; 32], &[0.0; 16], &[0.0; 16], 1, &mut out[..5])
            .is_err_and(|e| matches!(
                e,
                Error::Length {
                    what: "out",
                    expected: 32,
                    found: 5
                }
            ))
    );
    assert_eq!(layer.len(), 1);
}

/// The synthetic workloads: without a shift every rule keeps the mass; after
/// the attention shifts to an old topic, the paper's frozen MAW loses it and
/// the block-bound recovery keeps it.
#[test]
fn recovery_keeps_recall_under_attention_shift() {
    use hgca_eval::{Harness, Synth, SynthSpec};
    let shape = AttnShape::new(8, 2, 64).unwrap();
    let run = |recovery, shift: bool| {
        let cfg = HybridConfig {
            window: 1024,
            block: 64,
            recovery,
            ..HybridConfig::default()
        };
        let cpu = hgca_cpu::CpuBackend::new();
        let layer =
            HybridAttention::<_, _, f16>::new(shape, cfg, cpu.clone(), cpu.clone()).unwrap();
        let spec = SynthSpec {
            segment: 256,
            shift_at: shift.then_some(4),
            ..SynthSpec::default()
        };
        let mut h = Harness::new(layer, Synth::new(shape, spec, 11), 4096, cpu).unwrap();
        let acc: Vec<_> = (0..24).map(|_| h.step().unwrap()).collect();
        for a in &acc {
            // The yardstick is exact far below the errors it measures.
            assert!(
                a.reference_rel_diff < 1e-4,
                "f32 reference vs hgca-ref: {a:?}"
            );
        }
        let mean = |f: &dyn Fn(&hgca_eval::StepAccuracy) -> f64| {
            acc.iter().map(f).sum::<f64>() / acc.len() as f64
        };
        (
            mean(&|a| a.recall),
            mean(&|a| a.rel_err),
            mean(&|a| a.selected),
        )
    };
    let (r, e, s) = run(Recovery::Frozen, false);
    assert!(
        r > 0.99 && e < 1e-2 && s < 0.25,
        "steady, paper rule: recall {r}, err {e}, selected {s}"
    );
    let (r, e, s) = run(Recovery::BlockBounds { top: 8 }, false);
    assert!(
        r > 0.99 && e < 1e-2 && s < 0.25,
        "steady, bounds: recall {r}, err {e}, selected {s}"
    );
    let (r_paper, _, _) = run(Recovery::Frozen, true);
    let (r, _, s) = run(Recovery::BlockBounds { top: 8 }, true);
    assert!(
        r > 0.99 && s < 0.5,
        "shift, bounds: recall {r}, selected {s}"
    );
    assert!(
        r_paper < 0.9,
        "the frozen rule should lose the shifted mass, recall {r_paper}"
    );
}

/// The MAW update of a decode step, checked entry by entry against the
/// formula with f64 reference weights: for each KV head, every attended
/// token (the window after the step and the selected CPU entries) moves to
/// `alpha * before + (1 - alpha) * mean over the group of its weight`, the
/// weight normalised over the union of both sides; every other CPU entry
/// keeps its value exactly. The new token starts from `1 / (window + 1)`.
#[test]
fn maw_update_follows_the_formula() {
    let (kvh, group, d) = (2usize, 3usize, 8usize);
    let shape = AttnShape::new(kvh * group, kvh, d).unwrap();
    let alpha = 0.9f32;
    for recovery in [Recovery::Frozen, Recovery::BlockBounds { top: 1 }] {
        let cfg = HybridConfig {
            window: 16,
            block: 4,
            sinks: 1,
            beta: 0.5,
            alpha,
            recovery,
            ..HybridConfig::default()
        };
        let mut hy = HybridAttention::<_, _, f32>::cpu(shape, cfg.clone()).unwrap();
        let mut rng = Rng::new(11);
        // Every token, for the reference.
        let mut log = KvLog::<f32>::new(shape);
        let mut feed = |hy: &mut HybridAttention<_, _, f32>, log: &mut KvLog<f32>, n: usize| {
            let q = tokens(&mut rng, n, shape.q_len(), 2.0);
            let k = tokens(&mut rng, n, shape.kv_token_len(), 2.0);
            let v = tokens(&mut rng, n, shape.kv_token_len(), 1.0);
            log.push(&k, &v, n);
            let mut out = vec![0.0; n * shape.q_len()];
            hy.forward(&q, &k, &v, n, &mut out).unwrap();
            q
        };
        feed(&mut hy, &mut log, 40);
        let mut cpu_seen = 0;
        for step in 0..30 {
            let before = hy.maw_snapshot();
            let (n0, win0) = (hy.len(), hy.len() - hy.cpu_tokens());
            let q = feed(&mut hy, &mut log, 1);
            let after = hy.maw_snapshot();
            let n_cpu = hy.cpu_tokens();
            // The window evicted a block first if it was full.
            let win_at_push = if win0 == cfg.window {
                win0 - cfg.block
            } else {
                win0
            };
            let init = 1.0 / (win_at_push + 1) as f32;
            for g in 0..kvh {
                let sel: Vec<usize> = hy
                    .last_selection()
                    .head(g)
                    .iter()
                    .map(|&j| j as usize)
                    .collect();
                // Beyond the sink (token 0, always attended).
                cpu_seen += sel.iter().filter(|&&j| j >= cfg.sinks).count();
                let union: Vec<usize> = sel.iter().copied().chain(n_cpu..n0 + 1).collect();
                let mut mean = vec![0.0f64; union.len()];
                for h in 0..group {
                    let qh = &q[(g * group + h) * d..(g * group + h + 1) * d];
                    let w = hgca_ref::weights_row(qh, log.keys(g), d, shape.scale() as f64, &union);
                    mean.iter_mut()
                        .zip(&w)
                        .for_each(|(m, x)| *m += x / group as f64);
                }
                let mut attended = vec![false; n0 + 1];
                for (&j, &m) in union.iter().zip(&mean) {
                    attended[j] = true;
                    let old = if j < n0 { before[g][j] } else { init } as f64;
                    let want = alpha as f64 * old + (1.0 - alpha as f64) * m;
                    let got = after[g][j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-6 + 1e-5 * want.abs(),
                        "{recovery:?} step {step} head {g} token {j}: MAW {got} != {want}"
                    );
                }
                for j in (0..n_cpu).filter(|&j| !attended[j]) {
                    assert_eq!(
                        after[g][j].to_bits(),
                        before[g][j].to_bits(),
                        "{recovery:?} step {step} head {g}: unattended CPU entry {j} changed"
                    );
                }
            }
        }
        assert!(
            cpu_seen > 0,
            "{recovery:?}: no CPU entry was ever selected, the CPU half of the update went untested"
        );
    }
}

/// A prompt chunk's re-evaluation: every entry's MAW becomes its mean
/// weight over the chunk's last `refresh_queries` queries (group mean,
/// each query over every token held), checked against hgca-ref's weights,
/// with a CPU store behind the window.
#[test]
fn prompt_refresh_is_the_mean_weight_over_the_last_queries() {
    let (kvh, group, d) = (2usize, 2usize, 8usize);
    let shape = AttnShape::new(kvh * group, kvh, d).unwrap();
    for m in [1usize, 3, 7] {
        let cfg = HybridConfig {
            window: 32,
            block: 8,
            refresh_queries: m,
            recovery: Recovery::Frozen,
            ..HybridConfig::default()
        };
        let mut hy = HybridAttention::<_, _, f32>::cpu(shape, cfg).unwrap();
        let mut rng = Rng::new(m as u64);
        let mut log = KvLog::<f32>::new(shape);
        for n in [20usize, 45] {
            let q = tokens(&mut rng, n, shape.q_len(), 2.0);
            let k = tokens(&mut rng, n, shape.kv_token_len(), 2.0);
            let v = tokens(&mut rng, n, shape.kv_token_len(), 1.0);
            log.push(&k, &v, n);
            let mut out = vec![0.0; n * shape.q_len()];
            hy.forward(&q, &k, &v, n, &mut out).unwrap();
            let len = hy.len();
            let all: Vec<usize> = (0..len).collect();
            let maw = hy.maw_snapshot();
            for (g, maw) in maw.iter().enumerate() {
                let mut want = vec![0.0f64; len];
                for i in n - m..n {
                    for h in 0..group {
                        let qh = &q[(i * kvh * group + g * group + h) * d..][..d];
                        let w =
                            hgca_ref::weights_row(qh, log.keys(g), d, shape.scale() as f64, &all);
                        for (x, y) in want.iter_mut().zip(w) {
                            *x += y / (m * group) as f64;
                        }
                    }
                }
                for (j, (&got, &w)) in maw.iter().zip(&want).enumerate() {
                    assert!(
                        (got as f64 - w).abs() <= 1e-6 + 1e-5 * w,
                        "m {m} chunk {n} head {g} token {j}: MAW {got} vs {w}"
                    );
                }
            }
        }
        assert!(hy.cpu_tokens() > 0, "no CPU store behind the window");
    }
    let bad = HybridConfig {
        refresh_queries: 0,
        ..HybridConfig::default()
    };
    assert!(matches!(
        HybridAttention::<_, _, f32>::cpu(shape, bad),
        Err(Error::Zero { .. })
    ));
}

/// An engine's own CPU cache, as an engine would implement `CpuStore` over
/// it: a fixed pool of pages in vLLM's CPU layout `(2, pages, kv_heads,
/// block, d)` with a block size that is not a power of two, pages handed
/// out in a shuffled order by its own allocator.
struct EnginePages {
    hk: usize,
    d: usize,
    bs: usize,
    nb: usize,
    pool: Vec<f32>,
    free: Vec<u32>,
    table: Vec<u32>,
    len: usize,
}

impl EnginePages {
    fn new(hk: usize, d: usize, bs: usize, nb: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut free: Vec<u32> = (0..nb as u32).collect();
        for i in (1..nb).rev() {
            free.swap(i, rng.below(i + 1));
        }
        Self {
            hk,
            d,
            bs,
            nb,
            pool: vec![f32::NAN; 2 * nb * hk * bs * d],
            free,
            table: Vec::new(),
            len: 0,
        }
    }
    fn at(&self, h: usize, j: usize) -> usize {
        let p = self.table[j / self.bs] as usize;
        ((p * self.hk + h) * self.bs + j % self.bs) * self.d
    }
    /// The cache as the library's own paged view (what the engine's kernels
    /// and hgca's batched decode read).
    fn view(&self) -> hgca_kernels::PagedSeq<'_, f32> {
        let pool = hgca_kernels::PagedPool::vllm_cpu(&self.pool, self.nb, self.hk, self.bs, self.d)
            .unwrap();
        hgca_kernels::PagedSeq::new(pool, &self.table, self.len).unwrap()
    }
}

impl hgca_kernels::KvSource<f32> for EnginePages {
    fn kv_heads(&self) -> usize {
        self.hk
    }
    fn head_dim(&self) -> usize {
        self.d
    }
    fn tokens(&self) -> usize {
        self.len
    }
    fn k_row(&self, h: usize, j: usize) -> &[f32] {
        let o = self.at(h, j);
        &self.pool[o..o + self.d]
    }
    fn v_row(&self, h: usize, j: usize) -> &[f32] {
        let o = self.nb * self.hk * self.bs * self.d + self.at(h, j);
        &self.pool[o..o + self.d]
    }
}

impl hgca_kernels::CpuStore<f32> for EnginePages {
    fn reserve(&mut self, n: usize) -> hgca_kernels::Result<()> {
        let pages = (self.len + n).div_ceil(self.bs);
        while self.table.len() < pages {
            let p = self.free.pop().ok_or(Error::Capacity {
                what: "engine pages",
                capacity: self.nb * self.bs,
                requested: self.len + n,
            })?;
            self.table.push(p);
        }
        Ok(())
    }
    fn push_head_major(&mut self, n: usize, k: &[f32], v: &[f32]) -> hgca_kernels::Result<()> {
        hgca_kernels::check_len("k", self.hk * n * self.d, k.len())?;
        hgca_kernels::check_len("v", self.hk * n * self.d, v.len())?;
        self.reserve(n)?;
        let (d, half) = (self.d, self.nb * self.hk * self.bs * self.d);
        for h in 0..self.hk {
            for i in 0..n {
                let (o, s) = (self.at(h, self.len + i), (h * n + i) * d);
                self.pool[o..o + d].copy_from_slice(&k[s..s + d]);
                self.pool[half + o..half + o + d].copy_from_slice(&v[s..s + d]);
            }
        }
        self.len += n;
        Ok(())
    }
}

/// The whole hybrid layer over an engine-owned store (`with_store`) gives,
/// bit for bit, what it gives over hgca's own `KvStore`: prompt chunks,
/// decode steps, evictions, every recovery rule; and the engine's cache
/// then holds exactly the evicted rows, readable through a paged view.
#[test]
fn engine_owned_store_runs_the_whole_layer() {
    let shape = AttnShape::new(8, 2, 24).unwrap();
    for recovery in [
        Recovery::Frozen,
        Recovery::Rescore { every: 3 },
        Recovery::BlockBounds { top: 2 },
    ] {
        let cfg = HybridConfig {
            window: 32,
            block: 8,
            beta: 0.5,
            recovery,
            ..HybridConfig::default()
        };
        let cpu = hgca_cpu::CpuBackend::new();
        let mut own =
            HybridAttention::<_, _, f32>::new(shape, cfg.clone(), cpu.clone(), cpu.clone())
                .unwrap();
        let store = EnginePages::new(2, 24, 3, 200, 9);
        let mut eng = HybridAttention::<_, _, f32, EnginePages>::with_store(
            shape,
            cfg,
            cpu.clone(),
            cpu.clone(),
            store,
        )
        .unwrap();
        let mut rng = Rng::new(4);
        let mut log = Vec::new();
        for n in [20usize, 1, 1, 45, 1, 1, 1, 9, 1, 1, 1, 1, 30, 1, 1] {
            let q = tokens(&mut rng, n, shape.q_len(), 2.0);
            let k = tokens(&mut rng, n, shape.kv_token_len(), 2.0);
            let v = tokens(&mut rng, n, shape.kv_token_len(), 1.0);
            log.push(k.clone());
            let (mut a, mut b) = (vec![f32::NAN; n * 64 * 3], vec![f32::NAN; n * 64 * 3]);
            own.forward(&q, &k, &v, n, &mut a).unwrap();
            eng.forward(&q, &k, &v, n, &mut b).unwrap();
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{recovery:?}: engine store differs from KvStore"
            );
            assert_eq!(own.last_selection(), eng.last_selection());
        }
        let held = eng.cpu_tokens();
        assert!(held > 0 && held == own.cpu_tokens());
        // The engine's pages hold the evicted keys, in sequence order.
        let keys: Vec<f32> = log.concat();
        let view = eng.store().view();
        use hgca_kernels::KvSource;
        for j in 0..held {
            for h in 0..2 {
                assert_eq!(
                    view.k_row(h, j),
                    &keys[(j * 2 + h) * 24..][..24],
                    "token {j} head {h}"
                );
            }
        }
    }
    // A store that is not empty, or of other heads, is refused.
    let cpu = hgca_cpu::CpuBackend::new();
    let mut full = EnginePages::new(2, 24, 3, 4, 1);
    hgca_kernels::CpuStore::push_head_major(&mut full, 1, &[0.0; 48], &[0.0; 48]).unwrap();
    let cfg = HybridConfig {
        window: 32,
        block: 8,
        ..HybridConfig::default()
    };
    assert!(matches!(
        HybridAttention::<_, _, f32, EnginePages>::with_store(
            shape,
            cfg.clone(),
            cpu.clone(),
            cpu.clone(),
            full
        ),
        Err(Error::Capacity { .. })
    ));
    let other = EnginePages::new(4, 24, 3, 4, 1);
    assert!(matches!(
        HybridAttention::<_, _, f32, EnginePages>::with_store(shape, cfg, cpu.clone(), cpu, other),
        Err(Error::ShapeMismatch { .. })
    ));
}

/// The scattered shift (the measurement): at 16k tokens with a
/// window of 4096, the attention moves to 48 old tokens, one per 64-token
/// block of the CPU store, their keys on one direction. The paper's frozen
/// MAW loses nearly all of it, the top-32 block bounds most of it; the
/// mass-targeted selector keeps it with a small share of the entries, and
/// reports an estimate that follows the true recall.
#[test]
fn mass_selector_follows_a_scattered_shift() {
    use hgca_eval::{Harness, Scattered, StepAccuracy, Synth, SynthSpec};
    let shape = AttnShape::new(4, 2, 64).unwrap();
    let context = 16384;
    let run = |recovery, key_codes| -> Vec<(StepAccuracy, Option<f32>)> {
        let cfg = HybridConfig {
            window: 4096,
            block: 64,
            recovery,
            key_codes,
            ..HybridConfig::default()
        };
        let cpu = hgca_cpu::CpuBackend::new();
        let layer =
            HybridAttention::<_, _, f16>::new(shape, cfg, cpu.clone(), cpu.clone()).unwrap();
        let spec = SynthSpec {
            shift_at: Some(6),
            scattered: Some(Scattered {
                count: 48,
                stride: 256,
                logit: 12.0,
            }),
            ..SynthSpec::default()
        };
        let mut h = Harness::new(layer, Synth::new(shape, spec, 5), context, cpu).unwrap();
        (0..10)
            .map(|_| {
                let a = h.step().unwrap();
                (a, h.layer.stats().mass_estimated)
            })
            .collect()
    };
    // Steps 0..4 before the shift (the context's 2 probes took steps), 4.. after.
    let shifted = 4..10;
    let frozen = run(Recovery::Frozen, KeyCodes::Int8);
    let bounds = run(Recovery::BlockBounds { top: 32 }, KeyCodes::Int8);
    let target = Recovery::Mass(MassTarget::new(0.99, 0.5).unwrap());
    let mass = run(target, KeyCodes::Int8);
    // The int4 copy (whitened, with its admission margin) holds it too.
    let mass4 = run(target, KeyCodes::Int4);
    for t in shifted.clone() {
        let a = mass4[t].0;
        assert!(
            a.rel_err < 0.1 && a.recall > 0.97 && a.selected < 0.05,
            "step {t}: int4 mass selector {a:?}"
        );
        assert!(
            frozen[t].0.rel_err > 0.5 && frozen[t].0.recall < 0.1,
            "step {t}: the frozen rule should lose the shifted mass: {:?}",
            frozen[t].0
        );
        let (a, est) = mass[t];
        assert!(
            a.rel_err < 0.1 && a.recall > 0.97 && a.selected < 0.05,
            "step {t}: mass selector {a:?}"
        );
        let est = est.expect("the mass selector reports its estimate");
        assert!(
            (f64::from(est) - a.recall).abs() < 0.02,
            "step {t}: estimated mass {est} vs true recall {}",
            a.recall
        );
    }
    let mean = |r: &[(StepAccuracy, Option<f32>)]| {
        r[shifted.clone()].iter().map(|x| x.0.rel_err).sum::<f64>() / shifted.len() as f64
    };
    assert!(
        mean(&mass) < 0.02 && mean(&bounds) > 5.0 * mean(&mass),
        "mean error after the shift: mass {}, bounds {}",
        mean(&mass),
        mean(&bounds)
    );
    // Before the shift every rule holds the mass.
    for r in [&frozen, &bounds, &mass] {
        assert!(r[0].0.recall > 0.98, "{:?}", r[0].0);
    }
}

/// A max share below what the target needs sends every head to dense
/// attention for the step, counted, never silently: the step is then full
/// attention.
#[test]
fn mass_selector_falls_back_to_dense_and_says_so() {
    let shape = AttnShape::new(4, 2, 16).unwrap();
    let cfg = HybridConfig {
        window: 32,
        block: 8,
        recovery: Recovery::Mass(MassTarget::new(0.999, 0.01).unwrap()),
        ..HybridConfig::default()
    };
    let mut hy = HybridAttention::<_, _, f32>::cpu(shape, cfg).unwrap();
    let mut full = FullAttention::<f32>::new(shape, hgca_cpu::CpuBackend::new()).unwrap();
    let mut rng = Rng::new(9);
    for n in [200usize, 1, 1, 1] {
        let q = tokens(&mut rng, n, shape.q_len(), 1.0);
        let k = tokens(&mut rng, n, shape.kv_token_len(), 1.0);
        let v = tokens(&mut rng, n, shape.kv_token_len(), 1.0);
        let (mut a, mut b) = (vec![0.0; n * 64], vec![0.0; n * 64]);
        hy.forward(&q, &k, &v, n, &mut a).unwrap();
        full.forward(&q, &k, &v, n, &mut b).unwrap();
        if n == 1 {
            let st = hy.stats();
            assert_eq!(st.dense_heads, 2, "{st:?}");
            assert_eq!(st.selected, 2 * hy.cpu_tokens(), "{st:?}");
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 2e-5, "{x} vs {y}");
            }
        }
    }
}
