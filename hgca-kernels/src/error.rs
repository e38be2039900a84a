//! The one error type of hgca, and [`Cause`], the driver error it keeps.

use std::sync::Arc;

/// Everything that can go wrong at hgca's public boundary.
///
/// Every variant says what was expected and what was found, so that a caller
/// can fix the call without reading hgca's source. Backends wrap their
/// driver's error in [`Error::Backend`] (or [`Error::Unavailable`]) and keep
/// it as the [`source`](std::error::Error::source): the message says what
/// hgca was doing, the source what the driver said. [`report`] prints both.
///
/// ```
/// use hgca_kernels::{Error, report};
/// let io = std::io::Error::new(std::io::ErrorKind::NotFound, "libcuda.so.1");
/// let e = Error::unavailable_from("cuda", "loading the driver", io);
/// assert_eq!(e.to_string(), "backend `cuda` is unavailable: loading the driver");
/// assert_eq!(report(&e), "backend `cuda` is unavailable: loading the driver: libcuda.so.1");
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A count that must be positive was zero.
    #[error("{what} must be at least 1, found 0")]
    Zero {
        /// Which count.
        what: &'static str,
    },
    /// The number of query heads is not a multiple of the number of KV heads.
    #[error("q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")]
    GroupMismatch {
        /// Query heads found.
        q_heads: usize,
        /// KV heads found.
        kv_heads: usize,
    },
    /// A buffer has the wrong number of elements.
    #[error("{what}: expected {expected} elements, found {found}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Elements expected from the shape.
        expected: usize,
        /// Elements found.
        found: usize,
    },
    /// Two shapes that must agree do not.
    #[error("{what}: expected {expected}, found {found}")]
    ShapeMismatch {
        /// Which shape.
        what: &'static str,
        /// The expected shape, printed.
        expected: String,
        /// The shape found, printed.
        found: String,
    },
    /// An index points past the end of what it indexes.
    #[error("{what}: index {index} out of range for length {len}")]
    Index {
        /// What was indexed.
        what: &'static str,
        /// The offending index.
        index: usize,
        /// The valid length.
        len: usize,
    },
    /// A real-valued parameter is outside its domain (NaN, negative, infinite...).
    #[error("{what} = {value} is invalid: {expected}")]
    Param {
        /// Which parameter.
        what: &'static str,
        /// The value found.
        value: f64,
        /// What was expected, in words.
        expected: &'static str,
    },
    /// A capacity (window, store, memory budget) would be exceeded.
    #[error("{what}: capacity {capacity}, requested {requested}")]
    Capacity {
        /// Which capacity.
        what: &'static str,
        /// The capacity.
        capacity: usize,
        /// What the operation needed.
        requested: usize,
    },
    /// The operating system refused memory (or the size overflows).
    #[error("{what}: could not get {bytes} bytes of memory: {reason}")]
    OutOfMemory {
        /// What needed the memory.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
        /// The OS's reason.
        reason: String,
    },
    /// The element type is not supported by this backend or device.
    #[error("dtype {dtype} is not supported by {backend}: {reason}")]
    UnsupportedDType {
        /// The dtype asked for.
        dtype: crate::DType,
        /// The backend that refused it.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// A backend feature was not compiled in (cargo feature off).
    #[error("backend `{backend}` is not compiled in: rebuild with cargo feature `{feature}`")]
    NotCompiledIn {
        /// The backend.
        backend: &'static str,
        /// The cargo feature that enables it.
        feature: &'static str,
    },
    /// The backend's hardware or driver is not present on this machine.
    #[error("backend `{backend}` is unavailable: {reason}")]
    Unavailable {
        /// The backend.
        backend: &'static str,
        /// Why, e.g. the library that could not be loaded.
        reason: String,
        /// The driver's or loader's own error, when there is one.
        source: Option<Cause>,
    },
    /// An error reported by a backend's driver or runtime.
    #[error("backend `{backend}` failed: {message}")]
    Backend {
        /// The backend.
        backend: &'static str,
        /// What failed, in hgca's words (the driver's own words are in `source`).
        message: String,
        /// The driver's or runtime's own error, when there is one.
        source: Option<Cause>,
    },
    /// An object (a window, a pending result) was given to a backend
    /// instance other than the one that made it: device memory and queues
    /// belong to one instance.
    #[error("{what} was made by another {backend} backend instance")]
    ForeignObject {
        /// The object.
        what: &'static str,
        /// The backend it was given to.
        backend: &'static str,
    },
}

impl Error {
    /// [`Error::Backend`] with no driver error behind it.
    pub fn backend(backend: &'static str, message: impl Into<String>) -> Self {
        Self::Backend {
            backend,
            message: message.into(),
            source: None,
        }
    }

    /// [`Error::Backend`] for a driver error `cause` met while doing `message`.
    pub fn backend_from(
        backend: &'static str,
        message: impl Into<String>,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Backend {
            backend,
            message: message.into(),
            source: Some(Cause::new(cause)),
        }
    }

    /// [`Error::Unavailable`] with no driver error behind it.
    pub fn unavailable(backend: &'static str, reason: impl Into<String>) -> Self {
        Self::Unavailable {
            backend,
            reason: reason.into(),
            source: None,
        }
    }

    /// [`Error::Unavailable`] for a driver or loader error `cause`.
    pub fn unavailable_from(
        backend: &'static str,
        reason: impl Into<String>,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Unavailable {
            backend,
            reason: reason.into(),
            source: Some(Cause::new(cause)),
        }
    }
}

/// A driver's or runtime's error kept as the source of an [`Error`].
///
/// Cloning shares it. Two causes are equal when they print the same (so
/// that [`Error`] stays `PartialEq`). [`Cause::get`] gives the original for
/// `downcast_ref`.
#[derive(Clone)]
pub struct Cause(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl Cause {
    /// Keeps `e`.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(e))
    }

    /// The driver's error itself.
    pub fn get(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl core::fmt::Debug for Cause {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        core::fmt::Debug::fmt(&*self.0, f)
    }
}

impl core::fmt::Display for Cause {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        core::fmt::Display::fmt(&*self.0, f)
    }
}

/// Transparent: its source is the driver error's own source.
impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for Cause {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

/// `e` and each of its sources, joined by `": "`: the one line to show a
/// user (the C ABI's last error, Python's exception text, a binary's exit).
pub fn report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(c) = next {
        s.push_str(": ");
        s.push_str(&c.to_string());
        next = c.source();
    }
    s
}

/// `Result` with hgca's [`Error`].
pub type Result<T, E = Error> = core::result::Result<T, E>;

/// Checks that `found == expected`, else returns [`Error::Length`].
///
/// # Errors
/// [`Error::Length`] when the lengths differ.
#[inline]
pub fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(Error::Length {
            what,
            expected,
            found,
        })
    }
}

/// As [`check_len`] for a length that is a product of counts (`[n, heads,
/// d]`): the product saturates instead of overflowing, so a count that
/// would overflow is the same typed [`Error::Length`] (no real slice holds
/// `usize::MAX` elements), never a panic or a wrapped length.
pub fn check_len_of(what: &'static str, factors: &[usize], found: usize) -> Result<()> {
    let expected = factors.iter().fold(1usize, |n, &f| n.saturating_mul(f));
    check_len(what, expected, found)
}

/// The error of every backend's `wait` given a weights buffer for a decode
/// submitted without `want_weights`: one variant and message whichever
/// backend (CPU, wgpu, CUDA) it is.
pub fn weights_not_requested() -> Error {
    Error::ShapeMismatch {
        what: "wait: weights",
        expected: "no buffer: the decode was submitted without want_weights".into(),
        found: "a weights buffer".into(),
    }
}
