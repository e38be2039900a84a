//! Developer tool: prints the PTX NVRTC makes of the attention kernels for
//! one specialisation (no GPU needed, only NVRTC).
//!
//! `cargo run -p hgca-gpu --features cuda --example cuda_ptx -- f16 128 4 90`
//! (dtype, head dim, query group, compute capability).

use hgca_gpu::cuda::{KernelSpec, compile_ptx};
use hgca_kernels::DType;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: &str| a.get(i).cloned().unwrap_or_else(|| d.to_string());
    let dtype = match arg(0, "f16").as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        _ => DType::F16,
    };
    let d: usize = arg(1, "128").parse()?;
    let group: usize = arg(2, "4").parse()?;
    let cc: u32 = arg(3, "90").parse()?;
    let spec = KernelSpec::new(dtype, d, group)?;
    print!("{}", compile_ptx(&spec.source(), (cc / 10, cc % 10))?);
    Ok(())
}
