//! Executor glue: hgca's CPU attention on candle's own worker threads.

use std::sync::Arc;

/// candle's own worker threads (the barrier pool of its quantised
/// matmuls) as an [`hgca_cpu::Executor`], so that hgca's attention runs on
/// the threads the matmuls use. Those threads spin for a while after each
/// matmul before they sleep: attention on rayon's threads beside them
/// fought them for the cores (SmolLM2 decode at context 2048 on 2 cores:
/// attention 6.6 ms per token in the model, 2.8 ms alone).
#[derive(Debug, Clone, Copy, Default)]
pub struct CandleThreads;

impl hgca_cpu::Executor for CandleThreads {
    fn threads(&self) -> usize {
        candle_core::utils::get_num_threads()
    }
    fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        candle_core::utils::barrier_pool().execute_chunked(n, |r| r.for_each(f));
    }
}

/// The CPU backend hgca-llm's attention runs on: the best ISA, and
/// candle's threads ([`CandleThreads`]).
pub fn cpu_backend() -> hgca_cpu::CpuBackend {
    hgca_cpu::CpuBackend::new().with_executor(Arc::new(CandleThreads))
}
