//! The mass selector's score estimate (`CpuBackend::int4_max_scores`, the
//! default int4 key copy, and `int8_max_scores`) over one KV head's CPU
//! entries at an 8k context with a window of a quarter (6144 entries), on
//! the models' shapes: SmolLM2-135M (a group of 3 query heads, d 64),
//! Qwen2.5-0.5B (7, d 64) and Gemma 3 270M (4, d 256). Eight heads' copies
//! are taken in turn, so the codes come from memory as in a model's decode
//! step. One thread (the hybrid layer runs the KV heads on its threads);
//! each int4 kernel path the machine has (portable, AVX2, AVX-512 VNNI)
//! and the int8 kernel per ISA.
//!
//! Ids: `select/{kind}/{path}/{model}`. GB/s counts the codes and scales
//! read; the line after the table gives each one's multiply-adds per second
//! (group x entries x d per call).

use hgca_benches::{Probe, Report, criterion, fill, par};
use hgca_cpu::{CpuBackend, Int4Keys, Int8Keys, Isa, QDotPath};

const N: usize = 6144;
const COPIES: usize = 8;

fn main() {
    let probe = Probe::measure();
    let rep = Report::default();
    let mut crit = criterion(300, 1000);
    let mut macs = Vec::new();
    for (model, group, d) in [
        ("smollm2", 3usize, 64usize),
        ("qwen2", 7, 64),
        ("gemma3", 4, 256),
    ] {
        let rows: Vec<Vec<f32>> = (0..COPIES).map(|c| fill(N * d, c as u64)).collect();
        let k4: Vec<Int4Keys> = rows
            .iter()
            .map(|r| {
                let mut k = Int4Keys::new(d);
                r.chunks_exact(d).for_each(|x| k.push(x));
                k
            })
            .collect();
        let k8: Vec<Int8Keys> = rows
            .iter()
            .map(|r| {
                let mut k = Int8Keys::new(d);
                r.chunks_exact(d).for_each(|x| k.push(x));
                k
            })
            .collect();
        let q = fill(group * d, 99);
        let off = vec![0.5f32; group];
        let mut out = vec![0f32; N];
        let mut seen: Vec<QDotPath> = Vec::new();
        for isa in Isa::available() {
            let cpu = CpuBackend::new()
                .with_isa(isa.kind())
                .and_then(|c| c.with_par(par(1)))
                .expect("a detected ISA");
            let path = CpuBackend::qmatvec_path(isa);
            let mut bench = |id: String, bytes: usize, f: &mut dyn FnMut(usize)| {
                let mut m = 0;
                rep.bench(
                    &mut crit,
                    "select",
                    &id,
                    (bytes as u64, bytes * COPIES, 1),
                    || {
                        m = (m + 1) % COPIES;
                        f(m);
                    },
                );
                macs.push((id, group * N * d));
            };
            if !seen.contains(&path) {
                seen.push(path);
                bench(
                    format!("select/int4/{path:?}/{model}"),
                    k4[0].codes().len() + 4 * N,
                    &mut |m| {
                        let k = &k4[m];
                        cpu.int4_max_scores(&q, &off, d, k.codes(), k.scales(), &mut out)
                            .expect("a valid call");
                    },
                );
            }
            bench(
                format!("select/int8/{:?}/{model}", isa.kind()),
                k8[0].codes().len() + 4 * N,
                &mut |m| {
                    let k = &k8[m];
                    cpu.int8_max_scores(&q, &off, d, k.codes(), k.scales(), &mut out)
                        .expect("a valid call");
                },
            );
        }
    }
    rep.print(&probe, |_| None);
    println!();
    for (id, n) in macs {
        if let Some(t) = rep.mean(&id) {
            println!("{id:<40} {:>8.1} GMAC/s", n as f64 / t / 1e9);
        }
    }
    crit.final_summary();
}
