//! [`dense_backend_suite!`](crate::dense_backend_suite): the one conformance
//! suite every window backend (CPU, wgpu, CUDA) instantiates.

/// The conformance suite of a window backend (`WindowBackend +
/// DenseAttention + MergeBackend`), as a module of tests.
///
/// ```text
/// hgca_testkit::dense_backend_suite! {
///     mod suite;
///     backend: backend,      // fn() -> Option<&'static B>: None skips
///     other: other_backend,  // a second instance of B, for foreign objects
///     shared_windows: false, // whether another instance may use a window
///     max_head_dim: 256,     // head dims above it must be refused
///     cases: 32,             // proptest cases per property
///     stress_steps: 1000,    // decode steps per thread of the stress test
/// }
/// ```
///
/// The backend functions and `max_head_dim` are resolved in the calling
/// module; the functions decide skips with [`crate::require`]. The calling
/// crate must depend on `hgca-kernels`, `hgca-cpu` and `hgca-hybrid` (the
/// hybrid integration puts the backend in the dense role beside a
/// `CpuBackend`), and `proptest`.
///
/// The tests: the dense edge table, ring wrap-around, NaN rows, random
/// windows (proptest); the merge's edge table, special values and random
/// partitions; submissions in flight; the error paths (bad inputs,
/// unrequested weights, objects of another instance); prefetches; a hybrid
/// batch exact over the attended union in f32 and f16; and 8 threads
/// sharing the backend, bit for bit one thread's results.
#[macro_export]
macro_rules! dense_backend_suite {
    (
        mod $m:ident;
        backend: $backend:ident,
        other: $other:ident,
        shared_windows: $shared:expr,
        max_head_dim: $max_d:expr,
        cases: $cases:expr,
        stress_steps: $steps:expr $(,)?
    ) => {
        mod $m {
            // The backend functions and the limit's constant are the caller's.
            #[allow(unused_imports)]
            use super::*;
            use $crate::proptest::prelude::*;

            fn ok(r: Result<(), String>) {
                if let Err(e) = r {
                    panic!("{e}");
                }
            }

            #[test]
            fn dense_edge_table() {
                let Some(b) = $backend() else { return };
                ok($crate::dense::check_edge_table(b, $max_d));
            }

            #[test]
            fn ring_wraparound() {
                let Some(b) = $backend() else { return };
                ok($crate::dense::check_ring_wraparound(b));
            }

            #[test]
            fn nan_rows_stay_nan() {
                let Some(b) = $backend() else { return };
                ok($crate::dense::check_nan_rows(b));
            }

            #[test]
            fn merge_edge_table() {
                let Some(b) = $backend() else { return };
                ok($crate::dense::check_merge_edge_table(b));
            }

            #[test]
            fn merge_special_values() {
                let Some(b) = $backend() else { return };
                ok($crate::dense::check_merge_special_values(b));
            }

            #[test]
            fn submissions_in_flight() {
                let Some(b) = $backend() else { return };
                ok($crate::dense::check_overlap(b));
            }

            #[test]
            fn bad_inputs_are_typed_errors() {
                let Some(b) = $backend() else { return };
                ok($crate::dense::check_bad_inputs(b));
            }

            #[test]
            fn objects_of_another_instance() {
                let Some(a) = $backend() else { return };
                let Some(o) = $other() else { return };
                ok($crate::dense::check_foreign(a, o, $shared));
            }

            #[test]
            fn prefetched_evictions() {
                let Some(b) = $backend() else { return };
                ok($crate::dense::check_prefetch(b));
            }

            proptest! {
                #![proptest_config(ProptestConfig {
                    cases: $cases,
                    failure_persistence: None,
                    ..ProptestConfig::default()
                })]

                #[test]
                fn dense_random(
                    s in $crate::arb_shape(),
                    spread in $crate::arb_spread(),
                    dt in prop::sample::select(::hgca_kernels::DType::ALL.to_vec()),
                    tokens in 0usize..160,
                    cap in 1usize..100,
                    chunk in 1usize..24,
                    evict in 1usize..24,
                    seed in any::<u64>(),
                ) {
                    let Some(b) = $backend() else { return Ok(()) };
                    if s.head_dim() > $max_d {
                        let spec = ::hgca_kernels::WindowSpec::new(s, cap, dt).unwrap();
                        let r = ::hgca_kernels::WindowBackend::new_window(b, spec);
                        let refused = matches!(r, Err(::hgca_kernels::Error::Capacity { .. }));
                        prop_assert!(refused, "a head dim above the limit must be refused");
                        return Ok(());
                    }
                    let r = $crate::conformance::check_dense(
                        b, s, dt, cap, tokens, chunk, evict, spread, seed,
                    );
                    prop_assert!(r.is_ok(), "{}", r.unwrap_err());
                }

                #[test]
                fn merge_random(
                    s in $crate::arb_shape(),
                    spread in $crate::arb_spread(),
                    tokens in 0usize..80,
                    n_parts in 1usize..6,
                    seed in any::<u64>(),
                ) {
                    let Some(b) = $backend() else { return Ok(()) };
                    let r = $crate::conformance::check_merge_partition(
                        b, s, tokens, spread, n_parts, seed,
                    );
                    prop_assert!(r.is_ok(), "{}", r.unwrap_err());
                }
            }

            /// The hybrid engine with this backend in the dense role: a
            /// batch of two sequences on one backend shared by reference,
            /// the CPU attending the stores. A prompt's last query is exact
            /// attention over all its tokens; every decode step is exact
            /// attention over what it attended (window plus selected CPU
            /// entries), both against hgca-ref in f64.
            #[test]
            fn hybrid_batch_is_exact_over_the_attended_union() {
                let Some(b) = $backend() else { return };
                hybrid_case::<f32>(b);
                hybrid_case::<::hgca_kernels::f16>(b);
            }

            fn hybrid_case<T: ::hgca_kernels::KvElem>(
                dense: &(impl ::hgca_kernels::DenseAttention + Sync),
            ) {
                use ::hgca_hybrid::{HybridBatch, HybridConfig, Recovery};
                let s = ::hgca_kernels::AttnShape::new(8, 2, 32).unwrap();
                let (ql, kl) = (s.q_len(), s.kv_token_len());
                let tol = $crate::Tolerance::of(T::DTYPE);
                let cfg = HybridConfig {
                    window: 64,
                    block: 16,
                    beta: 0.5,
                    recovery: Recovery::BlockBounds { top: 1 },
                    ..HybridConfig::default()
                };
                let cpu = ::hgca_cpu::CpuBackend::new();
                let mut batch = HybridBatch::<_, _, T>::new(s, cfg, dense, cpu).unwrap();
                let ids = [batch.add().unwrap(), batch.add().unwrap()];
                let mut logs = [$crate::KvLog::<T>::new(s), $crate::KvLog::<T>::new(s)];
                let mut rng = $crate::Rng::new(17);
                let mut rows = |n: usize, width: usize| -> Vec<f32> {
                    (0..n * width).map(|_| 1.5 * rng.sym()).collect()
                };
                // A prompt longer than the window for the first sequence.
                let n = 150;
                let (q, k, v) = (rows(n, ql), rows(n, kl), rows(n, kl));
                let mut out = vec![f32::NAN; n * ql];
                batch.forward(ids[0], &q, &k, &v, n, &mut out).unwrap();
                logs[0].push(&k, &v, n);
                let all = vec![(0..n).collect::<Vec<_>>(); s.kv_heads()];
                let last = (n - 1) * ql;
                if let Err(e) = logs[0].check_decode(&q[last..], &all, &out[last..], tol) {
                    panic!("{}: prompt's last query: {e}", T::DTYPE);
                }
                let mut partial = 0;
                for step in 0..40 {
                    let (q, k, v) = (rows(2, ql), rows(2, kl), rows(2, kl));
                    let mut out = vec![f32::NAN; 2 * ql];
                    batch.decode(&ids, &q, &k, &v, &mut out).unwrap();
                    for (i, (&id, log)) in ids.iter().zip(&mut logs).enumerate() {
                        log.push(&k[i * kl..(i + 1) * kl], &v[i * kl..(i + 1) * kl], 1);
                        let sel = batch.last_selection(id).unwrap();
                        let sets = log.attended(sel, batch.cpu_tokens(id).unwrap());
                        partial += sets.iter().filter(|x| x.len() < log.len()).count();
                        let (q, out) = (&q[i * ql..(i + 1) * ql], &out[i * ql..(i + 1) * ql]);
                        if let Err(e) = log.check_decode(q, &sets, out, tol) {
                            panic!("{} step {step} sequence {i}: {e}", T::DTYPE);
                        }
                    }
                }
                assert!(
                    partial > 0,
                    "{}: no step attended a partial selection",
                    T::DTYPE
                );
                assert_eq!(batch.len(ids[1]).unwrap(), 40);
            }

            /// 8 threads share the backend (the window side) and one CPU
            /// backend, each decoding its own sequence with its own hybrid
            /// layer: bit for bit what the same sequences give one at a
            /// time, within a deadline (a deadlock fails).
            #[test]
            fn eight_threads_share_the_backend() {
                use ::hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
                use $crate::stress::{shared_backend_stress, within_secs};
                let Some(b) = $backend() else { return };
                within_secs(900, move || {
                    let s = ::hgca_kernels::AttnShape::new(4, 2, 16).unwrap();
                    let cfg = HybridConfig {
                        window: 64,
                        block: 16,
                        recovery: Recovery::BlockBounds { top: 4 },
                        ..HybridConfig::default()
                    };
                    let cpu = ::hgca_cpu::CpuBackend::new();
                    let make = || {
                        let mut l =
                            HybridAttention::<_, _, f32>::new(s, cfg.clone(), b, cpu.clone())
                                .unwrap();
                        move |q: &[f32], k: &[f32], v: &[f32], n: usize, out: &mut [f32]| {
                            l.forward(q, k, v, n, out)
                        }
                    };
                    let t = std::time::Instant::now();
                    let steps = shared_backend_stress(&make, &s, 8, 96, $steps);
                    println!(
                        "{}: {steps} concurrent decode steps, equal bit for bit, in {:.1?}",
                        ::hgca_kernels::DenseAttention::name(b),
                        t.elapsed()
                    );
                });
            }
        }
    };
}
