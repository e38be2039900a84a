//! Developer tool: per-step accuracy of the hybrid layer on the synthetic workload.
//! `cargo run --release -p hgca-eval --example harness_steps [context] [steps] [recovery] [shift|scatter]`
//! (`recovery` as `--recovery` takes it: frozen, rescore:16, bounds:32, mass:0.99).
use hgca_cpu::CpuBackend;
use hgca_eval::{Harness, Scattered, Synth, SynthSpec};
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery};
use hgca_kernels::{AttnShape, f16};

fn main() -> Result<(), hgca_kernels::Error> {
    let args: Vec<String> = std::env::args().collect();
    let context: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(16384);
    let steps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(32);
    let recovery: Recovery = args.get(3).map_or(Ok(Recovery::Frozen), |s| s.parse())?;
    let shift = args.get(4).map(String::as_str);
    // The scattered shift: 48 needles, one per 64-token block of the CPU store.
    let scattered = (shift == Some("scatter")).then_some(Scattered {
        count: 48,
        stride: (context - context / 4) / 48,
        logit: 12.0,
    });
    let shape = AttnShape::new(8, 2, 64)?;
    let cfg = HybridConfig {
        window: context / 4,
        block: 64,
        recovery,
        ..HybridConfig::default()
    };
    let cpu = CpuBackend::new();
    let layer = HybridAttention::<_, _, f16>::new(shape, cfg, cpu.clone(), cpu.clone())?;
    let spec = SynthSpec {
        shift_at: shift.is_some().then_some(steps / 4),
        scattered,
        ..SynthSpec::default()
    };
    let mut h = Harness::new(layer, Synth::new(shape, spec, 7), context, cpu)?;
    for t in 0..steps {
        let a = h.step()?;
        let st = h.layer.stats();
        println!(
            "step {t:>3}: recall {:.4} rel_err {:.2e} selected {:.4} est {:?} dense heads {} int8 rows {}",
            a.recall,
            a.rel_err,
            a.selected,
            st.mass_estimated,
            st.dense_heads,
            st.estimated_entries
        );
    }
    Ok(())
}
