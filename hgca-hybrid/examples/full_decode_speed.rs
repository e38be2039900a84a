//! Developer tool: one decode step of exact full attention
//! ([`FullAttention`], f16 KV) in a model's shape, as hgca-llm calls it
//! once per layer: µs per call and the K/V bytes it reads per second.
//!
//! `cargo run --release -p hgca-hybrid --example full_decode_speed [context] [threads] [q_heads kv_heads d] [evict]`
//! (default 2048 tokens, 1 thread, SmolLM2-135M's 9 / 3 / 64).

use std::time::Instant;

use hgca_cpu::{CpuBackend, Par};
use hgca_hybrid::{FullAttention, SequenceAttention};
use hgca_kernels::{AttnShape, f16};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = |i: usize, d: usize| -> usize {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let (context, threads) = (arg(1, 2048), arg(2, 1));
    let shape = AttnShape::new(arg(3, 9), arg(4, 3), arg(5, 64))?;
    let cpu = CpuBackend::new().with_par(Par::from_threads(threads))?;
    let mut a = FullAttention::<f16>::new(shape, cpu)?;
    let (ql, kl) = (shape.q_len(), shape.kv_heads() * shape.head_dim());
    let chunk = 512;
    let x = |n: usize, s: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + s) % 1000) as f32 / 1000.0 - 0.5)
            .collect()
    };
    let mut done = 0;
    while done < context {
        let n = chunk.min(context - done);
        let mut out = vec![0.0; n * ql];
        a.forward(&x(n * ql, 1), &x(n * kl, 2), &x(n * kl, 3), n, &mut out)?;
        done += n;
    }
    let steps = 200;
    let (q, k, v) = (x(ql, 4), x(kl, 5), x(kl, 6));
    let mut out = vec![0.0; ql];
    // With `evict`, a 256 MiB buffer is read between steps (untimed), as a
    // model's weights pass through the cache between two layers' attention.
    let evict = std::env::args().any(|a| a == "evict");
    let junk = vec![1u8; if evict { 256 << 20 } else { 0 }];
    let mut sum = 0u64;
    let mut spent = 0.0;
    for _ in 0..steps {
        sum += junk.iter().step_by(64).map(|&b| b as u64).sum::<u64>();
        let t = Instant::now();
        a.forward(&q, &k, &v, 1, &mut out)?;
        spent += t.elapsed().as_secs_f64();
    }
    std::hint::black_box(sum);
    let per = spent / steps as f64;
    let bytes = (context + steps / 2) * kl * 2 * 2;
    println!(
        "{shape:?} context {context}, {threads} thread(s): {:.1} µs per decode step, {:.2} GB/s of K/V",
        per * 1e6,
        bytes as f64 / per / 1e9
    );
    Ok(())
}
