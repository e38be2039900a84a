//! CUDA backend tests.
//!
//! - `nvrtc_ptxas_*`: compile every kernel with NVRTC for sm_80 and sm_90 and
//!   run `ptxas -v` on the PTX (no GPU needed). Without NVRTC or ptxas they
//!   skip with a printed reason, unless `nvrtc` is listed in `HGCA_REQUIRE`
//!   (`hgca_testkit::require`; CI lists it after `scripts/setup-cuda.sh`).
//! - `suite::*`: hgca-testkit's `dense_backend_suite!` on a real GPU, and
//!   `gpu_*`, what only CUDA has. Without a driver or a device they skip with
//!   a printed reason, unless `cuda` is listed (`scripts/gpu-check.sh`).
//! - `gpu_*ffn*`: the dense FFN (a hybrid FFN's hot neurons) against
//!   hgca-ref, and a hybrid FFN with CUDA as its dense side.
#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use rayon::prelude::*;

use hgca_gpu::cuda::{
    ATTENTION_KERNELS, CudaBackend, DECODE_KERNEL, FFN_CU, FFN_KERNELS, KernelSpec, MERGE_CU,
    MERGE_KERNELS, compile_ptx, nvrtc_available,
};
use hgca_kernels::{AttnShape, DType, Error, report};
use hgca_testkit::conformance::check_dense;
use hgca_testkit::require;

fn ptxas() -> Option<PathBuf> {
    let candidates = std::env::var_os("HGCA_PTXAS")
        .map(PathBuf::from)
        .into_iter()
        .chain(std::iter::once(PathBuf::from("ptxas")));
    candidates.into_iter().find(|p| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Registers and spills per entry function, from `ptxas -v`.
#[derive(Debug, Default, Clone)]
struct Usage {
    regs: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
}

fn parse_ptxas(log: &str) -> Vec<(String, Usage)> {
    let mut out: Vec<(String, Usage)> = Vec::new();
    let num_before = |line: &str, what: &str| -> u32 {
        line.find(what)
            .and_then(|i| line[..i].split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push((name, Usage::default()));
        } else if let Some((_, u)) = out.last_mut() {
            if line.contains("spill stores") {
                u.stack = num_before(line, "bytes stack frame");
                u.spill_stores = num_before(line, "bytes spill stores");
                u.spill_loads = num_before(line, "bytes spill loads");
            } else if line.contains("Used ") && line.contains(" registers") {
                u.regs = num_before(line, "registers");
            }
        }
    }
    out
}

/// A compile unit: its label, its CUDA source and the entry points it must hold.
type Unit<'a> = (String, String, &'a [&'a str]);

/// What one (arch, unit) job found: `ptxas -v`'s rows for the report, and
/// its failures.
struct Report {
    rows: Vec<String>,
    failures: Vec<String>,
}

/// The specialisations the compile check covers: the benchmark shape
/// (32 / 8 heads, d = 128) in every dtype, the usual head dims, GQA groups
/// 1..8, and the unaligned and extreme head dims of the edge table.
fn specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for dtype in DType::ALL {
        for (d, group) in [(128, 4), (128, 1), (128, 8), (64, 4), (256, 4), (80, 2)] {
            v.push(KernelSpec::new(dtype, d, group).unwrap());
        }
    }
    for (dtype, d, group) in [
        (DType::F32, 1, 2),
        (DType::F16, 17, 4),
        (DType::BF16, 257, 8),
        (DType::F32, 257, 3),
        (DType::F32, 512, 8),
        (DType::F16, 512, 8),
        (DType::BF16, 96, 3),
    ] {
        v.push(KernelSpec::new(dtype, d, group).unwrap());
    }
    // The shared-memory staged decode loop (opt-in) compiles without spills too.
    for dtype in DType::ALL {
        for d in [64, 128, 256] {
            v.push(KernelSpec::new(dtype, d, 4).unwrap().with_staged(true));
        }
    }
    v
}

#[test]
fn nvrtc_ptxas_every_kernel_sm80_sm90_no_decode_spill() {
    if let Err(e) = nvrtc_available() {
        require::skip("nvrtc", format!("NVRTC is not available ({e})"));
        return;
    }
    let ptxas = ptxas();
    if ptxas.is_none() {
        require::skip(
            "nvrtc",
            "ptxas was not found (set HGCA_PTXAS or put it on PATH); NVRTC-only check follows",
        );
    }
    let dir = std::env::temp_dir().join(format!("hgca-cuda-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    let t0 = std::time::Instant::now();
    let mut units: Vec<Unit<'_>> = specs()
        .into_iter()
        .map(|s| {
            (
                format!(
                    "{}-d{}-gb{}{}",
                    s.dtype(),
                    s.head_dim(),
                    s.heads_per_block(),
                    if s.staged() { "-st" } else { "" }
                ),
                s.source(),
                &ATTENTION_KERNELS[..],
            )
        })
        .collect();
    units.push(("merge".into(), MERGE_CU.to_string(), &MERGE_KERNELS[..]));
    units.push(("ffn".into(), FFN_CU.to_string(), &FFN_KERNELS[..]));
    // Each (arch, unit) is compiled and checked on its own: NVRTC takes
    // distinct programs from several threads, and ptxas is a process of its
    // own, so the jobs share out over the cores (rayon's pool, which the
    // `cuda` feature brings; one at a time, this test was a minute of CI's
    // test step); the report keeps the jobs' order.
    let jobs: Vec<((u32, u32), &Unit<'_>)> = [(8, 0), (9, 0)]
        .into_iter()
        .flat_map(|cc| units.iter().map(move |u| (cc, u)))
        .collect();
    // Two specialisations can share a label (the same dtype, head dim and
    // heads per block): each job's files carry its index, so jobs running
    // at once never write the same file.
    let check = |job: usize, cc: (u32, u32), (label, src, names): &Unit<'_>| -> Report {
        let arch = format!("sm_{}{}", cc.0, cc.1);
        let mut failures = Vec::new();
        let mut rows = Vec::new();
        let ptx = match compile_ptx(src, cc) {
            Ok(p) => p,
            Err(e) => {
                failures.push(format!("{arch} {label}: NVRTC failed: {}", report(&e)));
                return Report { rows, failures };
            }
        };
        for n in names.iter() {
            if !ptx.contains(&format!(".entry {n}(")) {
                failures.push(format!("{arch} {label}: entry {n} missing from the PTX"));
            }
        }
        let Some(ptxas) = ptxas.as_ref() else {
            return Report { rows, failures };
        };
        let file = dir.join(format!("{job}-{label}-{arch}.ptx"));
        std::fs::write(&file, &ptx).unwrap();
        let out = Command::new(ptxas)
            .arg(format!("-arch={arch}"))
            .arg("-v")
            .arg(&file)
            .arg("-o")
            .arg(dir.join(format!("{job}-{label}-{arch}.cubin")))
            .output()
            .unwrap();
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            failures.push(format!("{arch} {label}: ptxas failed:\n{log}"));
            return Report { rows, failures };
        }
        let usage = parse_ptxas(&log);
        if usage.len() != names.len() {
            failures.push(format!(
                "{arch} {label}: ptxas reported {} entries, expected {}:\n{log}",
                usage.len(),
                names.len()
            ));
        }
        for (name, u) in &usage {
            rows.push(format!(
                "{arch:<6} {label:<16} {name:<22} {:>5} {:>6} {:>7} {:>7}",
                u.regs, u.stack, u.spill_stores, u.spill_loads
            ));
            if name == DECODE_KERNEL && (u.spill_stores > 0 || u.spill_loads > 0) {
                failures.push(format!("{arch} {label}: {name} spills: {u:?}"));
            }
        }
        Report { rows, failures }
    };
    let results: Vec<Report> = jobs
        .par_iter()
        .enumerate()
        .map(|(i, &(cc, u))| check(i, cc, u))
        .collect();
    println!(
        "{:<6} {:<16} {:<22} {:>5} {:>6} {:>7} {:>7}",
        "arch", "spec", "kernel", "regs", "stack", "spill_st", "spill_ld"
    );
    for report in results {
        for r in report.rows {
            println!("{r}");
        }
        failures.extend(report.failures);
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "compiled {} units x 2 archs in {:.1} s",
        units.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Without a GPU every constructor returns a typed error; it never panics.
#[test]
fn no_gpu_is_a_typed_error() {
    match CudaBackend::new() {
        Ok(b) => println!("GPU present: {}", b.device_name()),
        Err(e @ Error::Unavailable { .. }) => println!("no GPU, as expected here: {}", report(&e)),
        Err(e) => panic!("unexpected error without a GPU: {}", report(&e)),
    }
}

/// One backend for all device tests (kernels compile once per
/// specialisation); `None`, with the reason printed, without a usable GPU.
fn gpu() -> Option<&'static CudaBackend> {
    static GPU: OnceLock<Option<CudaBackend>> = OnceLock::new();
    // scripts/gpu-check.sh runs the suite a second time with the staged loop.
    let staged = std::env::var("HGCA_CUDA_STAGED").is_ok_and(|v| v == "1");
    GPU.get_or_init(|| {
        require::available("cuda", CudaBackend::new()).map(|b| b.with_staged_decode(staged))
    })
    .as_ref()
}

/// A second backend on the same device, for the suite's foreign objects.
fn other_gpu() -> Option<&'static CudaBackend> {
    static GPU: OnceLock<Option<CudaBackend>> = OnceLock::new();
    GPU.get_or_init(|| require::available("cuda", CudaBackend::new()))
        .as_ref()
}

hgca_testkit::dense_backend_suite! {
    mod suite;
    backend: gpu,
    other: other_gpu,
    shared_windows: false,
    max_head_dim: hgca_gpu::cuda::MAX_HEAD_DIM,
    cases: 24,
    stress_steps: 1000,
}

/// A long window, the benchmark shape, every dtype: many splits.
#[test]
fn gpu_dense_long_window() {
    let Some(b) = gpu() else { return };
    let shape = AttnShape::new(32, 8, 128).unwrap();
    for dtype in DType::ALL {
        check_dense(b, shape, dtype, 3000, 5000, 512, 700, 10.0, 7).unwrap();
    }
}

/// The dense FFN against hgca-ref: the shared edge table (one and several
/// splits of the down pass), Qwen2's width over a decode step and a prompt
/// chunk, partial tiles of 8 tokens, more tokens than one launch takes
/// (65,535); typed errors; weights of another instance refused.
#[test]
fn gpu_dense_ffn_matches_the_reference() {
    let Some(b) = gpu() else { return };
    let Some(other) = other_gpu() else { return };
    hgca_testkit::ffn::check_dense_ffn_backend(
        b,
        other,
        &[
            (896, 4864, 1),
            (896, 4864, 9),
            (300, 700, 16),
            (130, 129, 17),
            (8, 4, 66_000),
            (3, 1000, 2),
        ],
    )
    .unwrap();
}

/// A hybrid FFN with its hot neurons on the GPU equals the dense reference.
#[test]
fn gpu_hybrid_ffn_with_the_cuda_dense_side() {
    let Some(b) = gpu() else { return };
    common::hybrid_ffn_dense_side(b);
}
