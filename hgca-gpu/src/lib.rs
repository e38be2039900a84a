//! # hgca-gpu: the GPU side of hybrid attention
//!
//! Dense attention with LSE over a circular KV window, and the LSE merge,
//! behind the traits of `hgca-kernels`:
//!
//! - [`wgpu`] (cargo feature `wgpu`): WGSL compute shaders, portable
//!   (Vulkan, Metal, DX12; also Mesa's software Vulkan driver).
//! - [`cuda`] (cargo feature `cuda`): CUDA C kernels compiled at run time by
//!   NVRTC through `cudarc`.
//!
//! With a feature off, its types still exist and their constructors return
//! [`hgca_kernels::Error::NotCompiledIn`].
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod cuda;
pub mod wgpu;

/// A matrix of f16 rows of `d` values as rows of `rw` 32-bit words, pairs
/// packed low half first (the layout WGSL's `unpack2x16float` and the CUDA
/// FFN kernels read), an odd row's last half zero: the FFN weights as both
/// GPU backends hold them.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn pack_f16_pairs(m: &[hgca_kernels::f16], d: usize, rw: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(m.len().div_ceil(d.max(1)) * rw);
    for row in m.chunks_exact(d) {
        for pair in row.chunks(2) {
            let lo = u32::from(pair[0].to_bits());
            let hi = pair.get(1).map_or(0, |h| u32::from(h.to_bits()));
            out.push(lo | (hi << 16));
        }
    }
    out
}
