//! One typed wrapper per CUDA kernel, bound to its entry name: loaded from
//! a module by that name (never by position), and launched with a struct
//! of its arguments (`DecodeSplitArgs { kc, vc, .. }`: a call site names
//! every argument, the wrapper pushes them in order) whose names and types
//! are the `.cu` signature's, in its order (device pointers as `u64`, `int` as `i32`, `long long` as `i64`,
//! `size_t` as `u64`, `float` as `f32`). The unit test below parses the
//! `.cu` sources and checks each wrapper's list against its signature.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use hgca_kernels::{Error, Result};

use super::backend::BACKEND;
#[cfg(feature = "bench-timers")]
use super::spec::COPY_KERNEL;
use super::spec::{
    APPEND_KERNEL, COMBINE_KERNEL, DECODE_KERNEL, EVICT_KERNEL, FFN_DOWN_KERNEL,
    FFN_DOWN_SUM_KERNEL, FFN_DOWN_TILED_KERNEL, FFN_GATE_UP_KERNEL, FFN_GATE_UP_TILED_KERNEL,
    MERGE_KERNEL, RING_WRITE_KERNEL, WEIGHTS_KERNEL,
};

macro_rules! kernels {
    ($(
        $(#[$doc:meta])*
        $ty:ident($args:ident) = $name:ident {$($arg:ident: $t:ty),* $(,)?}
    )*) => {$(
        $(#[$doc])*
        #[derive(Debug)]
        pub(super) struct $ty(pub(super) CudaFunction);

        /// The arguments of the kernel, named as in its `.cu` signature.
        #[derive(Debug, Clone, Copy)]
        pub(super) struct $args {
            $(pub(super) $arg: $t,)*
        }

        impl $ty {
            /// The entry point's name in the PTX.
            pub(super) const NAME: &'static str = $name;
            /// The argument names and Rust types, in launch order.
            #[cfg(test)]
            pub(super) const ARGS: &'static [(&'static str, &'static str)] =
                &[$((stringify!($arg), stringify!($t))),*];

            /// The kernel of `module` named [`Self::NAME`].
            pub(super) fn load(module: &Arc<CudaModule>) -> Result<Self> {
                module.load_function(Self::NAME).map(Self).map_err(|e| {
                    Error::backend_from(BACKEND, format!("loading {}", Self::NAME), e)
                })
            }

            /// Queues the kernel on `stream`.
            ///
            /// # Safety
            /// Every pointer must address a live device allocation of at
            /// least the elements the kernel indexes for these sizes, and
            /// `cfg` must be the geometry the kernel is written for.
            pub(super) unsafe fn launch(
                &self,
                stream: &CudaStream,
                cfg: LaunchConfig,
                args: &$args,
            ) -> Result<()> {
                let mut b = stream.launch_builder(&self.0);
                $(b.arg(&args.$arg);)*
                // SAFETY: the caller's contract above; the arguments are the
                // signature's, in its order, by construction of this wrapper.
                unsafe { b.launch(cfg) }
                    .map(|_| ())
                    .map_err(|e| Error::backend_from(BACKEND, format!("launching {}", Self::NAME), e))
            }
        }
    )*};
}

kernels! {
    /// Split-K decode: partial outputs and lse per split (attention.cu).
    DecodeSplit(DecodeSplitArgs) = DECODE_KERNEL {
        kc: u64, vc: u64, q: u64, part_o: u64, part_lse: u64, scores: u64,
        cap: i32, start_slot: i32, len: i32, chunk: i32, group: i32, q_heads: i32,
        qscale: f32,
    }
    /// Merges the splits' partials into out and lse (and lse in base 2).
    DecodeCombine(DecodeCombineArgs) = COMBINE_KERNEL {
        part_o: u64, part_lse: u64, out: u64, lse_out: u64, lse2_out: u64,
        splits: i32, q_heads: i32,
    }
    /// Turns the decode's scores into attention weights in place.
    DecodeWeights(DecodeWeightsArgs) = WEIGHTS_KERNEL {scores: u64, lse2: u64, len: i32, q_heads: i32}
    /// Causal append attention of `n_q` queries over the window.
    Append(AppendArgs) = APPEND_KERNEL {
        kc: u64, vc: u64, q: u64, out: u64, lse_out: u64,
        cap: i32, start_slot: i32, len: i32, rel: i64, n_q: i32, group: i32, q_heads: i32,
        qscale: f32,
    }
    /// Writes staged K/V rows into the ring.
    RingWrite(RingWriteArgs) = RING_WRITE_KERNEL {
        kc: u64, vc: u64, ks: u64, vs: u64, cap: i32, write_slot: i32, n: i32, kv_heads: i32,
    }
    /// Gathers the oldest rows of the ring into a staging buffer.
    EvictGather(EvictGatherArgs) = EVICT_KERNEL {
        kc: u64, vc: u64, ko: u64, vo: u64, cap: i32, start_slot: i32, n: i32, kv_heads: i32,
    }
    /// The n-way LSE merge of partials (merge.cu).
    Merge(MergeArgs) = MERGE_KERNEL {
        parts_o: u64, parts_lse: u64, out: u64, lse: u64, n_parts: i32, rows: i32, d: i32,
    }
    /// The dense FFN's gate and up rows against the tokens (ffn.cu).
    FfnGateUp(FfnGateUpArgs) = FFN_GATE_UP_KERNEL {
        gate: u64, up: u64, x: u64, h: u64, n: i32, n_ff: i32, d: i32, rw: i32, act: i32,
    }
    /// The dense FFN's down rows, a partial sum per split of the neurons.
    FfnDown(FfnDownArgs) = FFN_DOWN_KERNEL {
        down: u64, h: u64, part: u64, n: i32, n_ff: i32, d: i32, rw: i32, chunk: i32,
    }
    /// [`FfnGateUp`] over tiles of tokens (the same arguments).
    FfnGateUpTiled(FfnGateUpTiledArgs) = FFN_GATE_UP_TILED_KERNEL {
        gate: u64, up: u64, x: u64, h: u64, n: i32, n_ff: i32, d: i32, rw: i32, act: i32,
    }
    /// [`FfnDown`] over tiles of tokens (the same arguments).
    FfnDownTiled(FfnDownTiledArgs) = FFN_DOWN_TILED_KERNEL {
        down: u64, h: u64, part: u64, n: i32, n_ff: i32, d: i32, rw: i32, chunk: i32,
    }
    /// The sum of the down pass's splits.
    FfnDownSum(FfnDownSumArgs) = FFN_DOWN_SUM_KERNEL {part: u64, out: u64, splits: i32, len: i64}
}

#[cfg(feature = "bench-timers")]
kernels! {
    /// A float4 copy, the bandwidth yardstick of the benchmark timers.
    CopyKernel(CopyArgs) = COPY_KERNEL {src: u64, dst: u64, n4: u64}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::{ATTENTION_CU, FFN_CU, MERGE_CU};

    /// The parameters of `name`'s definition in `src`, as (name, Rust type).
    fn signature(src: &str, name: &str) -> Vec<(String, &'static str)> {
        let at = src
            .find(&format!("\n{name}("))
            .unwrap_or_else(|| panic!("{name} is not defined in the source"));
        let rest = &src[at + name.len() + 2..];
        let params = &rest[..rest.find(')').expect("closing parenthesis")];
        params
            .split(',')
            .map(|p| {
                let p = p.trim();
                let ident = p
                    .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .next()
                    .unwrap_or("");
                let ty = if p.contains('*') {
                    "u64"
                } else if p.starts_with("long long") || p.starts_with("size_t") {
                    if p.starts_with("size_t") {
                        "u64"
                    } else {
                        "i64"
                    }
                } else if p.starts_with("int ") {
                    "i32"
                } else if p.starts_with("float ") {
                    "f32"
                } else {
                    panic!("{name}: parameter `{p}` of a type the wrappers do not map")
                };
                (ident.to_string(), ty)
            })
            .collect()
    }

    fn check(src: &str, name: &str, args: &[(&str, &str)]) {
        let want = signature(src, name);
        let got: Vec<(String, &str)> = args.iter().map(|&(a, t)| (a.to_string(), t)).collect();
        assert_eq!(
            got, want,
            "{name}: the wrapper's arguments against the .cu signature"
        );
    }

    #[test]
    fn wrappers_match_the_cu_signatures() {
        check(ATTENTION_CU, DecodeSplit::NAME, DecodeSplit::ARGS);
        check(ATTENTION_CU, DecodeCombine::NAME, DecodeCombine::ARGS);
        check(ATTENTION_CU, DecodeWeights::NAME, DecodeWeights::ARGS);
        check(ATTENTION_CU, Append::NAME, Append::ARGS);
        check(ATTENTION_CU, RingWrite::NAME, RingWrite::ARGS);
        check(ATTENTION_CU, EvictGather::NAME, EvictGather::ARGS);
        check(MERGE_CU, Merge::NAME, Merge::ARGS);
        check(FFN_CU, FfnGateUp::NAME, FfnGateUp::ARGS);
        check(FFN_CU, FfnDown::NAME, FfnDown::ARGS);
        check(FFN_CU, FfnGateUpTiled::NAME, FfnGateUpTiled::ARGS);
        check(FFN_CU, FfnDownTiled::NAME, FfnDownTiled::ARGS);
        check(FFN_CU, FfnDownSum::NAME, FfnDownSum::ARGS);
        #[cfg(feature = "bench-timers")]
        check(MERGE_CU, CopyKernel::NAME, CopyKernel::ARGS);
    }
}
