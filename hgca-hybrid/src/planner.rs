//! The memory planner: how large a dense window fits a GPU memory budget,
//! and what the CPU then has to hold.
//!
//! Given a model's attention shape (layers, heads, head dim, KV dtype), a
//! batch of sequences and their context length, [`plan`] returns the
//! largest window (a whole number of eviction blocks) whose K/V, for every
//! layer and sequence, fits the GPU budget together with the per-step
//! scratch of the dense side, and the CPU memory the rest of the context
//! needs (K/V, MAW, block key bounds). It is an error when not even one
//! block fits, or when a CPU budget is given and the rest does not fit it.
//!
//! A model whose local layers attend a sliding window (Gemma 3: five in
//! six, 512 tokens; [`PlanRequest::sliding`]) keeps those windows whole on
//! the GPU, a cost fixed by the window, not the context; only its global
//! layers take the hybrid split, so only they size the window and the CPU
//! store.
//!
//! ```
//! use hgca_hybrid::planner::{plan, ModelShape, PlanRequest};
//! use hgca_kernels::DType;
//! let model = ModelShape { layers: 32, q_heads: 32, kv_heads: 8, head_dim: 128, dtype: DType::F16 };
//! // A 128k context for 4 sequences on a GPU with 16 GiB left for the KV window.
//! let p = plan(&PlanRequest::new(model, 4, 128 << 10, 16 << 30))?;
//! assert!(p.window % p.block == 0 && p.window < 128 << 10);
//! assert!(p.gpu_bytes <= 16 << 30);
//! assert_eq!(p.cpu_tokens, (128 << 10) - p.window);
//! # Ok::<(), hgca_kernels::Error>(())
//! ```

use hgca_kernels::{DType, Error, Result};

use crate::HybridConfig;

/// The attention geometry of a whole model, as far as its KV cache goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Transformer layers (each has its own cache).
    pub layers: usize,
    /// Query heads per layer.
    pub q_heads: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// KV storage type.
    pub dtype: DType,
}

impl ModelShape {
    /// Bytes of K and V of one token in one layer.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * (self.kv_heads * self.head_dim * self.dtype.size()) as u64
    }
}

/// What to plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// The model.
    pub model: ModelShape,
    /// Sequences decoded together (each has its own window and store).
    pub batch: usize,
    /// Context length per sequence, in tokens.
    pub context: usize,
    /// GPU memory the KV window and its scratch may use, bytes (what is left
    /// after weights and activations).
    pub gpu_budget: u64,
    /// Host memory the CPU store may use, bytes; `None`: not checked.
    pub cpu_budget: Option<u64>,
    /// Eviction block in tokens (a power of two); `None`: 64, halved down to
    /// 16 while the window would hold fewer than four blocks.
    pub block: Option<usize>,
    /// Split-K partials of one dense decode (per sequence; the CUDA and wgpu
    /// backends use at most a few thousand).
    pub decode_splits: usize,
    /// The model's local (sliding-window) layers, counted in
    /// `model.layers`; `None`: every layer is global.
    pub sliding: Option<Sliding>,
}

/// Local layers of a model: how many, and the window each attends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sliding {
    /// Local layers (of `ModelShape::layers`, fewer than all of them).
    pub layers: usize,
    /// Their window in tokens.
    pub window: usize,
}

impl PlanRequest {
    /// A request with the defaults: no CPU budget, block chosen, 1024 splits.
    pub fn new(model: ModelShape, batch: usize, context: usize, gpu_budget: u64) -> Self {
        Self {
            model,
            batch,
            context,
            gpu_budget,
            cpu_budget: None,
            block: None,
            decode_splits: 1024,
            sliding: None,
        }
    }

    /// Layers that take the hybrid split (all but the local ones).
    fn global_layers(&self) -> usize {
        self.model.layers - self.sliding.map_or(0, |s| s.layers)
    }

    /// GPU bytes of the local layers' windows (whole, every sequence).
    fn local_bytes(&self) -> u64 {
        self.sliding.map_or(0, |s| {
            self.batch as u64
                * s.layers as u64
                * s.window.min(self.context) as u64
                * self.model.kv_bytes_per_token()
        })
    }
}

/// The plan: window and block, and what each side holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Dense window capacity per sequence and layer, tokens (a multiple of `block`).
    pub window: usize,
    /// Eviction block, tokens.
    pub block: usize,
    /// Tokens per sequence left to the CPU store (`context - window`, or 0).
    pub cpu_tokens: usize,
    /// GPU bytes used: windows of every layer and sequence (the local
    /// layers' included) plus scratch.
    pub gpu_bytes: u64,
    /// Of which the per-step scratch (weights out, split partials), bytes.
    pub gpu_scratch_bytes: u64,
    /// Host bytes of the CPU stores: K/V, MAW and block key bounds.
    pub cpu_bytes: u64,
    /// `window / context`.
    pub window_ratio: f64,
}

impl Plan {
    /// A [`HybridConfig`] with this plan's window and block, the rest
    /// default (the KV dtype is the layer's type parameter).
    pub fn config(&self) -> HybridConfig {
        HybridConfig {
            window: self.window,
            block: self.block,
            ..HybridConfig::default()
        }
    }
}

/// GPU bytes of a window of `window` tokens (all layers and sequences) plus
/// the dense side's scratch of one step (weights out of one layer and the
/// split partials, per sequence).
fn gpu_bytes(r: &PlanRequest, window: usize) -> u64 {
    let m = &r.model;
    let kv = r.batch as u64 * r.global_layers() as u64 * window as u64 * m.kv_bytes_per_token();
    kv + r.local_bytes() + scratch_bytes(r, window)
}

fn scratch_bytes(r: &PlanRequest, window: usize) -> u64 {
    let m = &r.model;
    let weights = (m.q_heads * window * 4) as u64;
    let partials = (r.decode_splits * m.q_heads * (m.head_dim + 1) * 4) as u64;
    r.batch as u64 * (weights + partials)
}

/// Host bytes of the CPU stores of `tokens` tokens per sequence and layer:
/// K/V, one f32 MAW per KV head and token, and per block the min and max
/// key (`2 d` f32 per KV head).
fn cpu_bytes(r: &PlanRequest, tokens: usize, block: usize) -> u64 {
    let m = &r.model;
    let per_layer = tokens as u64 * m.kv_bytes_per_token()
        + (m.kv_heads * tokens * 4) as u64
        + (tokens.div_ceil(block) * m.kv_heads * 2 * m.head_dim * 4) as u64;
    r.batch as u64 * r.global_layers() as u64 * per_layer
}

/// Plans the window and block for `r` (see the module docs).
///
/// # Errors
/// [`Error::Zero`] for a zero count; [`Error::Param`] for a block that is
/// not a power of two, q_heads not a multiple of kv_heads, or local layers
/// that are not fewer than all;
/// [`Error::Capacity`] when not one block fits the GPU budget, or the CPU
/// store does not fit `cpu_budget`.
pub fn plan(r: &PlanRequest) -> Result<Plan> {
    let m = &r.model;
    for (what, v) in [
        ("layers", m.layers),
        ("q_heads", m.q_heads),
        ("kv_heads", m.kv_heads),
        ("head_dim", m.head_dim),
        ("batch", r.batch),
        ("context", r.context),
        ("decode_splits", r.decode_splits),
    ] {
        if v == 0 {
            return Err(Error::Zero { what });
        }
    }
    if !m.q_heads.is_multiple_of(m.kv_heads) {
        return Err(Error::Param {
            what: "q_heads / kv_heads",
            value: m.q_heads as f64 / m.kv_heads as f64,
            expected: "q_heads a multiple of kv_heads",
        });
    }
    if let Some(sl) = r.sliding {
        if sl.window == 0 {
            return Err(Error::Zero {
                what: "sliding window",
            });
        }
        if sl.layers >= m.layers {
            return Err(Error::Param {
                what: "local layers",
                value: sl.layers as f64,
                expected: "fewer than the model's layers",
            });
        }
    }
    if let Some(b) = r.block
        && !b.is_power_of_two()
    {
        return Err(Error::Param {
            what: "block",
            value: b as f64,
            expected: "a power of two",
        });
    }
    // Largest window (tokens) the budget allows, from the linear cost model:
    // gpu_bytes(w) = per_token * w + fixed.
    let per_token = r.batch as u64
        * (r.global_layers() as u64 * m.kv_bytes_per_token() + (m.q_heads * 4) as u64);
    let fixed = scratch_bytes(r, 0) + r.local_bytes();
    let max_tokens = r.gpu_budget.saturating_sub(fixed) / per_token;
    let max_tokens = usize::try_from(max_tokens).unwrap_or(usize::MAX);
    let block = match r.block {
        Some(b) => b,
        None => {
            let mut b = 64;
            while b > 16 && max_tokens / b < 4 {
                b /= 2;
            }
            b
        }
    };
    // The whole context on the GPU when it fits (rounded up to a block).
    let whole = r.context.next_multiple_of(block);
    let window = if whole <= max_tokens {
        whole
    } else {
        max_tokens - max_tokens % block
    };
    if window < block {
        return Err(Error::Capacity {
            what: "GPU budget (bytes) for one block of window",
            capacity: usize::try_from(r.gpu_budget).unwrap_or(usize::MAX),
            requested: usize::try_from(gpu_bytes(r, block)).unwrap_or(usize::MAX),
        });
    }
    let cpu_tokens = r.context.saturating_sub(window);
    let cpu = cpu_bytes(r, cpu_tokens, block);
    if let Some(budget) = r.cpu_budget
        && cpu > budget
    {
        return Err(Error::Capacity {
            what: "CPU budget (bytes) for the store",
            capacity: usize::try_from(budget).unwrap_or(usize::MAX),
            requested: usize::try_from(cpu).unwrap_or(usize::MAX),
        });
    }
    Ok(Plan {
        window,
        block,
        cpu_tokens,
        gpu_bytes: gpu_bytes(r, window),
        gpu_scratch_bytes: scratch_bytes(r, window),
        cpu_bytes: cpu,
        window_ratio: window as f64 / r.context as f64,
    })
}

/// The hot neurons of every layer of a hybrid FFN that a GPU budget holds
/// (PowerInfer's placement, greedy): neurons are taken across all layers
/// in decreasing order of their activation frequency (`freq[layer][neuron]`,
/// e.g. the share of calibration tokens on which a neuron passed the
/// threshold), each costing `neuron_bytes` (its gate, up and down rows on
/// the device), until the next would not fit `gpu_budget`. Ties go to the
/// lower layer, then the lower neuron. Returns each layer's hot list,
/// ascending; a layer may get none.
///
/// ```
/// use hgca_hybrid::planner::plan_hot_neurons;
/// // Two layers of three neurons, 100 bytes a neuron, room for three.
/// let freq = vec![vec![0.9, 0.1, 0.5], vec![0.2, 0.95, 0.4]];
/// let hot = plan_hot_neurons(&freq, 100, 350)?;
/// assert_eq!(hot, vec![vec![0, 2], vec![1]]);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
///
/// # Errors
/// [`Error::Zero`] for `neuron_bytes` 0; [`Error::Param`] for a frequency
/// that is NaN.
pub fn plan_hot_neurons(
    freq: &[Vec<f32>],
    neuron_bytes: u64,
    gpu_budget: u64,
) -> Result<Vec<Vec<u32>>> {
    if neuron_bytes == 0 {
        return Err(Error::Zero {
            what: "neuron_bytes",
        });
    }
    let mut all = Vec::with_capacity(freq.iter().map(Vec::len).sum());
    for (l, f) in freq.iter().enumerate() {
        for (i, &v) in f.iter().enumerate() {
            if v.is_nan() {
                return Err(Error::Param {
                    what: "neuron frequency",
                    value: f64::NAN,
                    expected: "a number",
                });
            }
            all.push((v, l, i as u32));
        }
    }
    all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let take = usize::try_from(gpu_budget / neuron_bytes).unwrap_or(usize::MAX);
    let mut hot = vec![Vec::new(); freq.len()];
    for &(_, l, i) in all.iter().take(take) {
        hot[l].push(i);
    }
    for h in &mut hot {
        h.sort_unstable();
    }
    Ok(hot)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama8b() -> ModelShape {
        ModelShape {
            layers: 32,
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype: DType::F16,
        }
    }

    /// Gemma 3 270M's shape: 15 local layers of 512 tokens, 3 global. The
    /// local windows cost their own fixed bytes; the global layers get the
    /// window a 3-layer model would get from what is left.
    #[test]
    fn local_layers_cost_their_window_and_leave_the_split_to_the_global_ones() {
        let model = ModelShape {
            layers: 18,
            q_heads: 4,
            kv_heads: 1,
            head_dim: 256,
            dtype: DType::F16,
        };
        let (context, budget) = (32 << 10, 64u64 << 20);
        let mut r = PlanRequest::new(model, 2, context, budget);
        r.sliding = Some(Sliding {
            layers: 15,
            window: 512,
        });
        let p = plan(&r).unwrap();
        let local = 2 * 15 * 512 * model.kv_bytes_per_token();
        assert_eq!(r.local_bytes(), local);
        let mut global = PlanRequest::new(
            ModelShape { layers: 3, ..model },
            2,
            context,
            budget - local,
        );
        global.block = Some(p.block);
        let g = plan(&global).unwrap();
        assert_eq!((p.window, p.cpu_tokens), (g.window, g.cpu_tokens));
        assert_eq!(p.gpu_bytes, g.gpu_bytes + local);
        assert_eq!(p.cpu_bytes, g.cpu_bytes);
        assert!(p.gpu_bytes <= budget && p.window < context);
        r.sliding = Some(Sliding {
            layers: 18,
            window: 512,
        });
        assert!(matches!(plan(&r), Err(Error::Param { .. })));
    }

    #[test]
    fn a_window_that_fits_is_the_largest_that_fits() {
        for (batch, context, gib) in [(1, 1 << 20, 8u64), (4, 128 << 10, 16), (16, 32 << 10, 40)] {
            let r = PlanRequest::new(llama8b(), batch, context, gib << 30);
            let p = plan(&r).unwrap();
            assert_eq!(p.window % p.block, 0);
            assert!(p.gpu_bytes <= r.gpu_budget, "{p:?}");
            assert_eq!(p.gpu_bytes, gpu_bytes(&r, p.window));
            assert!(p.window >= r.context || gpu_bytes(&r, p.window + p.block) > r.gpu_budget);
            assert_eq!(p.cpu_tokens, context.saturating_sub(p.window));
        }
    }

    #[test]
    fn figures_by_hand() {
        // 1 layer, 1 KV head of d 4 in f32: 32 bytes of K/V per token; the
        // scratch is q_heads * 4 = 4 bytes per window token plus 2 splits of
        // (4 + 1) floats = 40 bytes.
        let model = ModelShape {
            layers: 1,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 4,
            dtype: DType::F32,
        };
        let mut r = PlanRequest::new(model, 1, 1000, 40 + 36 * 100);
        r.decode_splits = 2;
        r.block = Some(16);
        let p = plan(&r).unwrap();
        assert_eq!(p.window, 96); // 100 tokens fit, a multiple of 16
        assert_eq!(p.gpu_bytes, 40 + 36 * 96);
        assert_eq!(p.cpu_tokens, 904);
        // K/V 32 + MAW 4 per token, and 57 blocks of 2 * 4 floats.
        assert_eq!(p.cpu_bytes, 904 * 36 + 57 * 32);
    }

    #[test]
    fn everything_fits_on_the_gpu() {
        let p = plan(&PlanRequest::new(llama8b(), 1, 5000, 80 << 30)).unwrap();
        assert_eq!((p.window, p.cpu_tokens, p.cpu_bytes), (5056, 0, 0));
        assert!((p.window_ratio - 5056.0 / 5000.0).abs() < 1e-12);
    }

    #[test]
    fn small_budgets_take_smaller_blocks_then_fail() {
        let r = |bytes| PlanRequest::new(llama8b(), 1, 1 << 20, bytes);
        let per_token = 32 * 4096 + 128; // K/V of 32 layers + weights scratch
        let fixed = 1024 * 32 * 129 * 4;
        let p = plan(&r(fixed + 100 * per_token)).unwrap();
        assert_eq!((p.block, p.window), (16, 96));
        let e = plan(&r(fixed + 15 * per_token)).unwrap_err();
        assert!(matches!(e, Error::Capacity { .. }), "{e}");
    }

    #[test]
    fn the_cpu_budget_is_checked() {
        let mut r = PlanRequest::new(llama8b(), 1, 1 << 20, 8 << 30);
        r.cpu_budget = Some(1 << 30);
        assert!(matches!(plan(&r), Err(Error::Capacity { .. })));
        r.cpu_budget = Some(1 << 40);
        assert!(plan(&r).is_ok());
    }

    #[test]
    fn bad_requests_are_typed_errors() {
        let mut r = PlanRequest::new(llama8b(), 1, 1024, 1 << 30);
        r.block = Some(48);
        assert!(matches!(plan(&r), Err(Error::Param { what: "block", .. })));
        r.block = None;
        r.batch = 0;
        assert!(matches!(plan(&r), Err(Error::Zero { what: "batch" })));
        let mut m = llama8b();
        m.kv_heads = 5;
        assert!(matches!(
            plan(&PlanRequest::new(m, 1, 1024, 1 << 30)),
            Err(Error::Param { .. })
        ));
    }

    #[test]
    fn the_plan_makes_a_valid_layer() {
        let p = plan(&PlanRequest::new(llama8b(), 1, 1 << 16, 1 << 30)).unwrap();
        let shape = hgca_kernels::AttnShape::new(32, 8, 128).unwrap();
        let cfg = p.config();
        assert!(crate::HybridAttention::<_, _, hgca_kernels::f16>::cpu(shape, cfg).is_ok());
    }
}
