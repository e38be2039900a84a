//! Times the CUDA decode attention and merge against a device-to-device copy
//! measured in the same run (the bandwidth yardstick).
//!
//! `cargo run --release -p hgca-gpu --features bench-timers --example cuda_bench`
//! (the timers are behind their own feature: they are not library API).
//!
//! Decode: q_heads 32 / kv_heads 8, d = 128, f16 KV, windows of 4k..256k
//! tokens. Merge: two partials of an append chunk of 4096 tokens x 32 heads.
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

    if let Some(out) = std::env::var_os("OUT") {
        let path = std::path::Path::new(&out).join("cuda_bench.csv");
        std::fs::write(&path, csv)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
