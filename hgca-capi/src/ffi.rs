//! The boundary layer every call goes through: failures as statuses, the
//! calling thread's last error, panics caught, and the checks that turn C
//! pointers, lengths and struct sizes into Rust references and slices.

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use hgca_kernels::Error;

use crate::types::hgca_status::{self, *};
use crate::types::{
    hgca_block_table, hgca_hybrid_config, hgca_outputs, hgca_paged_cache, hgca_shape,
    hgca_step_stats,
};

/// A failed call: its status and message.
pub(crate) struct Fail(pub(crate) hgca_status, pub(crate) String);

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        let s = match &e {
            Error::Zero { .. } => HGCA_ZERO,
            Error::GroupMismatch { .. }
            | Error::ShapeMismatch { .. }
            | Error::ForeignObject { .. } => HGCA_SHAPE,
            Error::Length { .. } => HGCA_LENGTH,
            Error::Index { .. } => HGCA_INDEX,
            Error::Param { .. } => HGCA_PARAM,
            Error::Capacity { .. } => HGCA_CAPACITY,
            Error::OutOfMemory { .. } => HGCA_OUT_OF_MEMORY,
            Error::UnsupportedDType { .. } | Error::NotCompiledIn { .. } => HGCA_UNSUPPORTED,
            Error::Unavailable { .. } | Error::Backend { .. } => HGCA_BACKEND,
            _ => HGCA_BACKEND,
        };
        Fail(s, hgca_kernels::report(&e))
    }
}

pub(crate) type R<T = ()> = Result<T, Fail>;

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = c);
}

/// Runs `f`, turning its error or panic into a status and the thread's message.
pub(crate) fn guard(f: impl FnOnce() -> R) -> hgca_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_last("");
            HGCA_OK
        }
        Ok(Err(Fail(s, m))) => {
            set_last(&m);
            s
        }
        Err(p) => {
            let m = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last(&format!("panic inside hgca (a bug): {m}"));
            HGCA_PANIC
        }
    }
}

pub(crate) fn fail<T>(s: hgca_status, m: impl Into<String>) -> R<T> {
    Err(Fail(s, m.into()))
}

/// `&*p`, or `HGCA_NULL_POINTER` naming `what`.
///
/// # Safety
/// `p` is null or points to a valid `T` for the call.
pub(crate) unsafe fn deref<'a, T>(p: *const T, what: &str) -> R<&'a T> {
    if p.is_null() {
        return fail(HGCA_NULL_POINTER, format!("{what} is null"));
    }
    if !(p as usize).is_multiple_of(core::mem::align_of::<T>()) {
        return fail(HGCA_PARAM, format!("{what} is not aligned for its type"));
    }
    // SAFETY: non-null and aligned; valid by the caller's contract.
    Ok(unsafe { &*p })
}

/// `&mut *p`, or `HGCA_NULL_POINTER` / `HGCA_PARAM` (misaligned) naming `what`.
///
/// # Safety
/// `p` is null or points to a valid `T`, not aliased for the call.
pub(crate) unsafe fn deref_mut<'a, T>(p: *mut T, what: &str) -> R<&'a mut T> {
    // SAFETY: the caller's contract (null and alignment are checked there).
    unsafe { deref(p.cast_const(), what) }?;
    // SAFETY: as above, and exclusive by the caller's contract.
    Ok(unsafe { &mut *p })
}

/// The structs whose first field is their `u32` size.
pub(crate) trait SizeFirst {
    /// The struct's C name, for messages.
    const NAME: &'static str;
}

macro_rules! size_first {
    ($($t:ident),*) => {$(
        impl SizeFirst for $t {
            const NAME: &'static str = stringify!($t);
        }
    )*};
}

size_first!(
    hgca_shape,
    hgca_paged_cache,
    hgca_block_table,
    hgca_outputs,
    hgca_hybrid_config,
    hgca_step_stats
);

/// `&*p` for a struct with a leading `size`: the size is read (and
/// checked) before the rest of the struct is, so an older, smaller struct
/// is refused with `HGCA_ABI` instead of being read past its end.
///
/// # Safety
/// `p` is null or points to at least `size` valid bytes, `size` being its
/// first field.
pub(crate) unsafe fn sized<'a, T: SizeFirst>(p: *const T, what: &str) -> R<&'a T> {
    if p.is_null() {
        return fail(HGCA_NULL_POINTER, format!("{what} is null"));
    }
    if !(p as usize).is_multiple_of(core::mem::align_of::<T>()) {
        return fail(HGCA_PARAM, format!("{what} is not aligned for {}", T::NAME));
    }
    // SAFETY: every `SizeFirst` struct is `repr(C)` with a `u32` first;
    // the caller's struct holds at least that field.
    let size = unsafe { p.cast::<u32>().read() };
    check_size::<T>(size, T::NAME)?;
    // SAFETY: the caller's struct holds `size >= size_of::<T>()` bytes.
    Ok(unsafe { &*p })
}

/// A struct with a `size` field: checks it against this library's.
pub(crate) fn check_size<T>(size: u32, what: &str) -> R {
    if (size as usize) < core::mem::size_of::<T>() {
        return fail(
            HGCA_ABI,
            format!(
                "{what}.size = {size}, this library's struct has {} bytes (set size = sizeof({what}))",
                core::mem::size_of::<T>()
            ),
        );
    }
    Ok(())
}

/// Alignment and size of a slice of `len` `T` at `addr` (a slice may
/// not span more than `isize::MAX` bytes).
fn check_slice<T>(addr: usize, len: usize, what: &str) -> R {
    if !addr.is_multiple_of(core::mem::align_of::<T>()) {
        return fail(
            HGCA_PARAM,
            format!("{what} is not aligned for its element type"),
        );
    }
    if len
        .checked_mul(core::mem::size_of::<T>())
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return fail(
            HGCA_CAPACITY,
            format!("{what}: {len} elements exceed the address space"),
        );
    }
    Ok(())
}

/// `len` elements at `p` (null allowed when `len == 0`).
///
/// # Safety
/// A non-null `p` points to `len` valid elements for the call.
pub(crate) unsafe fn slice<'a, T>(p: *const T, len: usize, what: &str) -> R<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return fail(HGCA_NULL_POINTER, format!("{what} is null (length {len})"));
    }
    check_slice::<T>(p as usize, len, what)?;
    // SAFETY: non-null, aligned, `len` elements valid by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// As [`slice`], mutable.
///
/// # Safety
/// A non-null `p` points to `len` valid elements, not aliased for the call.
pub(crate) unsafe fn slice_mut<'a, T>(p: *mut T, len: usize, what: &str) -> R<&'a mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return fail(HGCA_NULL_POINTER, format!("{what} is null (length {len})"));
    }
    check_slice::<T>(p as usize, len, what)?;
    // SAFETY: non-null, aligned, `len` exclusive elements by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// The message of the calling thread's last failed call (`""` after a
/// successful one). Valid until the thread's next hgca call.
#[unsafe(no_mangle)]
pub extern "C" fn hgca_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}
