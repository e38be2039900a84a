//! Soak: one hybrid layer (CPU in both roles) decodes a million tokens, one
//! step at a time, on synthetic data. Checks, and fails otherwise:
//! - resident memory grows by the KV store's bytes and nothing else (no
//!   scratch, staging or weight buffer growing per step): growth within 5%
//!   of the K and V bytes appended, measured after a warm-up;
//! - the last step's output equals hgca-ref (f64) over the tokens it
//!   attended (the window and the selected CPU entries).
//!
//! `cargo run --release -p hgca-hybrid --example soak [tokens] [threads]` (the test
//! command runs it). Every token's K and V are a hash of its position, so
//! the check regenerates the rows it needs instead of keeping a copy (which
//! would double the memory measured).

use std::time::Instant;

use hgca_cpu::{CpuBackend, Par};
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
use hgca_kernels::AttnShape;

/// A value in [-1, 1) from (stream, token, element): splitmix64.
fn hashed(stream: u64, token: usize, i: usize) -> f32 {
    let mut z = stream
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((token as u64) << 20 | i as u64)
        .wrapping_add(0x6a09_e667_f3bc_c908);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Token `j`'s K, V (`[kv_heads, d]`) and q (`[q_heads, d]`).
fn token(shape: &AttnShape, j: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (kl, ql) = (shape.kv_token_len(), shape.q_len());
    let k = (0..kl).map(|i| 2.0 * hashed(1, j, i)).collect();
    let v = (0..kl).map(|i| hashed(2, j, i)).collect();
    let q = (0..ql).map(|i| 2.0 * hashed(3, j, i)).collect();
    (k, v, q)
}

/// Resident bytes of this process (`/proc/self/statm`), if readable.
fn rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tokens: usize = std::env::args()
        .nth(1)
        .map_or(Ok(1_000_000), |s| s.parse())?;
    let shape = AttnShape::new(4, 1, 32)?;
    let cfg = HybridConfig {
        window: 1024,
        block: 256,
        sinks: 4,
        // A selective threshold: a few entries in a thousand pass.
        beta: 8.0,
        recovery: Recovery::BlockBounds { top: 2 },
        ..HybridConfig::default()
    };
    // One thread by default (`threads` = 2 runs the layer on its own pool):
    // the steps are small, and rayon's wake-ups would be most of the time.
    let threads: usize = std::env::args().nth(2).map_or(Ok(1), |s| s.parse())?;
    let cpu = CpuBackend::new().with_par(Par::from_threads(threads))?;
    let mut layer = HybridAttention::<_, _, f32>::cpu_on(shape, cfg, cpu)?;
    let ql = shape.q_len();
    let kv_bytes_per_token = 2 * shape.kv_token_len() * size_of::<f32>();
    let warm = tokens / 8;
    let mut out = vec![0.0; ql];
    let (mut rss0, mut selected) = (None, 0usize);
    let t0 = Instant::now();
    let report = (tokens / 8).max(1);
    for j in 0..tokens {
        let (k, v, q) = token(&shape, j);
        layer.forward(&q, &k, &v, 1, &mut out)?;
        selected += layer.stats().selected;
        if j + 1 == warm {
            rss0 = rss();
        }
        if (j + 1) % report == 0 {
            println!(
                "soak: {:>8} tokens, {:>6.1} s, rss {:>7.1} MiB, selected {:.2}% of CPU entries",
                j + 1,
                t0.elapsed().as_secs_f64(),
                rss().unwrap_or(0) as f64 / (1 << 20) as f64,
                100.0 * layer.stats().selected as f64 / layer.cpu_tokens().max(1) as f64,
            );
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "soak: {tokens} decode steps in {secs:.1} s ({:.1} us/step), {:.0} CPU entries attended per step on average",
        1e6 * secs / tokens as f64,
        selected as f64 / tokens as f64
    );

    // Memory: growth after the warm-up against the K/V bytes appended since.
    let mut failed = false;
    match (rss0, rss()) {
        (Some(a), Some(b)) => {
            let kv = ((tokens - warm) * kv_bytes_per_token) as f64;
            let grown = b as f64 - a as f64;
            let ratio = grown / kv;
            println!(
                "soak: rss grew {:.1} MiB over the last {} tokens; their K/V are {:.1} MiB: {:.3}x",
                grown / (1 << 20) as f64,
                tokens - warm,
                kv / (1 << 20) as f64,
                ratio
            );
            if (ratio - 1.0).abs() > 0.05 {
                eprintln!(
                    "soak: FAILED: memory grew by {ratio:.3}x the K/V bytes (bound 1 +- 0.05)"
                );
                failed = true;
            }
        }
        _ => println!("soak: SKIP memory check (no /proc/self/statm)"),
    }

    // Accuracy: the last step against hgca-ref over what it attended.
    let n = layer.len();
    let n_cpu = layer.cpu_tokens();
    let sel = layer.last_selection();
    let d = shape.head_dim();
    let (_, _, q) = token(&shape, tokens - 1);
    let mut set: Vec<usize> = sel.head(0).iter().map(|&j| j as usize).collect();
    set.extend(n_cpu..n);
    // Rows of just the attended tokens, re-indexed 0..set.len().
    let (mut kk, mut vv) = (Vec::new(), Vec::new());
    for &j in &set {
        let (k, v, _) = token(&shape, j);
        kk.extend(k);
        vv.extend(v);
    }
    let local: Vec<usize> = (0..set.len()).collect();
    let mut worst = 0.0f64;
    for h in 0..shape.q_heads() {
        let want = hgca_ref::attend_row(
            &q[h * d..(h + 1) * d],
            &kk,
            &vv,
            d,
            f64::from(shape.scale()),
            &local,
        );
        for (g, w) in out[h * d..(h + 1) * d].iter().zip(&want.out) {
            worst = worst.max((f64::from(*g) - w).abs());
        }
    }
    println!(
        "soak: last step over {} tokens ({} CPU entries selected of {n_cpu}): max |err| {worst:.2e} against hgca-ref",
        set.len(),
        set.len() - (n - n_cpu)
    );
    if worst > 1e-5 {
        eprintln!("soak: FAILED: the last step is {worst:.2e} off hgca-ref (bound 1e-5)");
        failed = true;
    }
    if failed {
        std::process::exit(1);
    }
    Ok(())
}
