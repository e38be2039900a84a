
// The dense side of a hybrid FFN, second pass: out[t, r] = sum_i h[t, i]
// down_t[i, r] over every neuron i, one invocation per token and pair of
// output columns (one 32-bit word of f16 down rows), two accumulators; the
// neurons' rows are read in order, so consecutive invocations read
// consecutive words.
//
// Params used: rows = tokens, d = d_model, rw = words per row, len = neurons.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> down: array<u32>;
@group(0) @binding(2) var<storage, read> h: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn ffn_down(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let w = wid.x * 64u + lid;
    let t = wid.y + wid.z * nwg.y;
    if (w >= p.rw || t >= p.rows) {
        return;
    }
    var a0 = 0.0;
    var a1 = 0.0;
    let hb = t * p.len;
    for (var i = 0u; i < p.len; i++) {
        let hv = h[hb + i];
        let dv = unpack2x16float(down[i * p.rw + w]);
        a0 = fma(hv, dv.x, a0);
        a1 = fma(hv, dv.y, a1);
    }
    let k = 2u * w;
    out[t * p.d + k] = a0;
    if (k + 1u < p.d) {
        out[t * p.d + k + 1u] = a1;
    }
}
