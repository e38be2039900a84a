//! Developer tool: time of the selection helpers of a hybrid decode step on
//! one KV head of the 128k demo (1537 blocks of 64 keys, a GQA group of 4,
//! d = 128, f16 bounds; 98k MAW entries), data hot in cache, one thread.
//!
//! `cargo run --release -p hgca-cpu --example select_speed [isa]`

use std::time::{Duration, Instant};

use hgca_cpu::{CpuBackend, IsaKind, Par};
use hgca_kernels::f16;

fn per_call(reps: u32, mut f: impl FnMut()) -> Duration {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed() / reps
}

fn main() -> Result<(), hgca_kernels::Error> {
    let kind = match std::env::args().nth(1).as_deref() {
        Some("v3") => IsaKind::V3,
        Some("scalar") => IsaKind::Scalar,
        _ => hgca_cpu::Isa::detect().kind(),
    };
    let cpu = CpuBackend::new().with_isa(kind)?.with_par(Par::Seq)?;
    let (d, blocks, group, entries) = (128, 1537, 4, 98_368);
    let bounds: Vec<f16> = (0..blocks * 2 * d)
        .map(|i| f16::from_f32(((i * 7919) % 1000) as f32 / 500.0 - 1.0))
        .collect();
    let q: Vec<f32> = (0..group * d)
        .map(|i| ((i * 31) % 100) as f32 / 50.0 - 1.0)
        .collect();
    let mut ub = vec![0f32; blocks * group];
    for _ in 0..3 {
        let t = per_call(300, || {
            cpu.block_upper_bounds(&q, group, d, &bounds, &mut ub)
                .expect("lengths fit");
        });
        println!(
            "{kind:?} block_upper_bounds: {t:?} per head, {:.1} ns per block",
            t.as_nanos() as f64 / blocks as f64
        );
    }
    let maw: Vec<f32> = (0..entries).map(|i| ((i * 7919) % 1000) as f32).collect();
    let mut idx = Vec::with_capacity(entries);
    let t = per_call(300, || {
        idx.clear();
        cpu.indices_above(&maw, 900.0, 0, &mut idx);
    });
    println!(
        "{kind:?} indices_above: {t:?} per head ({} of {entries} pass)",
        idx.len()
    );
    let mut avg = vec![0.5f32; entries];
    let w: Vec<f32> = (0..group * entries).map(|i| (i % 7) as f32 / 7.0).collect();
    let c = [0.1f32; 4];
    let t = per_call(300, || {
        cpu.decay_accumulate(&mut avg, None, 0.9, &w, entries, &c)
            .expect("lengths fit");
    });
    println!("{kind:?} decay_accumulate, {entries} contiguous: {t:?} per head");
    let sel: Vec<u32> = (0..entries as u32).step_by(10).collect();
    let t = per_call(300, || {
        cpu.decay_accumulate(&mut avg, Some(&sel), 0.9, &w, sel.len(), &c)
            .expect("lengths fit");
    });
    println!(
        "{kind:?} decay_accumulate, {} gathered: {t:?} per head",
        sel.len()
    );
    // The int8 and int4 estimates of the mass selector: a group of 7 over 32k keys
    // of d = 64 (Qwen2.5-0.5B at 32k), SmolLM2-135M at 8k (a group of 3
    // over the 6016 CPU entries), and the 128k demo's head.
    for (group, n, d) in [
        (7usize, 32_768usize, 64usize),
        (3, 6016, 64),
        (4, entries, 128),
    ] {
        let mut keys = hgca_cpu::Int8Keys::new(d);
        let mut keys4 = hgca_cpu::Int4Keys::new(d);
        for j in 0..n {
            let row: Vec<f32> = (0..d)
                .map(|i| (((j * d + i) * 7919) % 255) as f32 - 127.0)
                .collect();
            keys.push(&row);
            keys4.push(&row);
        }
        let q: Vec<f32> = (0..group * d)
            .map(|i| ((i * 31) % 200) as f32 / 100.0 - 1.0)
            .collect();
        let off = vec![1.0f32; group];
        let mut est = vec![0f32; n];
        let t = per_call(50, || {
            cpu.int8_max_scores(&q, &off, d, keys.codes(), keys.scales(), &mut est)
                .expect("lengths fit");
        });
        println!(
            "{kind:?} int8_max_scores, group {group}, {n} keys of d {d}: {t:?} per head, {:.1} GMAC/s, {:.1} GB/s of codes",
            (group * n * d) as f64 / t.as_secs_f64() / 1e9,
            (n * d) as f64 / t.as_secs_f64() / 1e9
        );
        let t = per_call(50, || {
            cpu.int4_max_scores(&q, &off, d, keys4.codes(), keys4.scales(), &mut est)
                .expect("lengths fit");
        });
        println!(
            "{kind:?} int4_max_scores, group {group}, {n} keys of d {d}: {t:?} per head, {:.1} GMAC/s, {:.1} GB/s of codes",
            (group * n * d) as f64 / t.as_secs_f64() / 1e9,
            (n * d) as f64 / 2.0 / t.as_secs_f64() / 1e9
        );
    }
    Ok(())
}
