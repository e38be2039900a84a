//! The one skip policy of hgca's tests.
//!
//! A test that needs what a machine may lack (an ISA, a wgpu adapter, NVRTC,
//! a CUDA GPU, `/proc/cpuinfo`) asks [`available`] or calls [`skip`]. Without
//! it the test prints a `SKIP:` line naming the capability and the reason,
//! and passes, unless the capability is listed in `HGCA_REQUIRE`
//! (comma-separated), which turns the skip into a failure.
//!
//! Who lists what:
//! - `scripts/test.sh` under `CI=true`: `wgpu`, `nvrtc`, `neon` (its qemu
//!   script), `proc-cpuinfo`, and the x86 ISAs (`v3`, `v4`) that
//!   `/proc/cpuinfo` reports, read independently of the library's detection.
//!
//! The model tests of hgca-llm are not hardware tests: without the model
//! files (`scripts/fetch-model.sh`) they print their own `SKIP:` line.
//! - `scripts/neon-test.sh`: `neon`.
//! - `scripts/gpu-check.sh`: `nvrtc` and `cuda`.
//!
//! ```
//! use hgca_testkit::require;
//! let r: Result<u32, std::io::Error> = Err(std::io::Error::other("no such device"));
//! // `demo-device` is in no HGCA_REQUIRE list: this skips, with a line.
//! assert_eq!(require::available("demo-device", r), None);
//! ```

use std::fmt::Display;

/// The environment variable that lists the required capabilities.
pub const ENV: &str = "HGCA_REQUIRE";

/// Whether `capability` is listed in [`ENV`].
pub fn required(capability: &str) -> bool {
    std::env::var(ENV).is_ok_and(|list| list.split(',').any(|c| c.trim() == capability))
}

/// Prints why a test skips for lack of `capability`, or panics when
/// `capability` is required.
///
/// # Panics
/// When [`required`]`(capability)`.
pub fn skip(capability: &str, reason: impl Display) {
    assert!(
        !required(capability),
        "{capability} is required ({ENV}) but unavailable: {reason}"
    );
    eprintln!("SKIP: {capability} unavailable: {reason} (list it in {ENV} to fail instead)");
}

/// `r`'s value, or `None` after [`skip`] with its error and the error's
/// sources ([`hgca_kernels::report`]) as the reason.
///
/// # Panics
/// When `r` is an error and `capability` is required.
pub fn available<T, E: std::error::Error + 'static>(
    capability: &str,
    r: Result<T, E>,
) -> Option<T> {
    match r {
        Ok(t) => Some(t),
        Err(e) => {
            skip(capability, hgca_kernels::report(&e));
            None
        }
    }
}

/// The first CPU's flags from `/proc/cpuinfo` (read independently of any
/// library's detection), or `None` after [`skip`] of `proc-cpuinfo` where
/// the file cannot be read.
///
/// # Panics
/// When the file is unreadable and `proc-cpuinfo` is required.
pub fn cpuinfo_flags() -> Option<std::collections::HashSet<String>> {
    let info = available("proc-cpuinfo", std::fs::read_to_string("/proc/cpuinfo"))?;
    Some(
        info.lines()
            .find(|l| l.starts_with("flags"))
            .map(|l| l.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default(),
    )
}
