//! One run of the hybrid layer on the synthetic workload: its configuration
//! from the arguments, the decode steps on the chosen backend, and the
//! [`Summary`] of accuracy and time they return.

use std::time::Duration;

use hgca_cpu::CpuBackend;
use hgca_eval::{Harness, StepAccuracy, Synth, SynthSpec};
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery};
use hgca_kernels::{AttnShape, DenseAttention, Error, Result, f16};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{Args, Rule};

fn shape() -> AttnShape {
    AttnShape::new(32, 8, 128).expect("a valid shape")
}

pub(crate) fn config(a: &Args, rule: Rule, window_ratio: f64, beta: f32) -> HybridConfig {
    let window = ((a.context as f64 * window_ratio) as usize / a.block).max(1) * a.block;
    let recovery = match rule {
        Rule::Fixed(r) => r,
        Rule::BoundsShare(p) => {
            let blocks = a.context.saturating_sub(window).div_ceil(a.block);
            Recovery::BlockBounds {
                top: ((p * blocks as f64).ceil() as usize).max(1),
            }
        }
    };
    HybridConfig {
        window,
        block: a.block,
        sinks: 4,
        beta,
        recovery,
        ..HybridConfig::default()
    }
}

fn spec(a: &Args) -> SynthSpec {
    SynthSpec {
        shift_at: a.shift.then_some(a.steps / 4),
        ..SynthSpec::default()
    }
}

/// Results of one run.
#[derive(Debug, Default, Clone)]
pub(crate) struct Summary {
    pub(crate) backend: String,
    pub(crate) acc: Vec<StepAccuracy>,
    pub(crate) dense: Duration,
    pub(crate) dense_submit: Duration,
    pub(crate) select: Duration,
    pub(crate) sparse: Duration,
    pub(crate) merge: Duration,
    pub(crate) total: Duration,
    /// Dense CPU attention over every token, timed after each step (summed).
    pub(crate) full: Duration,
    /// The dense side of a step timed alone (no CPU work beside it).
    pub(crate) dense_alone: Duration,
    pub(crate) window: usize,
    pub(crate) cpu_tokens: usize,
    /// The dense side runs on the CPU too (the CPU backend, or wgpu on a
    /// software driver): the two sides share the cores, so there is no
    /// overlap to report.
    pub(crate) shares_cpu: bool,
}

impl Summary {
    pub(crate) fn mean(&self, f: impl Fn(&StepAccuracy) -> f64) -> f64 {
        self.acc.iter().map(f).sum::<f64>() / self.acc.len().max(1) as f64
    }
    pub(crate) fn min_recall(&self) -> f64 {
        self.min(|a| a.recall)
    }
    pub(crate) fn min(&self, f: impl Fn(&StepAccuracy) -> f64) -> f64 {
        self.acc.iter().map(f).fold(1.0, f64::min)
    }
    pub(crate) fn max(&self, f: impl Fn(&StepAccuracy) -> f64) -> f64 {
        self.acc.iter().map(f).fold(0.0, f64::max)
    }
}

fn run<D: DenseAttention>(
    dense: D,
    name: String,
    a: &Args,
    cfg: HybridConfig,
    quiet: bool,
) -> Result<Summary> {
    let cpu = CpuBackend::new();
    let layer =
        HybridAttention::<D, CpuBackend, f16>::new(shape(), cfg.clone(), dense, cpu.clone())?;
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new((a.context + a.steps) as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} tokens {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message("context");
    let mut h = Harness::new(layer, Synth::new(shape(), spec(a), 7), a.context, cpu)?;
    bar.set_position(a.context as u64);
    bar.set_message("decode");
    let mut s = Summary {
        backend: name,
        window: cfg.window,
        ..Summary::default()
    };
    for _ in 0..a.steps {
        s.acc.push(h.step()?);
        // The baseline right after each step, so the host's changing load
        // (memory bandwidth shared with other machines) hits both alike.
        s.full += h.time_full_decode()?;
        let st = h.layer.stats();
        s.dense += st.dense;
        s.dense_submit += st.dense_submit;
        s.select += st.select;
        s.sparse += st.sparse;
        s.merge += st.merge;
        s.total += st.total;
        bar.inc(1);
    }
    bar.finish_and_clear();
    s.cpu_tokens = h.layer.cpu_tokens();
    let q = vec![0.5f32; shape().q_len()];
    let mut best = Duration::MAX;
    for _ in 0..5 {
        best = best.min(h.layer.time_dense_alone(&q)?);
    }
    s.dense_alone = best;
    Ok(s)
}

/// Runs on the backend asked for (or the best found).
pub(crate) fn run_best(a: &Args, cfg: HybridConfig, quiet: bool) -> Result<Summary> {
    let want = a.backend.as_str();
    #[cfg(feature = "cuda")]
    if want == "cuda" || want == "auto" {
        match hgca_gpu::cuda::CudaBackend::new() {
            Ok(b) => {
                let name = b.name();
                return run(b, name, a, cfg, quiet);
            }
            Err(e) if want == "cuda" => return Err(e),
            Err(e) if !quiet => eprintln!("CUDA: {}", hgca_kernels::report(&e)),
            Err(_) => {}
        }
    }
    #[cfg(feature = "wgpu")]
    if want == "wgpu" || want == "auto" {
        match hgca_gpu::wgpu::WgpuBackend::new() {
            Ok(b) if want == "wgpu" || b.adapter_info().device_type != "Cpu" => {
                let name = b.name();
                let software = b.adapter_info().device_type == "Cpu";
                let mut s = run(b, name, a, cfg, quiet)?;
                s.shares_cpu = software;
                return Ok(s);
            }
            Ok(b) if !quiet => eprintln!(
                "wgpu: adapter \"{}\" is a software (CPU) driver: the CPU backend is faster, using it",
                b.adapter_info().name
            ),
            Err(e) if want == "wgpu" => return Err(e),
            Err(e) if !quiet => eprintln!("wgpu: {}", hgca_kernels::report(&e)),
            _ => {}
        }
    }
    match want {
        "auto" | "cpu" => {}
        "cuda" | "wgpu" => {
            let (backend, feature) = if want == "cuda" {
                ("cuda", "cuda")
            } else {
                ("wgpu", "wgpu")
            };
            return Err(Error::NotCompiledIn { backend, feature });
        }
        _ => {
            return Err(Error::unavailable(
                "demo",
                format!("unknown --backend {want}: expected auto, cpu, wgpu or cuda"),
            ));
        }
    }
    let cpu = CpuBackend::new();
    let name = cpu.name();
    let mut s = run(cpu, name, a, cfg, quiet)?;
    s.shares_cpu = true;
    Ok(s)
}
