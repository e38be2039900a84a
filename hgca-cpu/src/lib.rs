//! # hgca-cpu: the CPU side of hybrid attention
//!
//! Sparse gather-attention over selected entries of a CPU KV store, dense
//! attention (decode and causal append), and the merge, written once with
//! `pulp` and dispatched at run time to AVX-512, AVX2+FMA+F16C, NEON or scalar
//! code; threaded with rayon over (KV head, query group) and, when that
//! gives too few tasks, over token chunks merged exactly by LSE.
//!
//! GQA: each selected K and V row is read from memory once per query group
//! and used by every head of the group (a group of more than 8 heads is
//! served in parts of at most 8, each reading the rows once: the kernel
//! call holds fixed-size state for at most 8 heads). KV may be f32, f16 or bf16; it is
//! widened on load and all accumulation is f32.
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod backend;
mod batch;
mod ffn;
mod int4dot;
pub mod isa;
mod kdot;
mod kernel;
mod packed;
mod plan;
mod prefill;
mod qdot;
mod select;
mod window;

pub use backend::{CpuBackend, Executor, Par};
pub use batch::{BatchTokens, Shard};
pub use ffn::FfnStats;
pub use isa::{Isa, IsaKind};
pub use packed::{GROUP as PACK_GROUP, PackBlock, PackedRows};
pub use qdot::{DotBlock, DotKind, Q8Acts, QDotPath};
pub use select::{INT4_GROUP, INT8_TILE, Int4Keys, Int8Keys, quantize_i4, quantize_i8};
pub use window::{CpuPending, CpuWindow};
