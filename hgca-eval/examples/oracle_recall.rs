//! Developer tool: the best attention-mass recall any selection could reach
//! on the demo's synthetic workload, per query head, for a given share of
//! the CPU entries selected. The oracle sees the exact weights: per KV head
//! it keeps the CPU entries with the largest weight summed over the group
//! (one selection serves the group, as in the engine), plus the window.
//! If the oracle's worst head stays under 99%, no selection rule can do
//! better on this workload at that share.
//!
//! `cargo run --release -p hgca-eval --example oracle_recall [context] [queries]`
use hgca_cpu::CpuBackend;
use hgca_eval::{Synth, SynthSpec};
use hgca_kernels::{AttnShape, KvStore, Partial, PartialLayout, f16};

fn main() -> Result<(), hgca_kernels::Error> {
    let args: Vec<String> = std::env::args().collect();
    let context: usize = args
        .get(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(128 << 10);
    let queries: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4);
    let shape = AttnShape::new(32, 8, 128)?;
    let (group, hk) = (shape.group(), shape.kv_heads());
    // As the demo: window 0.25 of the context, in blocks of 64.
    let window = (context / 4 / 64).max(1) * 64;
    let n_cpu = context - window;
    let mut synth = Synth::new(shape, SynthSpec::default(), 7);
    let mut all = KvStore::<f16>::new(hk, shape.head_dim(), 1024)?;
    let mut done = 0;
    while done < context {
        let n = (context - done).min(8192);
        let (k, v) = synth.kv(n);
        let conv = |x: Vec<f32>| x.into_iter().map(f16::from_f32).collect::<Vec<_>>();
        all.push_token_major(n, &conv(k), &conv(v))?;
        done += n;
        let _ = synth.query();
    }
    let cpu = CpuBackend::new();
    let shares = [0.05, 0.10, 0.25, 0.50];
    println!(
        "context {context}, window {window}, {n_cpu} CPU entries; recall of the best selection, per query head"
    );
    println!(
        "{:>6} {:>8} {:>10} {:>10} {:>10}",
        "query", "share", "mean", "worst", "window"
    );
    for t in 0..queries {
        let q = synth.query();
        let mut part = Partial::empty(PartialLayout::decode(&shape));
        let mut w = vec![0.0f32; shape.q_heads() * context];
        cpu.dense_decode(&shape, &q, &all, part.as_mut(), Some(&mut w))?;
        let win_mass = |h: usize| {
            w[h * context + n_cpu..(h + 1) * context]
                .iter()
                .map(|&x| x as f64)
                .sum::<f64>()
        };
        for &share in &shares {
            let k = (share * n_cpu as f64).round() as usize;
            let (mut sum, mut worst) = (0.0f64, f64::INFINITY);
            let mut worst_win = 0.0;
            for g in 0..hk {
                // The group's summed weight of each CPU entry, largest first.
                let mut order: Vec<(f32, usize)> = (0..n_cpu)
                    .map(|j| {
                        (
                            (0..group).map(|i| w[(g * group + i) * context + j]).sum(),
                            j,
                        )
                    })
                    .collect();
                order.select_nth_unstable_by(k.min(n_cpu.saturating_sub(1)), |a, b| {
                    b.0.total_cmp(&a.0)
                });
                for i in 0..group {
                    let h = g * group + i;
                    let picked: f64 = order[..k]
                        .iter()
                        .map(|&(_, j)| w[h * context + j] as f64)
                        .sum();
                    let r = win_mass(h) + picked;
                    sum += r;
                    if r < worst {
                        worst = r;
                        worst_win = win_mass(h);
                    }
                }
            }
            println!(
                "{t:>6} {:>7.0}% {:>9.4}% {:>9.4}% {:>9.4}%",
                100.0 * share,
                100.0 * sum / shape.q_heads() as f64,
                100.0 * worst,
                100.0 * worst_win
            );
        }
    }
    Ok(())
}
