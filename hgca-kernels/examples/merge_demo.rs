//! Builds two partials over a split token set, merges them, and prints the
//! error against the f64 reference over the union.
//!
//! `cargo run --release -p hgca-kernels --example merge_demo`

use hgca_kernels::{AttnShape, Partial, PartialLayout, merge};
use hgca_testkit::{Problem, Rng, conformance::rows_to_partial};

fn main() -> Result<(), hgca_kernels::Error> {
    let shape = AttnShape::new(32, 8, 128)?;
    let tokens = 4096;
    let p = Problem::<f32>::random(shape, tokens, 10.0, 42);
    // GPU side: the most recent 1024 tokens; CPU side: a random 10% of the rest.
    let mut rng = Rng::new(7);
    let gpu: Vec<usize> = (tokens - 1024..tokens).collect();
    let cpu: Vec<usize> = (0..tokens - 1024).filter(|_| rng.below(10) == 0).collect();
    let union: Vec<usize> = cpu.iter().chain(&gpu).copied().collect();
    let layout = PartialLayout::decode(&shape);
    let part = |set: &Vec<usize>| {
        rows_to_partial(layout, &p.reference(&vec![set.clone(); shape.kv_heads()]))
    };
    let (a, b) = (part(&gpu), part(&cpu));
    let mut merged = Partial::poisoned(layout);
    merge(&[a.as_ref(), b.as_ref()], merged.as_mut())?;
    let want = p.reference(&vec![union; shape.kv_heads()]);
    let (mut out_err, mut lse_err) = (0.0f64, 0.0f64);
    for (h, w) in want.iter().enumerate() {
        lse_err = lse_err.max((merged.lse()[h] as f64 - w.lse).abs());
        for (x, y) in merged.out()[h * 128..(h + 1) * 128].iter().zip(&w.out) {
            out_err = out_err.max((*x as f64 - y).abs());
        }
    }
    println!("hgca merge demo: q_heads 32, kv_heads 8, d 128, {tokens} tokens");
    println!(
        "  GPU partial: {} tokens, CPU partial: {} tokens",
        gpu.len(),
        cpu.len()
    );
    println!(
        "  merged vs f64 reference over the union: max |out err| = {out_err:.2e}, max |lse err| = {lse_err:.2e}"
    );
    Ok(())
}
