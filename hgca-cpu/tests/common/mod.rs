//! What the CPU test binaries share.

use hgca_cpu::{CpuBackend, IsaKind, Par};

/// The backend for `kind`, or `None` (skip, with the reason printed) when
/// the CPU lacks it. `HGCA_REQUIRE_ISAS=v3,v4` turns the skip into a failure.
pub fn backend(kind: IsaKind, par: Par) -> Option<CpuBackend> {
    match CpuBackend::new().with_isa(kind) {
        Ok(b) => Some(b.with_par(par).expect("thread pool")),
        Err(e) => {
            let required = std::env::var("HGCA_REQUIRE_ISAS").unwrap_or_default();
            if required.split(',').any(|r| r.trim() == kind.name()) {
                panic!(
                    "ISA {} is required (HGCA_REQUIRE_ISAS) but unavailable: {e}",
                    kind.name()
                );
            }
            eprintln!("SKIP: ISA {} not available here: {e}", kind.name());
            None
        }
    }
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
