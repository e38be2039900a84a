//! Times the CUDA decode attention and merge against a device-to-device copy
//! measured in the same run (the bandwidth yardstick).
//!
//! `cargo run --release -p hgca-gpu --features bench-timers --example cuda_bench`
//! (the timers are behind their own feature: they are not library API).
//!
//! Decode: q_heads 32 / kv_heads 8, d = 128, f16 KV, windows of 4k..256k
//! tokens. Merge: two partials of an append chunk of 4096 tokens x 32 heads.
//! Dense FFN (a hybrid FFN's hot neurons, f16 weights): Qwen2.5-0.5B's and
//! Llama-3-8B's shapes, 1..128 tokens, the whole call as a caller sees it
//! (tokens up, result down, host clock) and the kernels alone (events),
//! per-token and tiled, weight bytes per second.
//! Prints GB/s and the fraction of the copy bandwidth; with `OUT` set, also
//! writes `$OUT/cuda_bench.csv`.

#[cfg(not(feature = "bench-timers"))]
fn main() {
    eprintln!("cuda_bench needs cargo feature `bench-timers`");
    std::process::exit(2);
}

#[cfg(feature = "bench-timers")]
fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench: {}", hgca_kernels::report(&*e));
        std::process::exit(1);
    }
}

#[cfg(feature = "bench-timers")]
fn run() -> Result<(), Box<dyn std::error::Error>> {
    use hgca_gpu::cuda::CudaBackend;
    use hgca_kernels::{AttnShape, DType, KvWindow, WindowBackend, WindowSpec};
    use std::fmt::Write as _;

    // HGCA_CUDA_STAGED=1 (scripts/gpu-check.sh): the staged decode loop.
    let staged = std::env::var("HGCA_CUDA_STAGED").is_ok_and(|v| v == "1");
    let b = CudaBackend::new()?.with_staged_decode(staged);
    println!(
        "device: {} (sm_{}{})",
        b.device_name(),
        b.compute_capability().0,
        b.compute_capability().1
    );
    let mut csv = String::from("kernel,tokens,bytes,seconds,gb_per_s,fraction_of_copy\n");

    let copy_bytes = 1usize << 30;
    let (t_memcpy, t_kernel) = b.time_copy(copy_bytes, 20)?;
    // A copy moves every byte twice (read + write).
    let copy_gbs = (2 * copy_bytes) as f64 / t_memcpy.min(t_kernel) / 1e9;
    println!(
        "d2d copy 1 GiB: memcpy {:.1} GB/s, kernel {:.1} GB/s (read + write)",
        (2 * copy_bytes) as f64 / t_memcpy / 1e9,
        (2 * copy_bytes) as f64 / t_kernel / 1e9
    );
    writeln!(
        csv,
        "copy,0,{},{:.3e},{copy_gbs:.1},1.0",
        2 * copy_bytes,
        t_memcpy.min(t_kernel)
    )?;

    let shape = AttnShape::new(32, 8, 128)?;
    let max_len = 256 * 1024;
    let mut w = b.new_window(WindowSpec::new(shape, max_len, DType::F16)?)?;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let q: Vec<f32> = (0..shape.q_len()).map(|_| 4.0 * rnd()).collect();
    let chunk = 8192;
    let mut k = vec![0f32; chunk * shape.kv_token_len()];
    let mut v = k.clone();
    println!(
        "{:>8} {:>10} {:>9} {:>8} {:>9}",
        "tokens", "MB", "us", "GB/s", "of copy"
    );
    for len in [4096usize, 8192, 16384, 32768, 65536, 131072, 262144] {
        while w.len() < len {
            let n = chunk.min(len - w.len());
            let m = n * shape.kv_token_len();
            k[..m].iter_mut().for_each(|e| *e = rnd());
            v[..m].iter_mut().for_each(|e| *e = rnd());
            b.append(&mut w, n, &k[..m], &v[..m])?;
        }
        let bytes = 2 * len * shape.kv_token_len() * DType::F16.size();
        let iters = (2_000_000_000 / bytes).clamp(20, 500);
        let t = b.time_decode(&w, &q, iters)?;
        let gbs = bytes as f64 / t / 1e9;
        println!(
            "{len:>8} {:>10.1} {:>9.1} {gbs:>8.1} {:>8.0}%",
            bytes as f64 / 1e6,
            t * 1e6,
            100.0 * gbs / copy_gbs
        );
        writeln!(
            csv,
            "decode_f16,{len},{bytes},{t:.3e},{gbs:.1},{:.3}",
            gbs / copy_gbs
        )?;
    }

    let (parts, rows, d) = (2usize, 4096 * 32, 128usize);
    let t = b.time_merge(parts, rows, d, 100)?;
    let bytes = (parts + 1) * rows * (d + 1) * 4;
    let gbs = bytes as f64 / t / 1e9;
    println!(
        "merge {parts} x {rows} rows x d {d}: {:.1} us, {gbs:.1} GB/s, {:.0}% of copy",
        t * 1e6,
        100.0 * gbs / copy_gbs
    );
    writeln!(
        csv,
        "merge,{rows},{bytes},{t:.3e},{gbs:.1},{:.3}",
        gbs / copy_gbs
    )?;

    {
        use hgca_kernels::{DenseFfnBackend, FfnAct, FfnWeights, f16};
        println!(
            "dense FFN, f16 weights: call = dense_ffn as a caller sees it (host clock, median \
             of 30, transfers included); kernels = CUDA events, no transfers, per-token and \
             tiled kernels; GB/s and GFLOP/s of the faster kernels"
        );
        println!(
            "{:>6} {:>6} {:>6} {:>8} {:>10} {:>10} {:>10} {:>8} {:>8} {:>9}",
            "d",
            "n_ff",
            "tokens",
            "MB",
            "call us",
            "token us",
            "tiled us",
            "GB/s",
            "of copy",
            "GFLOP/s"
        );
        for (d, n_ff) in [(896usize, 4864usize), (4096, 14336)] {
            let m: Vec<f16> = (0..d * n_ff).map(|_| f16::from_f32(0.05 * rnd())).collect();
            let fw = FfnWeights::new(d, n_ff, &m, &m, &m)?;
            let r = b.upload_ffn(&fw)?;
            let bytes = 3 * d * n_ff * 2;
            for n in [1usize, 2, 3, 4, 8, 16, 128] {
                let x: Vec<f32> = (0..n * d).map(|_| rnd()).collect();
                let mut out = vec![0f32; n * d];
                for _ in 0..3 {
                    b.dense_ffn(FfnAct::Silu, &r, &x, n, &mut out)?;
                }
                let mut ts: Vec<f64> = (0..30)
                    .map(|_| {
                        let t0 = std::time::Instant::now();
                        b.dense_ffn(FfnAct::Silu, &r, &x, n, &mut out)
                            .map(|()| t0.elapsed().as_secs_f64())
                    })
                    .collect::<Result<_, _>>()?;
                ts.sort_by(f64::total_cmp);
                let call = ts[ts.len() / 2];
                let per_token = b.time_ffn(&r, &x, n, false, 20)?;
                let tiled = b.time_ffn(&r, &x, n, true, 20)?;
                let t = per_token.min(tiled);
                let gbs = bytes as f64 / t / 1e9;
                let gflops = 6.0 * (n * d * n_ff) as f64 / t / 1e9;
                println!(
                    "{d:>6} {n_ff:>6} {n:>6} {:>8.1} {:>10.1} {:>10.1} {:>10.1} {gbs:>8.1} {:>7.0}% {gflops:>9.1}",
                    bytes as f64 / 1e6,
                    call * 1e6,
                    per_token * 1e6,
                    tiled * 1e6,
                    100.0 * gbs / copy_gbs
                );
                for (path, tk) in [("call", call), ("token", per_token), ("tiled", tiled)] {
                    writeln!(
                        csv,
                        "ffn_f16_d{d}_nff{n_ff}_{path},{n},{bytes},{tk:.3e},{:.1},{:.3}",
                        bytes as f64 / tk / 1e9,
                        bytes as f64 / tk / 1e9 / copy_gbs
                    )?;
                }
            }
        }
    }

    if let Some(out) = std::env::var_os("OUT") {
        let path = std::path::Path::new(&out).join("cuda_bench.csv");
        std::fs::write(&path, csv)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
