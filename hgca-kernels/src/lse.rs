//! LSE conventions at the boundary: base and layout, chosen by the caller.
//!
//! Inside hgca every LSE is the natural log, laid out `[tokens, heads]`.
//! Peers differ: FlashInfer writes base 2, `[tokens, heads]`; vLLM's
//! `merge_attn_states` and its attention outputs use the natural log,
//! `[heads, tokens]`. Mixing them is the field's most common real bug, so
//! every entry that reads or writes an LSE in a caller's buffer takes an
//! [`LseFormat`]; nothing is inferred.
//!
//! ```
//! use hgca_kernels::{LseBase, LseFormat, LseLayout};
//! // natural log, [tokens = 2, heads = 3]
//! let natural = [0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0];
//! let mut vllm = [0.0f32; 6];
//! LseFormat::VLLM.write(&natural, 2, 3, &mut vllm)?;
//! assert_eq!(vllm, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]); // [heads, tokens]
//! let mut fi = [0.0f32; 6];
//! LseFormat::FLASHINFER.write(&natural, 2, 3, &mut fi)?;
//! assert!((fi[1] - std::f32::consts::LOG2_E).abs() < 1e-7); // base 2
//! let mut back = [0.0f32; 6];
//! LseFormat::FLASHINFER.read(&fi, 2, 3, &mut back)?;
//! assert!(back.iter().zip(&natural).all(|(a, b)| (a - b).abs() < 1e-6));
//! # let _ = (LseBase::E, LseLayout::TokensHeads);
//! # Ok::<(), hgca_kernels::Error>(())
//! ```

use crate::{Result, check_len, lse_from_log2, lse_to_log2};

/// The base of a log-sum-exp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LseBase {
    /// Natural log (hgca, vLLM, FlashAttention).
    E,
    /// Base 2 (FlashInfer, MagicPIG).
    Two,
}

/// The order of an LSE buffer's two dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LseLayout {
    /// `[tokens, heads]` (hgca, FlashInfer).
    TokensHeads,
    /// `[heads, tokens]` (vLLM).
    HeadsTokens,
}

/// How a caller's LSE buffer is written: base and layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LseFormat {
    /// Base of the log.
    pub base: LseBase,
    /// Order of the dimensions.
    pub layout: LseLayout,
}

impl LseFormat {
    /// hgca's own: natural log, `[tokens, heads]`.
    pub const NATURAL: LseFormat = LseFormat {
        base: LseBase::E,
        layout: LseLayout::TokensHeads,
    };
    /// FlashInfer's: base 2, `[tokens, heads]`.
    pub const FLASHINFER: LseFormat = LseFormat {
        base: LseBase::Two,
        layout: LseLayout::TokensHeads,
    };
    /// vLLM's: natural log, `[heads, tokens]`.
    pub const VLLM: LseFormat = LseFormat {
        base: LseBase::E,
        layout: LseLayout::HeadsTokens,
    };

    /// The value of a natural-log `lse` in this base (`±inf` and NaN stay).
    #[inline]
    pub fn from_natural(self, lse: f32) -> f32 {
        match self.base {
            LseBase::E => lse,
            LseBase::Two => lse_to_log2(lse),
        }
    }

    /// The natural-log value of an `lse` given in this base.
    #[inline]
    pub fn to_natural(self, lse: f32) -> f32 {
        match self.base {
            LseBase::E => lse,
            LseBase::Two => lse_from_log2(lse),
        }
    }

    /// Index in a buffer of this format of `(token t, head h)`.
    #[inline]
    pub fn index(self, t: usize, h: usize, tokens: usize, heads: usize) -> usize {
        match self.layout {
            LseLayout::TokensHeads => t * heads + h,
            LseLayout::HeadsTokens => h * tokens + t,
        }
    }

    /// Writes hgca's `natural [tokens, heads]` into `dst` in this format.
    ///
    /// # Errors
    /// [`crate::Error::Length`] when a buffer does not hold `tokens * heads`.
    pub fn write(
        self,
        natural: &[f32],
        tokens: usize,
        heads: usize,
        dst: &mut [f32],
    ) -> Result<()> {
        let n = tokens.saturating_mul(heads);
        check_len("lse (natural)", n, natural.len())?;
        check_len("lse", n, dst.len())?;
        for t in 0..tokens {
            for h in 0..heads {
                dst[self.index(t, h, tokens, heads)] = self.from_natural(natural[t * heads + h]);
            }
        }
        Ok(())
    }

    /// Reads `src` in this format into hgca's `natural [tokens, heads]`.
    ///
    /// # Errors
    /// [`crate::Error::Length`] when a buffer does not hold `tokens * heads`.
    pub fn read(self, src: &[f32], tokens: usize, heads: usize, natural: &mut [f32]) -> Result<()> {
        let n = tokens.saturating_mul(heads);
        check_len("lse", n, src.len())?;
        check_len("lse (natural)", n, natural.len())?;
        for t in 0..tokens {
            for h in 0..heads {
                natural[t * heads + h] = self.to_natural(src[self.index(t, h, tokens, heads)]);
            }
        }
        Ok(())
    }
}

impl Default for LseFormat {
    /// [`LseFormat::NATURAL`].
    fn default() -> Self {
        LseFormat::NATURAL
    }
}

/// The N-way merge ([`crate::merge()`]) of partials whose LSE buffers are in
/// `fmt`: `parts[i] = (out_i, lse_i)` with `out_i [tokens, heads, d]` and
/// `lse_i` in `fmt`, the result written to `out` and `lse` (in `fmt` too).
/// `out` may not alias a part (Rust's borrows see to it); for an in-place
/// merge, pass the accumulator as a part and as the destination through
/// [`merge_states_into`].
///
/// ```
/// use hgca_kernels::{LseFormat, PartialLayout, merge_states};
/// let layout = PartialLayout { n_tokens: 1, q_heads: 1, head_dim: 2 };
/// // FlashInfer's base 2: lse2 = 1 means twice the mass of lse2 = 0
/// let a = ([1.0f32, 0.0], [1.0f32]);
/// let b = ([0.0f32, 1.0], [0.0f32]);
/// let (mut o, mut s) = ([0.0f32; 2], [0.0f32]);
/// merge_states(layout, LseFormat::FLASHINFER, &[(&a.0, &a.1), (&b.0, &b.1)], &mut o, &mut s)?;
/// assert!((o[0] - 2.0 / 3.0).abs() < 1e-6);
/// assert!((s[0] - 3f32.log2()).abs() < 1e-6);
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
///
/// # Errors
/// [`crate::Error::Length`] when a buffer does not fit `layout`.
pub fn merge_states(
    layout: crate::PartialLayout,
    fmt: LseFormat,
    parts: &[(&[f32], &[f32])],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let (t, h) = (layout.n_tokens, layout.q_heads);
    // Every length first: nothing is allocated for a layout the buffers do not hold.
    let (rows, out_len) = checked_sizes(layout)?;
    for (o, l) in parts {
        check_len("part out", out_len, o.len())?;
        check_len("part lse", rows, l.len())?;
    }
    check_len("out", out_len, out.len())?;
    check_len("lse", rows, lse.len())?;
    let mut natural = vec![0.0f32; rows * parts.len()];
    for ((_, l), nat) in parts.iter().zip(natural.chunks_mut(layout.rows().max(1))) {
        fmt.read(l, t, h, nat)?;
    }
    let refs = parts
        .iter()
        .enumerate()
        .map(|(i, (o, _))| {
            crate::PartialRef::new(
                layout,
                o,
                &natural[i * layout.rows()..(i + 1) * layout.rows()],
            )
        })
        .collect::<Result<Vec<_>>>()?;
    check_len("lse", layout.rows(), lse.len())?;
    let mut dst_lse = vec![0.0f32; layout.rows()];
    crate::merge(&refs, crate::PartialMut::new(layout, out, &mut dst_lse)?)?;
    fmt.write(&dst_lse, t, h, lse)
}

/// The in-place two-way merge ([`crate::merge_into`]) with LSE buffers in
/// `fmt`: `(out, lse) <- merge((out, lse), (src_out, src_lse))`.
///
/// # Errors
/// [`crate::Error::Length`] when a buffer does not fit `layout`.
pub fn merge_states_into(
    layout: crate::PartialLayout,
    fmt: LseFormat,
    out: &mut [f32],
    lse: &mut [f32],
    src_out: &[f32],
    src_lse: &[f32],
) -> Result<()> {
    let (t, h) = (layout.n_tokens, layout.q_heads);
    let (rows, out_len) = checked_sizes(layout)?;
    check_len("out", out_len, out.len())?;
    check_len("lse", rows, lse.len())?;
    check_len("src out", out_len, src_out.len())?;
    check_len("src lse", rows, src_lse.len())?;
    let mut a = vec![0.0f32; rows];
    let mut b = vec![0.0f32; rows];
    fmt.read(lse, t, h, &mut a)?;
    fmt.read(src_lse, t, h, &mut b)?;
    crate::merge_into(
        crate::PartialMut::new(layout, out, &mut a)?,
        crate::PartialRef::new(layout, src_out, &b)?,
    )?;
    fmt.write(&a, t, h, lse)
}

/// Rows and `out` elements of `layout`, or [`crate::Error::Capacity`] when they overflow.
fn checked_sizes(layout: crate::PartialLayout) -> Result<(usize, usize)> {
    let over = || crate::Error::Capacity {
        what: "partial elements",
        capacity: usize::MAX,
        requested: layout.n_tokens,
    };
    let rows = layout
        .n_tokens
        .checked_mul(layout.q_heads)
        .ok_or_else(over)?;
    let out = rows.checked_mul(layout.head_dim).ok_or_else(over)?;
    Ok((rows, out))
}
