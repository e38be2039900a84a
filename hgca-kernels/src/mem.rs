//! Host memory for KV caches: zeroed, and backed by transparent huge pages
//! where the operating system offers them.
//!
//! A sparse decode reads rows scattered over GiBs. With 4 KiB pages almost
//! every row is a TLB miss and a page walk, and on the machines we measured
//! that costs more than a third of the random-row bandwidth (see the
//! README's figures). [`HostBuf`] maps its memory anonymously, aligns it to
//! 2 MiB and asks the kernel for huge pages (`madvise(MADV_HUGEPAGE)`);
//! where the kernel refuses or the OS has no such thing, it is ordinary
//! zeroed memory and nothing else changes.

use core::fmt;
use core::marker::PhantomData;
use core::ops::{Deref, DerefMut};

use crate::{Error, KvElem, Result};

/// Size and alignment of a transparent huge page on x86-64 and aarch64 Linux
/// (4 KiB base pages).
pub const HUGE_PAGE: usize = 1 << 21;

/// An owned, zero-initialised `[T]` in its own anonymous mapping; buffers
/// of at least [`HUGE_PAGE`] bytes start on a 2 MiB boundary and ask for
/// transparent huge pages.
///
/// ```
/// use hgca_kernels::{HostBuf, f16};
/// let mut b = HostBuf::<f16>::zeroed(3 << 20)?; // 6 MiB
/// assert!(b.iter().all(|x| *x == f16::ZERO));
/// b[7] = f16::ONE;
/// assert_eq!(b[7], f16::ONE);
/// assert_eq!(b.len(), 3 << 20);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
pub struct HostBuf<T> {
    /// `None` for an empty buffer (no mapping).
    map: Option<memmap2::MmapMut>,
    /// Byte offset of element 0 inside the mapping.
    off: usize,
    len: usize,
    huge: bool,
    _elem: PhantomData<T>,
}

impl<T: KvElem> HostBuf<T> {
    /// `len` zeroed elements.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the size overflows or the OS refuses the
    /// mapping.
    pub fn zeroed(len: usize) -> Result<Self> {
        let size = core::mem::size_of::<T>();
        let oom = |reason: String| Error::OutOfMemory {
            what: "host buffer",
            bytes: len.saturating_mul(size),
            reason,
        };
        if len == 0 {
            return Ok(Self {
                map: None,
                off: 0,
                len,
                huge: false,
                _elem: PhantomData,
            });
        }
        let bytes = len
            .checked_mul(size)
            .ok_or_else(|| oom("size overflows usize".into()))?;
        let want_huge = bytes >= HUGE_PAGE;
        // A huge page backs only an aligned 2 MiB range: map one spare huge
        // page and start at the first boundary (the spare is never touched,
        // so it costs address space only).
        let slack = if want_huge { HUGE_PAGE } else { 0 };
        let total = bytes
            .checked_add(slack)
            .ok_or_else(|| oom("size overflows usize".into()))?;
        let map = memmap2::MmapMut::map_anon(total).map_err(|e| oom(e.to_string()))?;
        let addr = map.as_ptr() as usize;
        let off = if want_huge {
            addr.next_multiple_of(HUGE_PAGE) - addr
        } else {
            0
        };
        let huge = want_huge && advise_huge(&map, off, bytes);
        Ok(Self {
            map: Some(map),
            off,
            len,
            huge,
            _elem: PhantomData,
        })
    }

    /// A copy of `src` in a new buffer.
    ///
    /// # Errors
    /// As [`HostBuf::zeroed`].
    pub fn from_slice(src: &[T]) -> Result<Self> {
        let mut b = Self::zeroed(src.len())?;
        b.copy_from_slice(src);
        Ok(b)
    }

    /// Whether the kernel accepted the request for transparent huge pages
    /// (it may still back some pages with small ones, e.g. when memory is
    /// fragmented; `AnonHugePages` in `/proc/self/smaps` tells).
    pub fn huge_pages_requested(&self) -> bool {
        self.huge
    }

    fn byte_range(&self) -> core::ops::Range<usize> {
        self.off..self.off + self.len * core::mem::size_of::<T>()
    }
}

#[cfg(target_os = "linux")]
fn advise_huge(map: &memmap2::MmapMut, off: usize, bytes: usize) -> bool {
    map.advise_range(memmap2::Advice::HugePage, off, bytes)
        .is_ok()
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_map: &memmap2::MmapMut, _off: usize, _bytes: usize) -> bool {
    false
}

impl<T: KvElem> Deref for HostBuf<T> {
    type Target = [T];
    #[inline(always)]
    fn deref(&self) -> &[T] {
        match &self.map {
            Some(m) => bytemuck::cast_slice(&m[self.byte_range()]),
            None => &[],
        }
    }
}

impl<T: KvElem> DerefMut for HostBuf<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [T] {
        let r = self.byte_range();
        match &mut self.map {
            Some(m) => bytemuck::cast_slice_mut(&mut m[r]),
            None => &mut [],
        }
    }
}

impl<T: KvElem> Clone for HostBuf<T> {
    /// # Panics
    /// When the OS refuses the new mapping, as `Vec`'s clone aborts when the
    /// allocator fails; use [`HostBuf::from_slice`] to get an error instead.
    fn clone(&self) -> Self {
        Self::from_slice(self).expect("HostBuf::clone: the OS refused the mapping")
    }
}

impl<T> fmt::Debug for HostBuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuf")
            .field("len", &self.len)
            .field("elem", &core::any::type_name::<T>())
            .field("huge_pages_requested", &self.huge)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_alignment_and_contents() {
        for len in [
            0usize,
            1,
            3,
            4095,
            (HUGE_PAGE / 4) - 1,
            HUGE_PAGE / 4,
            (5 << 20) / 4 + 3,
        ] {
            let mut b = HostBuf::<f32>::zeroed(len).unwrap();
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0.0));
            for (i, x) in b.iter_mut().enumerate() {
                *x = i as f32;
            }
            let c = b.clone();
            assert_eq!(&c[..], &b[..]);
            assert!(c.iter().enumerate().all(|(i, &x)| x == i as f32));
            if len * 4 >= HUGE_PAGE {
                assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "len {len}");
            }
            if len * 4 < HUGE_PAGE {
                assert!(!b.huge_pages_requested());
            }
        }
    }

    #[test]
    fn overflow_is_an_error() {
        let e = HostBuf::<f32>::zeroed(usize::MAX / 2).unwrap_err();
        assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    }
}
