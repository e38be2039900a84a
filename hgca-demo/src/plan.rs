//! `hgca-demo plan`: the memory planner's window and block for a GPU
//! budget.

use hgca_kernels::{DType, Result};

use crate::args::Args;

/// The memory planner: window and block for a GPU budget.
pub(crate) fn plan(a: &Args) -> Result<()> {
    use hgca_hybrid::planner::{ModelShape, PlanRequest, plan};
    let model = ModelShape {
        layers: a.layers,
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::F16,
    };
    let mut r = PlanRequest::new(
        model,
        a.batch,
        a.context,
        (a.gpu_gib * (1u64 << 30) as f64) as u64,
    );
    r.block = a.block_set.then_some(a.block);
    let p = plan(&r)?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "plan: {} layers x q32/kv8/d128 f16, batch {}, context {} tokens, GPU budget {:.2} GiB",
        a.layers, a.batch, a.context, a.gpu_gib
    );
    println!(
        "  window {} tokens per sequence and layer (ratio {:.3}), block {}",
        p.window, p.window_ratio, p.block
    );
    println!(
        "  GPU: {:.2} GiB ({:.3} GiB of it per-step scratch); CPU store: {} tokens per sequence, {:.2} GiB",
        gib(p.gpu_bytes),
        gib(p.gpu_scratch_bytes),
        p.cpu_tokens,
        gib(p.cpu_bytes)
    );
    Ok(())
}
