//! Developer tool: per-step accuracy of the hybrid layer on the synthetic workload.
//! `cargo run --release -p hgca-hybrid --example harness_steps [context] [steps] [frozen|rescore|bounds] [shift]`
use hgca_cpu::CpuBackend;
use hgca_hybrid::synthetic::{Harness, Synth, SynthSpec};
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery};
use hgca_kernels::{AttnShape, f16};

fn main() -> Result<(), hgca_kernels::Error> {
    let args: Vec<String> = std::env::args().collect();
    let context: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(16384);
    let steps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(32);
    let recovery = match args.get(3).map(String::as_str) {
        Some("rescore") => Recovery::Rescore { every: 16 },
        Some("bounds") => Recovery::BlockBounds { top: 32 },
        _ => Recovery::Frozen,
    };
    let shift = args.get(4).is_some_and(|s| s == "shift");
    let shape = AttnShape::new(32, 8, 128)?;
    let cfg = HybridConfig {
        window: context / 4,
        block: 64,
        recovery,
        ..HybridConfig::default()
    };
    let cpu = CpuBackend::new();
    let layer = HybridAttention::<_, _, f16>::new(shape, cfg, cpu.clone(), cpu.clone())?;
    let spec = SynthSpec {
        shift_at: shift.then_some(steps / 4),
        ..SynthSpec::default()
    };
    let mut h = Harness::new(layer, Synth::new(shape, spec, 7), context, cpu)?;
    for t in 0..steps {
        let a = h.step()?;
        println!(
            "step {t:>3}: recall {:.4} rel_err {:.2e} selected {:.4}",
            a.recall, a.rel_err, a.selected
        );
    }
    Ok(())
}
