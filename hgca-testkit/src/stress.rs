//! Concurrency stress: many threads decoding distinct sequences through
//! layers that share one backend, checked bit for bit against the same
//! sequences decoded one at a time, with a deadline (a deadlock fails).

use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::Duration;

use hgca_kernels::{AttnShape, Result};

use crate::Rng;

/// A layer decoding one sequence: `forward` of `n` tokens as
/// `SequenceAttention::forward` (q `[n, q_heads, d]`, K/V `[n, kv_heads,
/// d]`, out `[n, q_heads, d]`). hgca-hybrid's trait, restated here so the
/// test kit does not depend on the engine.
pub trait Decoder {
    /// One call of the layer.
    ///
    /// # Errors
    /// The layer's.
    fn step(&mut self, q: &[f32], k: &[f32], v: &[f32], n: usize, out: &mut [f32]) -> Result<()>;
}

/// A closure calling a layer's `forward` is a decoder:
/// `move |q, k, v, n, out| layer.forward(q, k, v, n, out)`.
impl<F: FnMut(&[f32], &[f32], &[f32], usize, &mut [f32]) -> Result<()>> Decoder for F {
    fn step(&mut self, q: &[f32], k: &[f32], v: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        self(q, k, v, n, out)
    }
}

/// Runs `f` on another thread and fails if it does not end within `secs`
/// (a deadlock fails the test instead of hanging CI); a panic inside `f`
/// is re-raised.
///
/// # Panics
/// On the deadline, or `f`'s panic.
pub fn within_secs<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = channel();
    let h = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
        Err(RecvTimeoutError::Disconnected) => match h.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(r) => r,
        },
        Err(RecvTimeoutError::Timeout) => panic!("not finished after {secs} s: deadlock?"),
    }
}

/// Sequence `seed`: a prompt of `prompt` tokens, then `steps` decode steps;
/// every output, in order.
///
/// # Panics
/// When the layer returns an error.
pub fn run_sequence<L: Decoder>(
    layer: &mut L,
    shape: &AttnShape,
    seed: u64,
    prompt: usize,
    steps: usize,
) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let (ql, kl) = (shape.q_len(), shape.kv_token_len());
    let mut outs = Vec::with_capacity((prompt + steps) * ql);
    let mut call = |n: usize, rng: &mut Rng| {
        let q: Vec<f32> = (0..n * ql).map(|_| rng.sym()).collect();
        let k: Vec<f32> = (0..n * kl).map(|_| 2.0 * rng.sym()).collect();
        let v: Vec<f32> = (0..n * kl).map(|_| rng.sym()).collect();
        let mut out = vec![0.0; n * ql];
        layer.step(&q, &k, &v, n, &mut out).expect("a valid step");
        outs.extend_from_slice(&out);
    };
    if prompt > 0 {
        call(prompt, &mut rng);
    }
    for _ in 0..steps {
        call(1, &mut rng);
    }
    outs
}

/// `threads` threads, each decoding its own sequence (seed = thread index)
/// for `steps` steps through a layer from `make` (all sharing whatever
/// backend `make` captures), must give bit for bit what the same sequences
/// give decoded one after another on one thread. Returns the number of
/// decode steps run concurrently.
///
/// # Panics
/// On a mismatch (naming the thread and the first differing step).
pub fn shared_backend_stress<L, F>(
    make: &F,
    shape: &AttnShape,
    threads: usize,
    prompt: usize,
    steps: usize,
) -> usize
where
    L: Decoder,
    F: Fn() -> L + Sync,
{
    let want: Vec<Vec<f32>> = (0..threads)
        .map(|t| run_sequence(&mut make(), shape, t as u64, prompt, steps))
        .collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || run_sequence(&mut make(), shape, t as u64, prompt, steps)))
            .collect();
        for (t, h) in hs.into_iter().enumerate() {
            let got = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            if got
                .iter()
                .map(|x| x.to_bits())
                .ne(want[t].iter().map(|x| x.to_bits()))
            {
                let ql = shape.q_len();
                let i = got
                    .iter()
                    .zip(&want[t])
                    .position(|(a, b)| a.to_bits() != b.to_bits())
                    .unwrap_or(0);
                panic!(
                    "thread {t}: output of token {} differs from the one-thread run ({} vs {})",
                    i / ql,
                    got[i],
                    want[t][i]
                );
            }
        }
    });
    threads * steps
}
