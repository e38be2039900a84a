//! The CUDA backend (cargo feature `cuda`).
//!
//! CUDA C kernels ([`ATTENTION_CU`], [`MERGE_CU`]) are compiled at run time
//! by NVRTC through `cudarc` (dynamic loading: no CUDA toolkit is needed to
//! build, and a machine without a GPU gets [`hgca_kernels::Error::Unavailable`],
//! never a panic). Compiled PTX is cached per compute capability and
//! specialisation ([`KernelSpec`]: KV dtype, head dim, query heads per block).
//!
//! - **Decode**: split-K flash-decoding. Grid `(splits, kv_heads,
//!   ceil(group / heads_per_block))`, 128 threads; a row of `lanes` threads
//!   reads one token's K and V with 16-byte loads and serves every query head
//!   of the block (GQA: one K/V load per group); online softmax in f32 with
//!   scores in the log2 domain; a combine pass merges the splits and, on
//!   request, a third pass turns the stored scores into the window tokens'
//!   weights (oldest first).
//! - **Append** (prefill chunk): causal attention, 16 query rows per block,
//!   K/V tiles of 32 tokens staged in shared memory as f32.
//! - **Window**: K and V `[kv_heads, capacity, d]` in f32, f16 or bf16,
//!   used as a ring. Appends convert on the host (round to nearest even, as
//!   `half`), upload, and scatter into the ring on the compute stream;
//!   evictions gather the oldest tokens head-major on a second stream and
//!   copy them to pinned host memory, overlapping queued compute.
//! - **FFN** (a hybrid FFN's hot neurons, [`hgca_kernels::DenseFfnBackend`]):
//!   f16 weights resident as rows of f16 pairs; a warp per (token, neuron)
//!   for the gate and up rows, then the down rows in splits of the neurons
//!   summed in a fixed order.
//! - **Merge**: the LSE merge with the special values of [`hgca_kernels::merge()`].
//!
//! Without the `cuda` feature, [`CudaBackend::new`] returns
//! [`hgca_kernels::Error::NotCompiledIn`].
//!
//! The CI compile check needs NVRTC and `ptxas` only: see
//! `scripts/setup-cuda.sh` and `tests/cuda.rs`.

mod spec;

pub use spec::{
    APPEND_ROWS, ATTENTION_CU, ATTENTION_KERNELS, BLOCK_THREADS, DECODE_KERNEL, FFN_CU,
    FFN_KERNELS, KernelSpec, MAX_HEAD_DIM, MERGE_CU, MERGE_KERNELS,
};

#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod ffn;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod merge;
#[cfg(feature = "cuda")]
mod nvrtc;
#[cfg(feature = "bench-timers")]
mod timers;
#[cfg(feature = "cuda")]
mod window;
#[cfg(feature = "cuda")]
pub use attention::CudaPending;
#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
#[cfg(feature = "cuda")]
pub use ffn::CudaFfn;
#[cfg(feature = "cuda")]
pub use nvrtc::{compile_ptx, driver_available, nvrtc_available};
#[cfg(feature = "cuda")]
pub use window::CudaWindow;

#[cfg(not(feature = "cuda"))]
mod off {
    use hgca_kernels::{Error, Result};

    fn not_compiled_in() -> Error {
        Error::NotCompiledIn {
            backend: "cuda",
            feature: "cuda",
        }
    }

    /// The CUDA backend; this build lacks cargo feature `cuda`, so it cannot be created.
    #[derive(Debug, Clone)]
    pub struct CudaBackend {
        _private: (),
    }

    impl CudaBackend {
        /// Always fails in this build.
        ///
        /// # Errors
        /// [`Error::NotCompiledIn`].
        pub fn new() -> Result<Self> {
            Err(not_compiled_in())
        }
        /// Always fails in this build.
        ///
        /// # Errors
        /// [`Error::NotCompiledIn`].
        pub fn with_device(_ordinal: usize) -> Result<Self> {
            Err(not_compiled_in())
        }
        /// As in a build with feature `cuda` (no backend exists to use it).
        pub fn with_staged_decode(self, _on: bool) -> Self {
            self
        }
    }

    /// Always fails in this build.
    ///
    /// # Errors
    /// [`Error::NotCompiledIn`].
    pub fn driver_available() -> Result<usize> {
        Err(not_compiled_in())
    }

    /// Always fails in this build.
    ///
    /// # Errors
    /// [`Error::NotCompiledIn`].
    pub fn nvrtc_available() -> Result<()> {
        Err(not_compiled_in())
    }

    /// Always fails in this build.
    ///
    /// # Errors
    /// [`Error::NotCompiledIn`].
    pub fn compile_ptx(_source: &str, _cc: (u32, u32)) -> Result<String> {
        Err(not_compiled_in())
    }
}
#[cfg(not(feature = "cuda"))]
pub use off::{CudaBackend, compile_ptx, driver_available, nvrtc_available};
