//! The library's version: its constants and the functions that report it.

use std::ffi::c_char;

/// Library version, major.
pub const HGCA_VERSION_MAJOR: u32 = 0;
/// Library version, minor.
pub const HGCA_VERSION_MINOR: u32 = 1;
/// Library version, patch.
pub const HGCA_VERSION_PATCH: u32 = 0;

/// The version, `major << 16 | minor << 8 | patch` (compare with `HGCA_VERSION_*`).
#[unsafe(no_mangle)]
pub extern "C" fn hgca_version() -> u32 {
    (HGCA_VERSION_MAJOR << 16) | (HGCA_VERSION_MINOR << 8) | HGCA_VERSION_PATCH
}

/// The version as text, e.g. `"0.1.0"` (static).
#[unsafe(no_mangle)]
pub extern "C" fn hgca_version_string() -> *const c_char {
    c"0.1.0".as_ptr()
}
