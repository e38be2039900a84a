//! # hgca-kernels: the contract of hybrid GPU-CPU attention
//!
//! Shapes, dtypes, partial results, the exact log-sum-exp merge, MAW-based
//! selection and the backend traits that the CPU (`hgca-cpu`), wgpu and CUDA
//! (`hgca-gpu`) backends implement.
//!
//! For a query `q` and a token set `S`: `s_j = scale * dot(q, k_j)`,
//! `m = max s_j`, `l = Σ exp(s_j - m)`, `o = Σ exp(s_j - m) v_j / l`,
//! `lse = m + ln l` (**natural log**; see [`lse_from_log2`] and
//! [`lse_to_log2`] for base-2 peers). The empty set gives `(0, -inf)`.
//! Merging the partials of any partition of `S` gives the attention over `S`.
//!
//! ```
//! use hgca_kernels::{merge, AttnShape, Partial, PartialLayout};
//! let shape = AttnShape::new(2, 1, 4)?;
//! let layout = PartialLayout::decode(&shape);
//! let a = Partial::from_vecs(layout, vec![1.0; 8], vec![0.5, -1.0])?;
//! let b = Partial::empty(layout);
//! let mut out = Partial::poisoned(layout);
//! merge(&[a.as_ref(), b.as_ref()], out.as_mut())?;
//! assert_eq!(out, a); // the empty partial is the identity
//! # Ok::<(), hgca_kernels::Error>(())
//! ```
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

pub mod backend;
mod dtype;
mod error;
pub mod ffn;
mod kv;
mod lse;
pub mod maw;
mod mem;
pub mod merge;
mod paged;
mod pages;
mod partial;
mod shape;

pub use backend::{
    DenseAttention, KvWindow, MergeBackend, SparseAttention, WindowBackend, WindowSpec,
    check_prefetch,
};
pub use dtype::{DType, KvElem};
pub use error::{Cause, Error, Result, check_len, check_len_of, report, weights_not_requested};
pub use ffn::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, DenseFfnBackend, FfnAct,
    FfnOwned, FfnSplit, FfnWeights, Neurons, WeightElem, check_neurons,
};
pub use half::{bf16, f16};
pub use kv::{CpuStore, KvSlices, KvSource, KvStore, Selection, SelectionRef};
pub use lse::{LseBase, LseFormat, LseLayout, merge_states, merge_states_into};
pub use maw::{Alpha, Beta};
pub use mem::{HUGE_PAGE, HostBuf};
pub use merge::{
    ScalarMerge, lse_from_log2, lse_to_log2, merge, merge_into, merge_rows, merge2_row,
};
pub use paged::{BlockTable, PagedBatch, PagedLayout, PagedPool, PagedSeq};
pub use pages::{HeadMass, MassTarget, PageBounds, select_by_mass, select_top_pages};
pub use partial::{Partial, PartialLayout, PartialMut, PartialRef};
pub use shape::AttnShape;
