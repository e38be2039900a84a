//! Concurrency stress on one shared CPU backend: 8 threads x 1000 decode
//! steps of distinct sequences, each thread with its own hybrid layer, bit
//! for bit what the sequences give one at a time, within a deadline.

use hgca_cpu::{CpuBackend, Par};
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
use hgca_kernels::AttnShape;
use hgca_testkit::stress::{Decoder, shared_backend_stress, within_secs};

/// A decoder over a layer's `forward`.
fn decoder(mut l: impl SequenceAttention) -> impl Decoder {
    move |q: &[f32], k: &[f32], v: &[f32], n: usize, out: &mut [f32]| l.forward(q, k, v, n, out)
}

fn cfg(recovery: Recovery) -> HybridConfig {
    HybridConfig {
        window: 64,
        block: 16,
        sinks: 4,
        recovery,
        ..HybridConfig::default()
    }
}

#[test]
fn eight_threads_share_one_cpu_backend() {
    within_secs(900, || {
        let shape = AttnShape::new(4, 2, 16).unwrap();
        for (par, recovery) in [
            (Par::Seq, Recovery::BlockBounds { top: 4 }),
            (Par::Rayon(2), Recovery::Rescore { every: 7 }),
        ] {
            let cpu = CpuBackend::new().with_par(par).unwrap();
            let make = || {
                decoder(
                    HybridAttention::<_, _, f32>::cpu_on(shape, cfg(recovery), cpu.clone())
                        .unwrap(),
                )
            };
            let t = std::time::Instant::now();
            let steps = shared_backend_stress(&make, &shape, 8, 96, 1000);
            println!(
                "cpu {par:?} {recovery:?}: {steps} concurrent decode steps, equal bit for bit, in {:.1?}",
                t.elapsed()
            );
        }
    });
}
