//! hgca's demo.
//!
//! ```text
//! hgca-demo [hybrid] [--context N] [--window-ratio R] [--block B] [--beta X]
//!                    [--steps S] [--recovery frozen|rescore:R|bounds:K|bounds:P%|mass:P[:S]] [--shift]
//!                    [--backend auto|cpu|wgpu|cuda] [--json]
//! hgca-demo harness  [--context N] [--steps S]        rules x workloads table
//! hgca-demo sweep    [--context N] [--steps S] [--out FILE.svg]
//! ```
//!
//! `hybrid` runs a long-context decode (synthetic context with sinks,
//! topics, needles) on the best backend the machine has: CUDA, else a wgpu
//! GPU adapter, else the CPU in both roles; it prints accuracy against full
//! attention and the time per step split into dense / sparse / merge.

mod args;
mod harness;
mod hybrid;
mod plan;
mod run;
mod sweep;

fn main() {
    let a = match args::parse() {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            std::process::exit(2);
        }
    };
    let r = match a.cmd.as_str() {
        "hybrid" => hybrid::hybrid(&a),
        "harness" => harness::harness(&a),
        "sweep" => sweep::sweep(&a),
        "plan" => plan::plan(&a),
        other => {
            eprintln!("unknown command {other}\n{}", include_str!("usage.txt"));
            std::process::exit(2);
        }
    };
    if let Err(e) = r {
        eprintln!("error: {}", hgca_kernels::report(&e));
        std::process::exit(1);
    }
}
