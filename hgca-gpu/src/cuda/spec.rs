//! Kernel specialisation: which `.cu` source NVRTC compiles for a window's
//! dtype, head dim and query group, and the launch geometry that goes with it.
//!
//! Available with or without the `cuda` feature (it is plain text
//! generation), so the sources can be inspected anywhere.

use hgca_kernels::{DType, Error, Result};

/// The CUDA C source of the attention kernels (decode, combine, weights,
/// append, ring write, eviction gather), specialised by `#define`s.
pub const ATTENTION_CU: &str = include_str!("attention.cu");
/// The CUDA C source of the merge kernel and the copy yardstick.
pub const MERGE_CU: &str = include_str!("merge.cu");

/// The CUDA C source of the dense FFN kernels (a hybrid FFN's hot
/// neurons; f16 weights).
pub const FFN_CU: &str = include_str!("ffn.cu");
/// Entry points of [`FFN_CU`].
pub const FFN_KERNELS: [&str; 5] = [
    FFN_GATE_UP_KERNEL,
    FFN_DOWN_KERNEL,
    FFN_GATE_UP_TILED_KERNEL,
    FFN_DOWN_TILED_KERNEL,
    FFN_DOWN_SUM_KERNEL,
];
/// The FFN's gate and up pass, a warp per (token, neuron).
pub const FFN_GATE_UP_KERNEL: &str = "hgca_ffn_gate_up";
/// The FFN's down pass per token (partial sums per split of the neurons).
pub const FFN_DOWN_KERNEL: &str = "hgca_ffn_down";
/// The FFN's gate and up pass over tiles of tokens (prompt chunks).
pub const FFN_GATE_UP_TILED_KERNEL: &str = "hgca_ffn_gate_up_tiled";
/// The FFN's down pass over tiles of tokens.
pub const FFN_DOWN_TILED_KERNEL: &str = "hgca_ffn_down_tiled";
/// The sum of the down pass's splits.
pub const FFN_DOWN_SUM_KERNEL: &str = "hgca_ffn_down_sum";

/// The split-K decode kernel, the one that must never spill.
pub const DECODE_KERNEL: &str = "hgca_decode_split";
/// The kernel that merges the decode's splits.
pub const COMBINE_KERNEL: &str = "hgca_decode_combine";
/// The kernel that turns decode scores into weights.
pub const WEIGHTS_KERNEL: &str = "hgca_decode_weights";
/// The causal append attention kernel.
pub const APPEND_KERNEL: &str = "hgca_append";
/// The kernel that writes appended rows into the ring.
pub const RING_WRITE_KERNEL: &str = "hgca_ring_write";
/// The kernel that gathers evicted rows.
pub const EVICT_KERNEL: &str = "hgca_evict_gather";
/// The n-way merge kernel of [`MERGE_CU`].
pub const MERGE_KERNEL: &str = "hgca_merge";
/// The copy yardstick of [`MERGE_CU`].
pub const COPY_KERNEL: &str = "hgca_copy";

/// Entry points of [`ATTENTION_CU`].
pub const ATTENTION_KERNELS: [&str; 6] = [
    DECODE_KERNEL,
    COMBINE_KERNEL,
    WEIGHTS_KERNEL,
    APPEND_KERNEL,
    RING_WRITE_KERNEL,
    EVICT_KERNEL,
];
/// Entry points of [`MERGE_CU`].
pub const MERGE_KERNELS: [&str; 2] = [MERGE_KERNEL, COPY_KERNEL];

/// The largest head dim the CUDA kernels take: the append kernel stages a
/// 32-token f32 tile of K or V plus 16 query rows in shared memory, which
/// for `d = 512` is 98 KiB (sm_80 and later allow up to 99 KiB or more).
pub const MAX_HEAD_DIM: usize = 512;
/// Threads per block of the decode, combine and append kernels.
pub const BLOCK_THREADS: u32 = 128;
/// Query rows per append block.
pub const APPEND_ROWS: usize = 16;
/// Depth of the decode kernel's cp.async pipeline (`kStages` in attention.cu).
pub const DECODE_STAGES: usize = 3;

/// One specialisation of [`ATTENTION_CU`]: storage dtype, head dim and the
/// number of query heads a decode block serves from one K/V load.
///
/// ```
/// use hgca_gpu::cuda::KernelSpec;
/// use hgca_kernels::DType;
/// let s = KernelSpec::new(DType::F16, 128, 4)?;
/// assert_eq!((s.vec(), s.lanes(), s.loads_per_lane()), (8, 16, 1));
/// assert_eq!(s.heads_per_block(), 4);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    dtype: DType,
    head_dim: usize,
    heads_per_block: usize,
    staged: bool,
}

impl KernelSpec {
    /// The specialisation for KV stored as `dtype`, head dim `head_dim` and
    /// `group` query heads per KV head.
    ///
    /// # Errors
    /// [`Error::Zero`] for a zero `head_dim` or `group`, [`Error::Capacity`]
    /// when `head_dim > MAX_HEAD_DIM`.
    pub fn new(dtype: DType, head_dim: usize, group: usize) -> Result<Self> {
        if head_dim == 0 {
            return Err(Error::Zero { what: "head_dim" });
        }
        if group == 0 {
            return Err(Error::Zero { what: "group" });
        }
        if head_dim > MAX_HEAD_DIM {
            return Err(Error::Capacity {
                what: "cuda head_dim",
                capacity: MAX_HEAD_DIM,
                requested: head_dim,
            });
        }
        let mut s = Self {
            dtype,
            head_dim,
            heads_per_block: 1,
            staged: false,
        };
        // q and the accumulators of all heads of a block live in registers:
        // 2 * heads * (loads * vec) floats per lane, at most 64.
        s.heads_per_block = group.min((32 / s.elems_per_lane()).clamp(1, 8));
        // The staged decode loop is opt-in ([`KernelSpec::with_staged`],
        // `CudaBackend::with_staged_decode`) until a device check has passed
        // the conformance suite with it.
        Ok(s)
    }

    /// The same specialisation with the shared-memory staged decode loop
    /// on or off (it applies to the 4-token specs only, see [`KernelSpec::staged`]).
    pub fn with_staged(mut self, on: bool) -> Self {
        self.staged = on;
        self
    }
    /// KV storage type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Head dim `d`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Query heads one decode block serves from one K/V load (GQA).
    pub fn heads_per_block(&self) -> usize {
        self.heads_per_block
    }
    /// Elements per vector load: 16 bytes when a row of `d` elements is a
    /// multiple of 16 bytes (rows then stay 16-byte aligned), else 1.
    pub fn vec(&self) -> usize {
        let esz = self.dtype.size();
        if (self.head_dim * esz).is_multiple_of(16) {
            16 / esz
        } else {
            1
        }
    }
    /// Lanes that share one K/V row in the decode kernel (a power of two, <= 32).
    pub fn lanes(&self) -> usize {
        (self.head_dim / self.vec()).next_power_of_two().min(32)
    }
    /// Vector loads per lane and row.
    pub fn loads_per_lane(&self) -> usize {
        (self.head_dim / self.vec()).div_ceil(self.lanes())
    }
    fn elems_per_lane(&self) -> usize {
        self.loads_per_lane() * self.vec()
    }
    /// Tokens each decode row loads per iteration: four when a row is
    /// exactly one 16-byte load per lane (d 64, 128, 256 in f16/bf16; 8 loads
    /// in flight per lane) and a block serves at most 4 heads, else two
    /// (ptxas spilled the 4-token form of d 96 bf16 and of f32 d 128 with 8
    /// heads per block on sm_90).
    pub fn unroll(&self) -> usize {
        let per_row = self.head_dim / self.vec();
        if self.vec() > 1 && per_row == self.lanes() && self.heads_per_block <= 4 {
            4
        } else {
            2
        }
    }
    /// Decode blocks per multiprocessor that the kernel's registers must
    /// allow (`__launch_bounds__`): 4 (at most 128 registers) on the
    /// 4-token path, whose speed is bytes in flight; otherwise ptxas decides.
    pub fn min_blocks(&self) -> usize {
        if self.unroll() == 4 { 4 } else { 1 }
    }
    /// Whether the decode loop stages K/V in shared memory with cp.async
    /// (`kStages` iterations of `unroll * decode_slots` tokens; sm_80+, the
    /// 4-token specs, whose rows are whole 16-byte pieces). Off unless asked
    /// for ([`KernelSpec::with_staged`], or `HGCA_CUDA_STAGED=1`).
    pub fn staged(&self) -> bool {
        self.staged && self.unroll() == 4
    }
    /// Independent token rows per decode block (each with its own online softmax).
    pub fn decode_slots(&self) -> usize {
        (BLOCK_THREADS as usize / 32) * (32 / self.lanes())
    }
    /// Dynamic shared memory of the decode kernel, bytes.
    pub fn decode_smem_bytes(&self) -> usize {
        let merge = 4 * self.decode_slots() * self.heads_per_block * (self.head_dim + 2);
        if self.staged() {
            // The merge scratch reuses the stages after the loop.
            let stages = DECODE_STAGES
                * 2
                * self.unroll()
                * self.decode_slots()
                * self.head_dim
                * self.dtype.size();
            merge.max(stages)
        } else {
            merge
        }
    }
    /// Dynamic shared memory of the append kernel, bytes.
    pub fn append_smem_bytes(&self) -> usize {
        4 * (APPEND_ROWS * self.head_dim + 32 * (self.head_dim + 1))
    }
    /// The full NVRTC source: the `#define`s of this specialisation, then [`ATTENTION_CU`].
    pub fn source(&self) -> String {
        let dt = match self.dtype {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
        };
        format!(
            "// hgca attention: dtype {}, d {}, {} heads per decode block\n\
             #define HGCA_DT {dt}\n#define HGCA_HD {}\n#define HGCA_VEC {}\n\
             #define HGCA_LANES {}\n#define HGCA_E {}\n#define HGCA_GB {}\n#define HGCA_U {}\n#define HGCA_MINB {}\n#define HGCA_ASYNC {}\n{}",
            self.dtype,
            self.head_dim,
            self.heads_per_block,
            self.head_dim,
            self.vec(),
            self.lanes(),
            self.loads_per_lane(),
            self.heads_per_block,
            self.unroll(),
            self.min_blocks(),
            u8::from(self.staged()),
            ATTENTION_CU
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_covers_every_element() {
        for dtype in DType::ALL {
            for d in 1..=MAX_HEAD_DIM {
                for group in [1, 2, 3, 4, 5, 8, 16] {
                    let s = KernelSpec::new(dtype, d, group).unwrap();
                    let nv = d / s.vec();
                    assert_eq!(nv * s.vec(), d);
                    assert!(s.lanes() * s.loads_per_lane() >= nv);
                    assert!(s.lanes().is_power_of_two() && s.lanes() <= 32);
                    let h = s.heads_per_block();
                    assert!((1..=8).contains(&h) && h <= group);
                    assert!(s.decode_smem_bytes() <= 48 * 1024, "{s:?}");
                    assert!(s.append_smem_bytes() <= 99 * 1024, "{s:?}");
                }
            }
        }
        assert!(KernelSpec::new(DType::F32, MAX_HEAD_DIM + 1, 1).is_err());
    }
}
