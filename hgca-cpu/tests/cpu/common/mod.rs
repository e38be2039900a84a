//! What the CPU test binaries share.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use hgca_cpu::{CpuBackend, Executor, IsaKind, Par};

/// How a test backend runs its parallel work: rayon's way ([`Par`]) or on
/// a caller's executor of this many threads ([`ScopedThreads`]).
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)]
pub enum Threads {
    Par(Par),
    Exec(usize),
}

impl From<Par> for Threads {
    fn from(p: Par) -> Self {
        Threads::Par(p)
    }
}

/// An executor as an engine's pool would be, with no rayon in it: each
/// `run` starts `threads - 1` scoped threads beside the caller, and all
/// take indices from a shared cursor.
#[derive(Debug)]
pub struct ScopedThreads(pub usize);

impl Executor for ScopedThreads {
    fn threads(&self) -> usize {
        self.0
    }
    fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let next = AtomicUsize::new(0);
        let work = || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                f(i);
            }
        };
        std::thread::scope(|s| {
            for _ in 1..self.0 {
                s.spawn(work);
            }
            work();
        });
    }
}

/// The backend for `kind`, or `None` (skip, with the reason printed) when
/// the CPU lacks it; a failure instead when the ISA's name (`v3`, `v4`,
/// `neon`) is listed in `HGCA_REQUIRE` (`hgca_testkit::require`).
pub fn backend(kind: IsaKind, threads: impl Into<Threads>) -> Option<CpuBackend> {
    let b = hgca_testkit::require::available(kind.name(), CpuBackend::new().with_isa(kind))?;
    Some(match threads.into() {
        Threads::Par(par) => b.with_par(par).expect("thread pool"),
        Threads::Exec(n) => b.with_executor(Arc::new(ScopedThreads(n))),
    })
}

/// Instantiates the suite macro `$suite` for every ISA of the target.
#[macro_export]
macro_rules! every_isa {
    ($suite:ident) => {
        $suite!(scalar, hgca_cpu::IsaKind::Scalar);
        #[cfg(target_arch = "x86_64")]
        $suite!(v3, hgca_cpu::IsaKind::V3);
        #[cfg(target_arch = "x86_64")]
        $suite!(v4, hgca_cpu::IsaKind::V4);
        #[cfg(target_arch = "aarch64")]
        $suite!(neon, hgca_cpu::IsaKind::Neon);
    };
}
