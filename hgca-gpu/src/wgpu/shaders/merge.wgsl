// The LSE merge of `n_parts` partials, one workgroup per row: parts' outputs
// `po [n_parts, rows, d]`, their lse `pl [n_parts, rows]`; result `res`:
// outputs `[rows, d]` then lse `[rows]`. Used for the split-K combine of
// dense attention and for `MergeBackend`.
//
// The contract of `hgca_kernels::merge`, decided on bits (not on float
// comparisons, which WGSL may optimise under a no-NaN assumption):
// - lse -inf or +inf: empty part (FlashAttention-2 writes +inf for empty rows);
// - all parts empty: out 0, lse -inf;
// - a NaN lse makes the whole row NaN; a NaN element of any part's out makes
//   that output element NaN, even at weight zero.

const MWG: u32 = 64u;

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> po: array<f32>;
@group(0) @binding(2) var<storage, read> pl: array<f32>;
@group(0) @binding(3) var<storage, read_write> res: array<f32>;

@compute @workgroup_size(64)
fn merge_rows(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let r = wid.y + wid.z * nwg.y;
    if (r >= P.rows) {
        return;
    }
    let rows = P.rows;
    let d = P.d;
    var nan_row = false;
    var any = false;
    var m = 0.0;
    for (var p = 0u; p < P.n_parts; p++) {
        let l = pl[p * rows + r];
        if (is_nan(l)) {
            nan_row = true;
        } else if (is_finite(l)) {
            if (!any || l > m) {
                m = l;
            }
            any = true;
        }
    }
    var total = 0.0;
    if (any) {
        for (var p = 0u; p < P.n_parts; p++) {
            let l = pl[p * rows + r];
            if (is_finite(l)) {
                total += exp(l - m);
            }
        }
    }
    let inv = 1.0 / select(1.0, total, any);
    for (var i = tid; i < d; i += MWG) {
        var o = 0.0;
        var bad = nan_row;
        for (var p = 0u; p < P.n_parts; p++) {
            let x = po[(p * rows + r) * d + i];
            if (is_nan(x)) {
                bad = true;
            }
            let l = pl[p * rows + r];
            if (any && is_finite(l)) {
                let c = exp(l - m) * inv;
                if (c != 0.0) {
                    o = fma(c, x, o);
                }
            }
        }
        res[r * d + i] = select(o, bitcast<f32>(NAN_BITS), bad);
    }
    if (tid == 0u) {
        var lse = bitcast<f32>(NEG_INF_BITS);
        if (nan_row) {
            lse = bitcast<f32>(NAN_BITS);
        } else if (any) {
            lse = m + log(total);
        }
        res[rows * d + r] = lse;
    }
}
