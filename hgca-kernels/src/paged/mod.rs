//! Engine-owned KV caches read where they lie: a pool of pages described by
//! strides ([`PagedPool`]), block tables in the two conventions engines use
//! ([`BlockTable`]), and the validated per-sequence view ([`PagedSeq`]) that
//! implements [`KvSource`] with no copy.
//!
//! A pool holds `num_blocks` pages of `block_size` tokens. Element
//! `(page p, token-in-page i, KV head h, dim c)` of K lies at
//! `k_offset + p * block_stride + i * token_stride + h * head_stride + c`
//! of the K slice (V alike, with `v_offset`); `head_dim` is contiguous. The
//! named constructors give these strides for the layouts engines keep:
//!
//! | constructor | engine | shape |
//! |---|---|---|
//! | [`PagedPool::vllm_cpu`] | vLLM's CPU attention backend | `(2, num_blocks, kv_heads, block_size, d)` |
//! | [`PagedPool::vllm_flash`] | vLLM / FlashAttention's GPU cache held on the host | `(2, num_blocks, block_size, kv_heads, d)` |
//! | [`PagedPool::flashinfer_nhd`] | FlashInfer NHD, K and V separate | `[pages, page_size, kv_heads, d]` each |
//! | [`PagedPool::flashinfer_hnd`] | FlashInfer HND, K and V separate | `[pages, kv_heads, page_size, d]` each |
//! | [`PagedPool::flashinfer_nhd_combined`] | FlashInfer NHD, one tensor | `[pages, 2, page_size, kv_heads, d]` |
//! | [`PagedPool::flashinfer_hnd_combined`] | FlashInfer HND, one tensor | `[pages, 2, kv_heads, page_size, d]` |
//! | [`PagedPool::token_major`] | llama.cpp / ggml's cache | one row of `row_stride` elements per token, heads `[kv_heads, d]` inside |
//! | [`PagedPool::head_major`] | hgca's own `[kv_heads, tokens, d]` ([`crate::KvSlices`]) | one page |
//!
//! Everything is validated once, when a view is built: every block index
//! `< num_blocks`, every length within its table row, and every row the
//! strides can reach inside the slices. The rows a kernel then reads cannot
//! be out of bounds.
//!
//! ```
//! use hgca_kernels::{BlockTable, KvSource, PagedBatch, PagedPool};
//! // vLLM's CPU cache: (2, num_blocks=4, kv_heads=2, block_size=3, d=2)
//! let cache: Vec<f32> = (0..2 * 4 * 2 * 3 * 2).map(|x| x as f32).collect();
//! let pool = PagedPool::vllm_cpu(&cache, 4, 2, 3, 2)?;
//! // two sequences: 5 tokens in blocks [2, 0], 1 token in block [3]
//! let table = [2, 0, 3, 0];
//! let lens = [5, 1];
//! let batch = PagedBatch::new(pool, BlockTable::dense(&table, 2, &lens)?)?;
//! let s0 = batch.seq(0).unwrap();
//! assert_eq!(s0.tokens(), 5);
//! // token 4 is token 1 of block 0; KV head 1 of it starts at 0*12 + 1*6 + 1*2
//! assert_eq!(s0.k_row(1, 4), &[8.0, 9.0]);
//! // V is the second half of the tensor
//! assert_eq!(s0.v_row(0, 0)[0], 48.0 + 2.0 * 12.0);
//! # Ok::<(), hgca_kernels::Error>(())
//! ```
//!
//! Files: `pool.rs` (the layout and the named constructors), `table.rs`
//! (block tables), `seq.rs` (the validated batch and per-sequence views).

mod pool;
mod seq;
mod table;

pub use pool::{PagedLayout, PagedPool};
pub use seq::{PagedBatch, PagedSeq};
pub use table::BlockTable;
