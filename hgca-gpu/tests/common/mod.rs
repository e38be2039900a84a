//! Checks that the wgpu and CUDA tests share beyond hgca-testkit's (they
//! need hgca-hybrid and hgca-cpu, which the testkit does not depend on).

use hgca_hybrid::HybridFfn;
use hgca_kernels::{DenseFfnBackend, FfnAct, f16};
use hgca_testkit::ffn::FfnProblem;

/// A hybrid FFN whose hot neurons (every third) run on `b` and whose cold
/// ones run on the CPU with threshold 0 equals the reference dense FFN, and
/// counts every hot and cold neuron of every token.
pub fn hybrid_ffn_dense_side<B: DenseFfnBackend>(b: B) {
    let (d, n_ff, n) = (96, 200, 3);
    let p = FfnProblem::<f16>::random(d, n_ff, n, 8);
    let w = p.weights().unwrap();
    let hot: Vec<u32> = (0..n_ff as u32).filter(|i| i % 3 == 0).collect();
    let ffn = HybridFfn::new(b, hgca_cpu::CpuBackend::new(), FfnAct::Silu, &w, &hot, 0.0).unwrap();
    let mut out = vec![f32::NAN; n * d];
    let st = ffn.forward(&p.x, n, &mut out).unwrap();
    assert_eq!(st.hot, hot.len() * n);
    assert_eq!(st.cold.active, (n_ff - hot.len()) * n);
    let all: Vec<usize> = (0..n_ff).collect();
    p.check(FfnAct::Silu, &vec![all; n], &out).unwrap();
}
