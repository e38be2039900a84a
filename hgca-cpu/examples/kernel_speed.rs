//! Developer tool: ns per token of the CPU decode kernel at several cache
//! levels, one thread by default, to tell compute limits from memory limits.
//!
//! `cargo run --release -p hgca-cpu --example kernel_speed [isa] [max_tokens] [threads]`
//! (with `threads`, ns per row are wall time: divide the row rate by the
//! threads for each one's share).

use std::time::Instant;

use hgca_cpu::{CpuBackend, IsaKind, Par};
use hgca_kernels::{
    AttnShape, HostBuf, KvSlices, Partial, PartialLayout, Selection, SparseAttention, f16,
};

fn main() -> Result<(), hgca_kernels::Error> {
    let kind = match std::env::args().nth(1).as_deref() {
        Some("v3") => IsaKind::V3,
        Some("scalar") => IsaKind::Scalar,
        _ => hgca_cpu::Isa::detect().kind(),
    };
    let par = match std::env::args().nth(3).and_then(|s| s.parse().ok()) {
        Some(t) if t > 1 => Par::Rayon(t),
        _ => Par::Seq,
    };
    let b = CpuBackend::new().with_isa(kind)?.with_par(par)?;
    let shape = AttnShape::new(32, 8, 128)?;
    let max: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(usize::MAX);
    for tokens in [256usize, 2048, 16384, 131072, 262144]
        .into_iter()
        .filter(|&t| t <= max)
    {
        let n = 8 * tokens * 128;
        // Host memory as hgca's stores get it (transparent huge pages).
        let k = HostBuf::from_slice(
            &(0..n)
                .map(|i| f16::from_f32(((i * 7919) % 1000) as f32 / 1000.0 - 0.5))
                .collect::<Vec<_>>(),
        )?;
        let v = k.clone();
        let kv = KvSlices::new(8, 128, tokens, &k, &v)?;
        let q: Vec<f32> = (0..32 * 128).map(|i| (i % 17) as f32 / 17.0).collect();
        let mut out = Partial::empty(PartialLayout::decode(&shape));
        let sel = Selection::all(8, tokens);
        // Every 10th-ish token, at pseudo-random spacing: a sparse gather.
        let mut x = 0x9E37_79B9u32;
        let sparse10: Vec<Vec<u32>> = (0..8)
            .map(|_| {
                (0..tokens as u32)
                    .filter(|_| {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        x.is_multiple_of(10)
                    })
                    .collect()
            })
            .collect();
        let sel10 = Selection::from_heads(&sparse10);
        let reps = if max == usize::MAX {
            (1 << 24) / (8 * tokens)
        } else {
            (1 << 21) / (8 * tokens)
        };
        let mut w = vec![0f32; 32 * tokens];
        for (name, sparse, weights) in [
            ("dense", false, false),
            ("dense+w", false, true),
            ("sparse-all", true, false),
            ("sparse-10%", true, true),
        ] {
            // The fastest of the repetitions: the host's other load only
            // ever adds time.
            let mut per = f64::MAX;
            for _ in 0..reps.max(3) {
                let t = Instant::now();
                if sparse && weights {
                    b.sparse_decode(&shape, &q, &kv, &sel10, out.as_mut(), None)?;
                } else if sparse {
                    b.sparse_decode(&shape, &q, &kv, &sel, out.as_mut(), None)?;
                } else {
                    let w = weights.then_some(&mut w[..]);
                    b.dense_decode(&shape, &q, &kv, out.as_mut(), w)?;
                }
                per = per.min(t.elapsed().as_secs_f64());
            }
            let rows = if sparse && weights {
                sel10.total() as f64
            } else {
                (8 * tokens) as f64
            };
            println!(
                "{} {name:>10} n={tokens:>6} KV {:>6} KiB: {:>6.1} ns per KV row (4 heads), {:>5.1} GB/s",
                b.isa(),
                n * 4 / 1024,
                per / rows * 1e9,
                rows * 512.0 / per / 1e9
            );
        }
    }
    Ok(())
}
