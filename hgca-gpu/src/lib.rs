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
