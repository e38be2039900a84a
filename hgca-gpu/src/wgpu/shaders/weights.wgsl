// weights[h, t] = exp(score[h, t] - lse[h]): the softmax over the window's
// tokens, oldest first, from the raw scores of `attn_split` and the merged
// lse (stored after the rows * d outputs in `res`). One invocation per
// token; workgroups fold (head, token block) into y and z.

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> scores: array<f32>;
@group(0) @binding(2) var<storage, read> res: array<f32>;
@group(0) @binding(3) var<storage, read_write> weights: array<f32>;

@compute @workgroup_size(64)
fn attn_weights(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let blk = wid.y + wid.z * nwg.y;
    let h = blk / P.nblk;
    let t = (blk % P.nblk) * 64u + tid;
    if (h >= P.q_heads || t >= P.len) {
        return;
    }
    let lse = res[P.rows * P.d + h];
    let i = h * P.len + t;
    weights[i] = exp(scores[i] - lse);
}
