//! The wgpu backend (cargo feature `wgpu`): dense attention with LSE over a
//! GPU KV window, and the LSE merge, in WGSL compute shaders.
//!
//! Portable: Vulkan, Metal, DX12, and Mesa's software Vulkan driver
//! (lavapipe, adapter "llvmpipe"), where CI runs it.
//!
//! - [`WgpuBackend`] is the context: instance, adapter, a device requested
//!   with the adapter's own limits (not WebGPU's small defaults), the
//!   compute pipelines (built once) and a pool of reusable buffers and
//!   staging buffers. It implements [`hgca_kernels::WindowBackend`],
//!   [`hgca_kernels::DenseAttention`] and [`hgca_kernels::MergeBackend`].
//! - [`WgpuWindow`] is the GPU KV window: a ring of `capacity` tokens,
//!   `[kv_heads, capacity, d]` for K and for V, stored as f32, f16 or bf16.
//!   16-bit rows are padded to an even number of elements so that every row
//!   is a whole number of 32-bit words; the kernels decode f16 with
//!   `unpack2x16float` and bf16 with a shift, so 16-bit storage works on every
//!   adapter (`SHADER_F16` is requested when present but not required).
//!   Values are rounded to the storage type on the CPU (round to nearest
//!   even, the `half` crate), so evicted rows are bit-exact.
//! - Decode: split-K (flash-decoding). Each split of a query row is one
//!   workgroup of 64 invocations that visits its tokens in blocks of 64 with
//!   an online softmax (reductions in workgroup memory, no subgroup
//!   operations, so no subgroup size is assumed); a merge pass on the GPU
//!   combines the splits. Grid: `(splits, rows)`, with rows folded into y and
//!   z beyond the per-dimension limit. The split factor gives every split at
//!   least [`WgpuOptions::min_split_tokens`] tokens and aims at about
//!   [`WgpuOptions::target_workgroups`] workgroups in all.
//! - Append (prefill): the same kernel with one row per (query token, head)
//!   and a causal bound per token.
//! - Head dims up to [`MAX_HEAD_DIM`] = 256; larger ones are refused at
//!   [`hgca_kernels::WindowBackend::new_window`] with
//!   [`hgca_kernels::Error::Capacity`].
//!
//! - Weights (decode with `want_weights`): the split kernel also writes the
//!   raw scores, and a third pass writes `exp(score - lse)` per window token
//!   once the merge has produced the lse.
//! - Merge ([`hgca_kernels::MergeBackend`]): one workgroup per row, the
//!   contract of [`hgca_kernels::merge()`] (`+inf` and `-inf` lse are empty,
//!   `(0, -inf)` for all-empty rows, NaN propagates), decided on the bits of
//!   the values, because WGSL lets a compiler assume there is no NaN or
//!   infinity. The split-K combine uses the same kernel.
//! - Dense FFN ([`hgca_kernels::DenseFfnBackend`], the hot neurons of a
//!   hybrid FFN): f16 weights resident as 32-bit words ([`WgpuFfn`]); one
//!   pass writes `act(gate·x) (up·x)` per (token, neuron), one workgroup
//!   each, and a second the down projection, one invocation per token and
//!   pair of output columns. A call uploads the tokens and reads back the
//!   output. Not tuned: each token reads the weight rows again.
//! - Special values in attention: a NaN or infinite score (NaN or inf in `q`
//!   or `K`) makes that row's `out` and `lse` NaN rather than being hidden by
//!   a `max`; NaN in `V` reaches `out` through the arithmetic.
//!
//! Submitting returns at once (uploads are queued, the command buffer is
//! submitted and the staging buffer's mapping is requested);
//! [`hgca_kernels::DenseAttention::wait`] polls the device until that
//! submission is done and reads the mapped staging buffer. Buffers come from
//! a pool and go back to it after `wait`, so steady-state decoding allocates
//! no device memory. [`hgca_kernels::WindowBackend::evict_oldest`] is
//! blocking by contract (the rows are needed on the CPU).
//!
//! Not done (yet): append attention runs the decode kernel with one row per
//! (query token, head), so K and V are read once per query row rather than
//! once per tile of queries; the query heads of a GQA group do not share
//! their K/V loads in workgroup memory. Both are speed, not correctness.
//!
//! With the feature off, the types exist and [`WgpuBackend::new`] returns
//! [`hgca_kernels::Error::NotCompiledIn`].

use hgca_kernels::{Error, Result};

#[cfg(feature = "wgpu")]
mod attention;
#[cfg(feature = "wgpu")]
mod backend;
#[cfg(feature = "wgpu")]
mod ffn;
#[cfg(feature = "wgpu")]
mod merge;
#[cfg(feature = "wgpu")]
mod window;
#[cfg(feature = "wgpu")]
pub use attention::WgpuPending;
#[cfg(feature = "wgpu")]
pub use backend::WgpuBackend;
#[cfg(feature = "wgpu")]
pub use ffn::WgpuFfn;
#[cfg(feature = "wgpu")]
pub use window::WgpuWindow;

/// The largest head dim the attention kernels take.
pub const MAX_HEAD_DIM: usize = 256;

/// Options of [`WgpuBackend::with_options`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgpuOptions {
    /// Prefer a low-power adapter (integrated GPU) over a high-performance one.
    pub low_power: bool,
    /// Only accept a fallback (software) adapter.
    pub force_fallback_adapter: bool,
    /// Fewest tokens per split of the split-K decode (at least 1).
    pub min_split_tokens: u32,
    /// Workgroups one decode aims at (splits x query rows; at least 1).
    pub target_workgroups: u32,
}

impl Default for WgpuOptions {
    fn default() -> Self {
        Self {
            low_power: false,
            force_fallback_adapter: false,
            min_split_tokens: 256,
            target_workgroups: 1024,
        }
    }
}

impl WgpuOptions {
    /// Checks the options.
    ///
    /// # Errors
    /// [`Error::Zero`] for a zero `min_split_tokens` or `target_workgroups`.
    pub fn validate(&self) -> Result<()> {
        if self.min_split_tokens == 0 {
            return Err(Error::Zero {
                what: "min_split_tokens",
            });
        }
        if self.target_workgroups == 0 {
            return Err(Error::Zero {
                what: "target_workgroups",
            });
        }
        Ok(())
    }
}

/// What the backend runs on, for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgpuAdapterInfo {
    /// Adapter name ("llvmpipe (LLVM 15.0.6, 256 bits)", "NVIDIA H200", ...).
    pub name: String,
    /// Graphics API ("Vulkan", "Metal", "Dx12", ...).
    pub backend: String,
    /// Device type ("Cpu", "DiscreteGpu", ...).
    pub device_type: String,
    /// Driver name and version.
    pub driver: String,
    /// Whether the device was created with `SHADER_F16`.
    pub shader_f16: bool,
    /// The device's `max_storage_buffer_binding_size`, bytes.
    pub max_storage_binding: u64,
    /// The device's `max_compute_workgroups_per_dimension`.
    pub max_workgroups_per_dim: u32,
}

#[cfg(not(feature = "wgpu"))]
mod off {
    use super::*;

    const OFF: Error = Error::NotCompiledIn {
        backend: "wgpu",
        feature: "wgpu",
    };

    /// The wgpu backend; this build lacks cargo feature `wgpu`, so it cannot be
    /// constructed.
    #[derive(Debug)]
    pub struct WgpuBackend {
        never: core::convert::Infallible,
    }

    /// A wgpu KV window (not compiled in).
    #[derive(Debug)]
    pub struct WgpuWindow {
        _never: core::convert::Infallible,
    }

    /// Submitted wgpu work (not compiled in).
    #[derive(Debug)]
    pub struct WgpuPending {
        _never: core::convert::Infallible,
    }

    impl WgpuBackend {
        /// Always fails: cargo feature `wgpu` is off.
        ///
        /// # Errors
        /// [`Error::NotCompiledIn`].
        pub fn new() -> Result<Self> {
            Err(OFF)
        }
        /// Always fails: cargo feature `wgpu` is off.
        ///
        /// # Errors
        /// [`Error::NotCompiledIn`].
        pub fn with_options(_options: WgpuOptions) -> Result<Self> {
            Err(OFF)
        }
        /// The adapter (unreachable: no value of this type exists).
        pub fn adapter_info(&self) -> &WgpuAdapterInfo {
            match self.never {}
        }
    }
}
#[cfg(not(feature = "wgpu"))]
pub use off::{WgpuBackend, WgpuPending, WgpuWindow};

#[cfg(all(test, not(feature = "wgpu")))]
mod tests {
    use super::*;

    #[test]
    fn feature_off_is_a_typed_error() {
        assert_eq!(
            WgpuBackend::new().unwrap_err(),
            Error::NotCompiledIn {
                backend: "wgpu",
                feature: "wgpu"
            }
        );
        assert!(WgpuBackend::with_options(WgpuOptions::default()).is_err());
    }
}
