
// The dense side of a hybrid FFN, first pass: h[t, i] = act(gate_i . x_t)
// * (up_i . x_t) for every neuron i of the resident f16 weights and every
// token t, one workgroup per (token, neuron) pair (flat index folded into
// the grid's y and z), a strided dot product per invocation and a tree
// reduction in workgroup memory.
//
// Params used: rows = tokens, d = d_model, rw = 32-bit words per weight row
// (ceil(d / 2): f16 pairs, an odd row's last half zero), len = neurons,
// want_scores = the activation (0 SiLU, 1 ReLU).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate: array<u32>;
@group(0) @binding(2) var<storage, read> up: array<u32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> h: array<f32>;

var<workgroup> red_g: array<f32, 64>;
var<workgroup> red_u: array<f32, 64>;

fn activate(g: f32) -> f32 {
    if (p.want_scores == 1u) {
        return max(g, 0.0);
    }
    // SiLU; below -80 it is 0 to f32's precision (and exp would overflow).
    if (g < -80.0) {
        return 0.0;
    }
    return g / (1.0 + exp(-g));
}

@compute @workgroup_size(64)
fn ffn_gate_up(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let flat = wid.y + wid.z * nwg.y;
    if (flat >= p.rows * p.len) {
        return;
    }
    let t = flat / p.len;
    let i = flat % p.len;
    let xb = t * p.d;
    let wb = i * p.rw;
    var g = 0.0;
    var u = 0.0;
    for (var w = lid; w < p.rw; w += 64u) {
        let gv = unpack2x16float(gate[wb + w]);
        let uv = unpack2x16float(up[wb + w]);
        let k = 2u * w;
        let x0 = x[xb + k];
        var x1 = 0.0;
        if (k + 1u < p.d) {
            x1 = x[xb + k + 1u];
        }
        g = fma(gv.y, x1, fma(gv.x, x0, g));
        u = fma(uv.y, x1, fma(uv.x, x0, u));
    }
    red_g[lid] = g;
    red_u[lid] = u;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red_g[lid] += red_g[lid + s];
            red_u[lid] += red_u[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        h[t * p.len + i] = activate(red_g[0]) * red_u[0];
    }
}
