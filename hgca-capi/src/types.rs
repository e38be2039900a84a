//! The C ABI's plain data: status codes, `HGCA_*` constants and the
//! `repr(C)` structs callers fill in or read back.

// For the doc link of `hgca_hybrid_config`.
#[cfg(doc)]
use crate::hybrid::hgca_hybrid_config_default;

/// What a call did.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum hgca_status {
    /// Success.
    HGCA_OK = 0,
    /// A required pointer was null.
    HGCA_NULL_POINTER = 1,
    /// A buffer has the wrong number of elements.
    HGCA_LENGTH = 2,
    /// Shapes that must agree do not (heads, head dim, layouts).
    HGCA_SHAPE = 3,
    /// An index is out of range (a block index, a selected token, a shard).
    HGCA_INDEX = 4,
    /// A parameter is outside its domain (NaN, unknown enum value, ...).
    HGCA_PARAM = 5,
    /// A capacity would be exceeded, or a size overflows.
    HGCA_CAPACITY = 6,
    /// The host refused memory.
    HGCA_OUT_OF_MEMORY = 7,
    /// A dtype or feature is not supported here.
    HGCA_UNSUPPORTED = 8,
    /// A backend's driver failed.
    HGCA_BACKEND = 9,
    /// A count that must be positive was zero.
    HGCA_ZERO = 10,
    /// A struct's `size` is smaller than this library's struct.
    HGCA_ABI = 11,
    /// A panic inside hgca (a bug: please report the message).
    HGCA_PANIC = 12,
}

/// KV element type: 32-bit float.
pub const HGCA_DTYPE_F32: u32 = 0;
/// KV element type: IEEE half (`uint16_t` bits).
pub const HGCA_DTYPE_F16: u32 = 1;
/// KV element type: bfloat16 (`uint16_t` bits).
pub const HGCA_DTYPE_BF16: u32 = 2;

/// LSE base: natural log (hgca, vLLM).
pub const HGCA_LSE_BASE_E: u32 = 0;
/// LSE base: 2 (FlashInfer).
pub const HGCA_LSE_BASE_2: u32 = 1;
/// LSE layout `[tokens, heads]` (hgca, FlashInfer).
pub const HGCA_LSE_TOKENS_HEADS: u32 = 0;
/// LSE layout `[heads, tokens]` (vLLM).
pub const HGCA_LSE_HEADS_TOKENS: u32 = 1;

/// Cache layout: vLLM CPU, one tensor `(2, num_blocks, kv_heads, block_size, d)`.
pub const HGCA_KV_VLLM_CPU: u32 = 0;
/// Cache layout: vLLM/FlashAttention on the host, one tensor `(2, num_blocks, block_size, kv_heads, d)`.
pub const HGCA_KV_VLLM_FLASH: u32 = 1;
/// Cache layout: FlashInfer NHD, `k` and `v` each `[pages, page_size, kv_heads, d]`.
pub const HGCA_KV_FLASHINFER_NHD: u32 = 2;
/// Cache layout: FlashInfer HND, `k` and `v` each `[pages, kv_heads, page_size, d]`.
pub const HGCA_KV_FLASHINFER_HND: u32 = 3;
/// Cache layout: FlashInfer NHD, one tensor `[pages, 2, page_size, kv_heads, d]`.
pub const HGCA_KV_FLASHINFER_NHD_COMBINED: u32 = 4;
/// Cache layout: FlashInfer HND, one tensor `[pages, 2, kv_heads, page_size, d]`.
pub const HGCA_KV_FLASHINFER_HND_COMBINED: u32 = 5;
/// Cache layout: ggml token-major rows of `token_stride` elements (one page of `block_size` tokens).
pub const HGCA_KV_TOKEN_MAJOR: u32 = 6;
/// Cache layout: hgca head-major `[kv_heads, block_size, d]` (one page).
pub const HGCA_KV_HEAD_MAJOR: u32 = 7;
/// Cache layout: the general strided form (`k_offset`, `v_offset` and the three strides).
pub const HGCA_KV_STRIDED: u32 = 8;

/// Block table: dense `[batch, max_blocks]` with `seq_lens` (vLLM).
pub const HGCA_TABLE_DENSE: u32 = 0;
/// Block table: CSR `indptr / indices / last_page_len` (FlashInfer, SGLang).
pub const HGCA_TABLE_CSR: u32 = 1;

/// Recovery rule of the hybrid layer: frozen MAW (the paper's).
pub const HGCA_RECOVERY_FROZEN: u32 = 0;
/// Recovery: exact re-scoring of every CPU entry every `recovery_param` steps.
pub const HGCA_RECOVERY_RESCORE: u32 = 1;
/// Recovery: per-block key bounds, the top `recovery_param` blocks admitted per step.
pub const HGCA_RECOVERY_BLOCK_BOUNDS: u32 = 2;
/// Recovery: mass-targeted selection (`mass_target`, `mass_max_share`;
/// `recovery_param` unused): per KV head and step, CPU entries in
/// decreasing estimated weight until the estimated share of the attention
/// mass left out is at most `1 - mass_target`.
pub const HGCA_RECOVERY_MASS: u32 = 3;

/// Attention shape. `scale` 0 means the default `1/sqrt(head_dim)`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hgca_shape {
    /// `sizeof(hgca_shape)`.
    pub size: u32,
    /// Query heads.
    pub q_heads: u32,
    /// KV heads (divides `q_heads`).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Score scale; 0 for `1/sqrt(head_dim)`.
    pub scale: f32,
}

/// An engine's KV cache, borrowed for the call. Elements are counted in
/// the dtype's units (`uint16_t` for f16/bf16).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hgca_paged_cache {
    /// `sizeof(hgca_paged_cache)`.
    pub size: u32,
    /// `HGCA_DTYPE_*`.
    pub dtype: u32,
    /// `HGCA_KV_*`.
    pub layout: u32,
    /// K (or the one tensor of the one-tensor layouts).
    pub k: *const core::ffi::c_void,
    /// Elements at `k`.
    pub k_len: usize,
    /// V (null for the one-tensor layouts).
    pub v: *const core::ffi::c_void,
    /// Elements at `v`.
    pub v_len: usize,
    /// Pages (1 for the one-page layouts).
    pub num_blocks: usize,
    /// Tokens per page.
    pub block_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// `HGCA_KV_STRIDED`: elements from page to page.
    pub block_stride: usize,
    /// `HGCA_KV_STRIDED`, `HGCA_KV_TOKEN_MAJOR`: elements from token to token.
    pub token_stride: usize,
    /// `HGCA_KV_STRIDED`: elements from head to head.
    pub head_stride: usize,
    /// `HGCA_KV_STRIDED`: where K starts in `k`.
    pub k_offset: usize,
    /// `HGCA_KV_STRIDED`: where V starts in `v` (or in `k` when `v` is null).
    pub v_offset: usize,
}

/// Block tables of a batch, borrowed for the call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hgca_block_table {
    /// `sizeof(hgca_block_table)`.
    pub size: u32,
    /// `HGCA_TABLE_DENSE` or `HGCA_TABLE_CSR`.
    pub kind: u32,
    /// Sequences.
    pub batch: usize,
    /// Dense: `[batch, max_blocks]` page indices.
    pub table: *const u32,
    /// Dense: columns of `table`.
    pub max_blocks: usize,
    /// Dense: tokens per sequence, `[batch]`.
    pub seq_lens: *const u32,
    /// CSR: `[batch + 1]` offsets into `indices`.
    pub indptr: *const u32,
    /// CSR: page indices.
    pub indices: *const u32,
    /// CSR: elements of `indices`.
    pub indices_len: usize,
    /// CSR: tokens in each sequence's last page, `[batch]`.
    pub last_page_len: *const u32,
}

/// One sequence's selection, per KV head in compressed-row form: head
/// `g`'s token indices are `indices[offsets[g] .. offsets[g + 1]]`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hgca_selection {
    /// Token indices.
    pub indices: *const u32,
    /// Elements of `indices`.
    pub indices_len: usize,
    /// `kv_heads + 1` offsets, from 0, non-decreasing, the last `indices_len`.
    pub offsets: *const usize,
    /// Elements of `offsets`.
    pub offsets_len: usize,
}

/// Where a selector writes its selection.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hgca_selection_out {
    /// Room for token indices.
    pub indices: *mut u32,
    /// Elements `indices` holds.
    pub capacity: usize,
    /// `kv_heads + 1` offsets.
    pub offsets: *mut usize,
    /// Elements of `offsets`.
    pub offsets_len: usize,
    /// Out: indices written (or needed, with `HGCA_CAPACITY`).
    pub written: usize,
}

/// Outputs of an attention call, the caller's.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hgca_outputs {
    /// `sizeof(hgca_outputs)`.
    pub size: u32,
    /// `[rows, head_dim]`.
    pub out: *mut f32,
    /// Elements of `out`.
    pub out_len: usize,
    /// `[rows]` in `lse_base` and `lse_layout`.
    pub lse: *mut f32,
    /// Elements of `lse`.
    pub lse_len: usize,
    /// `HGCA_LSE_BASE_*`.
    pub lse_base: u32,
    /// `HGCA_LSE_*` layout.
    pub lse_layout: u32,
    /// Optional softmax weights of the attended entries (null for none).
    pub weights: *mut f32,
    /// Elements of `weights`.
    pub weights_len: usize,
}

/// One partial of a merge.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hgca_state {
    /// `[tokens, heads, head_dim]`.
    pub out: *const f32,
    /// Elements of `out`.
    pub out_len: usize,
    /// `[tokens * heads]` in the merge's base and layout.
    pub lse: *const f32,
    /// Elements of `lse`.
    pub lse_len: usize,
}

/// What the mass selector did for one KV head.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct hgca_head_mass {
    /// Pages selected.
    pub pages: usize,
    /// Estimated share of the head's attention mass they hold.
    pub estimated: f32,
    /// 1 when the head fell back to all its pages (dense).
    pub dense: u32,
}

/// Configuration of a hybrid layer ([`hgca_hybrid_config_default`] fills it).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hgca_hybrid_config {
    /// `sizeof(hgca_hybrid_config)`.
    pub size: u32,
    /// `HGCA_DTYPE_*` of the KV on both sides.
    pub dtype: u32,
    /// Dense window capacity in tokens.
    pub window: usize,
    /// Eviction block in tokens (a power of two, `<= window`).
    pub block: usize,
    /// The first `sinks` tokens are always attended.
    pub sinks: usize,
    /// `beta` of the rule `maw > beta / n_gpu`.
    pub beta: f32,
    /// MAW smoothing, in `[0, 1]`.
    pub alpha: f32,
    /// `HGCA_RECOVERY_*`.
    pub recovery: u32,
    /// The recovery's period or block count.
    pub recovery_param: usize,
    /// Queries a prompt chunk re-evaluates the MAW with.
    pub refresh_queries: usize,
    /// CPU threads: 1 runs on the calling thread, 0 on all cores.
    pub threads: u32,
    /// `HGCA_RECOVERY_MASS`: the estimated share of the attention mass to
    /// attend, in `(0, 1]`.
    pub mass_target: f32,
    /// `HGCA_RECOVERY_MASS`: the most CPU entries a KV head takes, as a
    /// share of them, in `(0, 1]`; a head needing more attends all of them.
    pub mass_max_share: f32,
}

/// What the last step of a hybrid layer did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct hgca_step_stats {
    /// `sizeof(hgca_step_stats)`.
    pub size: u32,
    /// Tokens in the dense window.
    pub window_tokens: usize,
    /// Tokens in the CPU store.
    pub cpu_tokens: usize,
    /// CPU entries attended, summed over KV heads.
    pub selected: usize,
    /// 1 when every CPU entry was attended.
    pub full_cpu: u32,
    /// Dense side, ns.
    pub dense_ns: u64,
    /// CPU side (selection and sparse attention), ns.
    pub sparse_ns: u64,
    /// Merge and MAW updates, ns.
    pub merge_ns: u64,
    /// Whole step, ns.
    pub total_ns: u64,
    /// `HGCA_RECOVERY_MASS`: the estimated share of the attention mass the
    /// step attended, the mean over KV heads; NaN under the other rules and
    /// on steps that attend every entry.
    pub mass_estimated: f32,
    /// `HGCA_RECOVERY_MASS`: KV heads that attended every CPU entry because
    /// the target needed more than `mass_max_share`.
    pub dense_heads: usize,
}
