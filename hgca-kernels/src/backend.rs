//! Backend traits, one per capability.
//!
//! - [`WindowBackend`]: owns the dense side's KV window (a ring of recent
//!   tokens in device memory), appends tokens and evicts the oldest ones.
//! - [`DenseAttention`]: dense attention over a window, split into
//!   `submit_*` (returns at once) and [`DenseAttention::wait`], so the CPU's
//!   sparse attention runs while the GPU works.
//! - [`SparseAttention`]: gather-attention over selected entries of the CPU
//!   store.
//! - [`MergeBackend`]: the LSE merge.
//!
//! The hybrid orchestrator is generic over a `DenseAttention` and a
//! `SparseAttention`, so the whole pipeline also runs with the CPU in both
//! roles.
//!
//! `&B` and `Arc<B>` implement every one of these traits that `B` does, so
//! one backend (a GPU context need not be `Clone`) serves many layers.

use crate::{AttnShape, DType, Error, KvElem, KvSource, PartialMut, PartialRef, Result, Selection};

/// What a KV window holds: `capacity` tokens of `shape`'s KV heads, stored as `dtype`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowSpec {
    /// Head geometry.
    pub shape: AttnShape,
    /// Tokens the ring holds at most.
    pub capacity: usize,
    /// Storage type of K and V.
    pub dtype: DType,
}

impl WindowSpec {
    /// Validates the spec.
    ///
    /// # Errors
    /// [`Error::Zero`] for a zero capacity.
    pub fn new(shape: AttnShape, capacity: usize, dtype: DType) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::Zero {
                what: "window capacity",
            });
        }
        Ok(Self {
            shape,
            capacity,
            dtype,
        })
    }
    /// Bytes of K and V at full capacity.
    pub fn bytes(&self) -> usize {
        2 * self.capacity * self.shape.kv_token_len() * self.dtype.size()
    }

    /// The boundary check of [`WindowBackend::append`], shared by every
    /// backend: `k` and `v` hold `n` tokens and the window has `free` slots.
    ///
    /// # Errors
    /// [`Error::Length`], [`Error::Capacity`].
    pub fn check_append(&self, free: usize, n: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let count = n
            .checked_mul(self.shape.kv_token_len())
            .ok_or(Error::Capacity {
                what: "append elements",
                capacity: usize::MAX,
                requested: n,
            })?;
        crate::check_len("k", count, k.len())?;
        crate::check_len("v", count, v.len())?;
        if n > free {
            return Err(Error::Capacity {
                what: "window free slots (evict first)",
                capacity: free,
                requested: n,
            });
        }
        Ok(())
    }

    /// The boundary check of [`WindowBackend::evict_oldest`], shared by every
    /// backend: `T` is the window's dtype, `n <= len`, outputs hold `n` tokens.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`], [`Error::Capacity`], [`Error::Length`].
    pub fn check_evict<T: KvElem>(
        &self,
        backend: &'static str,
        len: usize,
        n: usize,
        k_out: &[T],
        v_out: &[T],
    ) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::UnsupportedDType {
                dtype: T::DTYPE,
                backend,
                reason: format!("the window stores {}", self.dtype),
            });
        }
        if n > len {
            return Err(Error::Capacity {
                what: "window tokens to evict",
                capacity: len,
                requested: n,
            });
        }
        let count = n * self.shape.kv_token_len();
        crate::check_len("k_out", count, k_out.len())?;
        crate::check_len("v_out", count, v_out.len())
    }
}

/// A dense-side KV window: a ring of the `len()` most recent tokens, the
/// oldest at absolute position `start_pos()`.
pub trait KvWindow {
    /// The window's spec.
    fn spec(&self) -> &WindowSpec;
    /// Tokens held now (`<= capacity`).
    fn len(&self) -> usize;
    /// True when no token is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Absolute sequence position of the oldest token held.
    fn start_pos(&self) -> u64;
    /// Free slots.
    fn free(&self) -> usize {
        self.spec().capacity - self.len()
    }
}

/// Owns KV windows on the dense side.
pub trait WindowBackend {
    /// The backend-owned window state (device buffers).
    type Window: KvWindow + Send;

    /// Creates an empty window.
    ///
    /// # Errors
    /// Backend errors (allocation), [`Error::UnsupportedDType`].
    fn new_window(&self, spec: WindowSpec) -> Result<Self::Window>;

    /// Appends `n` tokens, token-major `[n, kv_heads, d]` f32 (converted to
    /// the window's dtype), at the ring's write position.
    ///
    /// # Errors
    /// [`Error::Length`] for wrong lengths, [`Error::Capacity`] when the
    /// window has fewer than `n` free slots: evict first, nothing is overwritten;
    /// [`Error::ForeignObject`] for a window of another instance whose
    /// windows live in its own device memory.
    fn append(&self, window: &mut Self::Window, n: usize, k: &[f32], v: &[f32]) -> Result<()>;

    /// Removes the `n` oldest tokens, writing them head-major `[kv_heads, n, d]`
    /// in the window's own dtype `T` (no rounding on the way to the CPU store).
    ///
    /// # Errors
    /// [`Error::Capacity`] when fewer than `n` tokens are held,
    /// [`Error::UnsupportedDType`] when `T` is not the window's dtype,
    /// [`Error::Length`] for wrong output lengths, [`Error::ForeignObject`]
    /// as for [`WindowBackend::append`].
    fn evict_oldest<T: KvElem>(
        &self,
        window: &mut Self::Window,
        n: usize,
        k_out: &mut [T],
        v_out: &mut [T],
    ) -> Result<()>;

    /// Starts reading back the `n` oldest tokens, so that the next
    /// [`WindowBackend::evict_oldest`] of the same `n` tokens finds them
    /// already copied out: on a GPU the copy then runs beside other work
    /// (the CPU side of a decode step) instead of stalling the eviction.
    /// Changes nothing the window holds, and reads nothing back yet; appends
    /// in between are fine, another eviction first discards it. The
    /// default does nothing (an eviction is a host copy anyway).
    ///
    /// # Errors
    /// [`Error::Capacity`] when the window holds fewer than `n` tokens;
    /// [`Error::ForeignObject`] as for [`WindowBackend::append`] (where a
    /// backend overrides this); backend errors.
    fn prefetch_oldest(&self, window: &mut Self::Window, n: usize) -> Result<()> {
        check_prefetch(window.len(), n)
    }
}

/// The check of every [`WindowBackend::prefetch_oldest`]: a window holding
/// `held` tokens can prefetch `n` of them.
///
/// # Errors
/// [`Error::Capacity`] when `n > held`.
pub fn check_prefetch(held: usize, n: usize) -> Result<()> {
    if n > held {
        return Err(Error::Capacity {
            what: "window tokens to prefetch",
            capacity: held,
            requested: n,
        });
    }
    Ok(())
}

/// Dense attention over a window, with a submit/wait split.
pub trait DenseAttention: WindowBackend {
    /// Work submitted and not yet waited for.
    type Pending: Send;

    /// Short name for logs ("cpu-avx512", "wgpu llvmpipe", "cuda H200").
    fn name(&self) -> String;

    /// Submits decode attention of `q [q_heads, d]` over every token of the
    /// window. With `want_weights`, [`DenseAttention::wait`] can also return
    /// the softmax weights of the window tokens.
    ///
    /// # Errors
    /// [`Error::Length`] for a wrong `q`, [`Error::ForeignObject`] for a
    /// window of another instance (device memory), backend errors.
    fn submit_decode(
        &self,
        window: &Self::Window,
        q: &[f32],
        want_weights: bool,
    ) -> Result<Self::Pending>;

    /// Submits causal append attention of `n_q` queries `[n_q, q_heads, d]`
    /// at absolute positions `p0 .. p0 + n_q`: query `i` sees the window
    /// tokens at positions `<= p0 + i`.
    ///
    /// # Errors
    /// [`Error::Length`] for a wrong `q`, [`Error::ForeignObject`] for a
    /// window of another instance (device memory), backend errors.
    fn submit_append(
        &self,
        window: &Self::Window,
        q: &[f32],
        n_q: usize,
        p0: u64,
    ) -> Result<Self::Pending>;

    /// Waits for submitted work and writes its partial into `out`. For a
    /// decode submitted with `want_weights`, `weights` (if given) receives
    /// `[q_heads, len]`: the softmax over the window's tokens, oldest first.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] / [`Error::Length`] when `out` or `weights`
    /// does not fit what was submitted, [`Error::ForeignObject`] for work
    /// another instance submitted, backend errors.
    fn wait(
        &self,
        pending: Self::Pending,
        out: PartialMut<'_>,
        weights: Option<&mut [f32]>,
    ) -> Result<()>;

    /// [`DenseAttention::wait`] for a decode submitted with `want_weights`,
    /// the weights handed over in a vector already sized `[q_heads, len]`.
    /// The default copies into it; a backend that computed the weights in
    /// host memory swaps its buffer with `weights` instead (the CPU
    /// backend: a 128k-context window's weights are 4 MiB a step).
    ///
    /// # Errors
    /// As [`DenseAttention::wait`].
    fn wait_weights(
        &self,
        pending: Self::Pending,
        out: PartialMut<'_>,
        weights: &mut Vec<f32>,
    ) -> Result<()> {
        self.wait(pending, out, Some(weights))
    }
}

/// Sparse gather-attention over selected entries of a CPU KV store.
pub trait SparseAttention {
    /// Attention of `q [q_heads, d]` over, for each KV head `g`, the tokens
    /// `sel.head(g)` of `kv`; query head `h` uses the list of KV head
    /// `h / group`. With `weights`, also writes the softmax weights of the
    /// attended entries (normalised over this partial): for KV head `g`, the
    /// block `[group, sel.head(g).len()]` at offset `group * sel.offset(g)`,
    /// so `weights.len() == group * sel.total()`.
    ///
    /// # Errors
    /// [`Error::Length`], [`Error::ShapeMismatch`], [`Error::Index`] for
    /// inputs that do not fit `shape` and `kv`.
    fn sparse_decode<T: KvElem, S: KvSource<T>>(
        &self,
        shape: &AttnShape,
        q: &[f32],
        kv: &S,
        sel: &Selection,
        out: PartialMut<'_>,
        weights: Option<&mut [f32]>,
    ) -> Result<()>;
}

/// The LSE merge of partials.
pub trait MergeBackend {
    /// N-way merge into `dst`; see [`crate::merge()`].
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when layouts differ.
    fn merge(&self, parts: &[PartialRef<'_>], dst: PartialMut<'_>) -> Result<()>;
    /// In-place two-way merge; see [`crate::merge_into`].
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when layouts differ.
    fn merge_into(&self, acc: PartialMut<'_>, src: PartialRef<'_>) -> Result<()>;
}

/// Forwards every backend trait through a shared reference and an `Arc`, so
/// that one backend (a GPU context, which need not be `Clone`) can serve many
/// layers: each [`WindowBackend`] user owns its `D`, and `&B` or `Arc<B>` is
/// such a `D`.
macro_rules! forward_backend {
    ($($ptr:ty),*) => {$(
        impl<B: WindowBackend + ?Sized> WindowBackend for $ptr {
            type Window = B::Window;
            fn new_window(&self, spec: WindowSpec) -> Result<Self::Window> {
                (**self).new_window(spec)
            }
            fn append(&self, window: &mut Self::Window, n: usize, k: &[f32], v: &[f32]) -> Result<()> {
                (**self).append(window, n, k, v)
            }
            fn evict_oldest<T: KvElem>(
                &self,
                window: &mut Self::Window,
                n: usize,
                k_out: &mut [T],
                v_out: &mut [T],
            ) -> Result<()> {
                (**self).evict_oldest(window, n, k_out, v_out)
            }
            fn prefetch_oldest(&self, window: &mut Self::Window, n: usize) -> Result<()> {
                (**self).prefetch_oldest(window, n)
            }
        }

        impl<B: DenseAttention + ?Sized> DenseAttention for $ptr {
            type Pending = B::Pending;
            fn name(&self) -> String {
                (**self).name()
            }
            fn submit_decode(&self, window: &Self::Window, q: &[f32], want_weights: bool) -> Result<Self::Pending> {
                (**self).submit_decode(window, q, want_weights)
            }
            fn submit_append(&self, window: &Self::Window, q: &[f32], n_q: usize, p0: u64) -> Result<Self::Pending> {
                (**self).submit_append(window, q, n_q, p0)
            }
            fn wait(&self, pending: Self::Pending, out: PartialMut<'_>, weights: Option<&mut [f32]>) -> Result<()> {
                (**self).wait(pending, out, weights)
            }
            fn wait_weights(&self, pending: Self::Pending, out: PartialMut<'_>, weights: &mut Vec<f32>) -> Result<()> {
                (**self).wait_weights(pending, out, weights)
            }
        }

        impl<B: SparseAttention + ?Sized> SparseAttention for $ptr {
            fn sparse_decode<T: KvElem, S: KvSource<T>>(
                &self,
                shape: &AttnShape,
                q: &[f32],
                kv: &S,
                sel: &Selection,
                out: PartialMut<'_>,
                weights: Option<&mut [f32]>,
            ) -> Result<()> {
                (**self).sparse_decode(shape, q, kv, sel, out, weights)
            }
        }

        impl<B: MergeBackend + ?Sized> MergeBackend for $ptr {
            fn merge(&self, parts: &[PartialRef<'_>], dst: PartialMut<'_>) -> Result<()> {
                (**self).merge(parts, dst)
            }
            fn merge_into(&self, acc: PartialMut<'_>, src: PartialRef<'_>) -> Result<()> {
                (**self).merge_into(acc, src)
            }
        }
    )*};
}

forward_backend!(&B, std::sync::Arc<B>);
