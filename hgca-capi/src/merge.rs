//! Merging attention partials (the N-way merge and the in-place two-way one).

use hgca_kernels::PartialLayout;

use crate::ffi::{R, deref, guard, slice, slice_mut};
use crate::types::{hgca_state, hgca_status};
use crate::views::lse_format;

/// The N-way merge: `parts[i]` are partials of disjoint token sets (`out
/// [tokens, heads, head_dim]`, `lse` in the given base and layout); writes
/// the attention over their union to `out` / `lse` (same base and layout).
/// Thread-safe.
///
/// # Safety
/// Every pointer is null or valid for its stated length; outputs do not
/// alias inputs.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_merge(
    parts: *const hgca_state,
    n_parts: usize,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    lse_base: u32,
    lse_layout: u32,
    out: *mut f32,
    out_len: usize,
    lse: *mut f32,
    lse_len: usize,
) -> hgca_status {
    guard(|| {
        let fmt = lse_format(lse_base, lse_layout)?;
        let layout = PartialLayout {
            n_tokens: tokens,
            q_heads: heads,
            head_dim,
        };
        // SAFETY: the caller's contract.
        let ps = unsafe { slice(parts, n_parts, "parts") }?;
        let views = ps
            .iter()
            .map(|p| {
                // SAFETY: the caller's contract on each part.
                let o = unsafe { slice(p.out, p.out_len, "part out") }?;
                // SAFETY: as above.
                let l = unsafe { slice(p.lse, p.lse_len, "part lse") }?;
                Ok((o, l))
            })
            .collect::<R<Vec<_>>>()?;
        // SAFETY: the caller's contract.
        let o = unsafe { slice_mut(out, out_len, "out") }?;
        // SAFETY: as above.
        let l = unsafe { slice_mut(lse, lse_len, "lse") }?;
        Ok(hgca_kernels::merge_states(layout, fmt, &views, o, l)?)
    })
}

/// The in-place two-way merge: `(out, lse) <- merge((out, lse), (src_out,
/// src_lse))`, LSE in the given base and layout. Thread-safe.
///
/// # Safety
/// As [`hgca_merge`].
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hgca_merge_into(
    out: *mut f32,
    out_len: usize,
    lse: *mut f32,
    lse_len: usize,
    src: *const hgca_state,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    lse_base: u32,
    lse_layout: u32,
) -> hgca_status {
    guard(|| {
        let fmt = lse_format(lse_base, lse_layout)?;
        let layout = PartialLayout {
            n_tokens: tokens,
            q_heads: heads,
            head_dim,
        };
        // SAFETY: the caller's contract.
        let s = unsafe { deref(src, "src") }?;
        // SAFETY: as above.
        let so = unsafe { slice(s.out, s.out_len, "src out") }?;
        // SAFETY: as above.
        let sl = unsafe { slice(s.lse, s.lse_len, "src lse") }?;
        // SAFETY: as above.
        let o = unsafe { slice_mut(out, out_len, "out") }?;
        // SAFETY: as above.
        let l = unsafe { slice_mut(lse, lse_len, "lse") }?;
        Ok(hgca_kernels::merge_states_into(layout, fmt, o, l, so, sl)?)
    })
}
