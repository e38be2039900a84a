//! Attention shapes, validated once at the boundary.

use crate::{Error, Result};

/// The head geometry of one attention layer, validated once.
///
/// Grouped-query attention: query head `h` reads KV head `h / group()`.
///
/// ```
/// use hgca_kernels::AttnShape;
/// let s = AttnShape::new(32, 8, 128)?;
/// assert_eq!(s.group(), 4);
/// assert!((s.scale() - 1.0 / 128f32.sqrt()).abs() < 1e-7);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
}

impl AttnShape {
    /// A shape with the default scale `1/sqrt(head_dim)`.
    ///
    /// # Errors
    /// [`Error::Zero`] for a zero count, [`Error::GroupMismatch`] when
    /// `q_heads % kv_heads != 0`, [`Error::Capacity`] when one query's
    /// `q_heads * head_dim` elements would not fit in memory.
    pub fn new(q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        for (what, v) in [
            ("q_heads", q_heads),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ] {
            if v == 0 {
                return Err(Error::Zero { what });
            }
        }
        if !q_heads.is_multiple_of(kv_heads) {
            return Err(Error::GroupMismatch { q_heads, kv_heads });
        }
        // One query row must be addressable: every length derived from the
        // shape is then a product with a caller's count, checked where used.
        if q_heads
            .checked_mul(head_dim)
            .is_none_or(|n| n > isize::MAX as usize / 4)
        {
            return Err(Error::Capacity {
                what: "q_heads * head_dim (elements of one query)",
                capacity: isize::MAX as usize / 4,
                requested: q_heads.saturating_mul(head_dim),
            });
        }
        Ok(Self {
            q_heads,
            kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        })
    }

    /// The same shape with another score scale.
    ///
    /// # Errors
    /// [`Error::Param`] when `scale` is not finite.
    pub fn with_scale(mut self, scale: f32) -> Result<Self> {
        if !scale.is_finite() {
            return Err(Error::Param {
                what: "scale",
                value: scale as f64,
                expected: "a finite number",
            });
        }
        self.scale = scale;
        Ok(self)
    }

    /// Query heads.
    #[inline]
    pub fn q_heads(&self) -> usize {
        self.q_heads
    }
    /// KV heads.
    #[inline]
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    /// Head dimension `d`.
    #[inline]
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Score scale (`1/sqrt(d)` unless set).
    #[inline]
    pub fn scale(&self) -> f32 {
        self.scale
    }
    /// Query heads per KV head.
    #[inline]
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }
    /// Elements of one decode query block `[q_heads, d]`.
    #[inline]
    pub fn q_len(&self) -> usize {
        self.q_heads * self.head_dim
    }
    /// Elements of one token's K (or V) `[kv_heads, d]`.
    #[inline]
    pub fn kv_token_len(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}
