// Dense attention over the KV ring, split-K (flash-decoding).
//
// `attn_split`: one workgroup of WG invocations per (split, query row). The
// split's tokens are visited in blocks of WG: every invocation scores one
// token (a full dot product over d), the block max and sum are reduced in
// workgroup memory (no subgroup operations: the subgroup size is not
// assumed), and the output accumulators (invocation i owns dims i, i + WG,
// ...) are rescaled online. Each split writes a normalised partial
// (out, lse) that `merge_rows` combines. A non-finite score makes the
// split's partial NaN (out and lse), which the merge spreads to the row.
//
// `attn_weights`: weights[h, t] = exp(score[h, t] - lse[h]) after the merge.
//
// KV storage: `array<u32>`, row r of KV head g at word (g * cap + slot) * rw.
// DTYPE 0: f32 bits; 1: f16 pairs (element 2j in the low half of word j),
// decoded with unpack2x16float, so no SHADER_F16 is needed; 2: bf16 pairs,
// decoded by a shift (exact).

override DTYPE: u32 = 0u;
const WG: u32 = 64u;
const NACC: u32 = 4u; // WG * NACC = 256 = the largest head dim

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kbuf: array<u32>;
@group(0) @binding(3) var<storage, read> vbuf: array<u32>;
@group(0) @binding(4) var<storage, read_write> part_o: array<f32>;
@group(0) @binding(5) var<storage, read_write> part_lse: array<f32>;
@group(0) @binding(6) var<storage, read_write> scores: array<f32>;

var<workgroup> qs: array<f32, 256>;
var<workgroup> red: array<f32, WG>;
var<workgroup> pw: array<f32, WG>;

fn half_of(w: u32, i: u32) -> f32 {
    if (DTYPE == 1u) {
        let p = unpack2x16float(w);
        return select(p.x, p.y, (i & 1u) == 1u);
    }
    return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u));
}

fn load_k(row: u32, i: u32) -> f32 {
    if (DTYPE == 0u) {
        return bitcast<f32>(kbuf[row + i]);
    }
    return half_of(kbuf[row + (i >> 1u)], i);
}

fn load_v(row: u32, i: u32) -> f32 {
    if (DTYPE == 0u) {
        return bitcast<f32>(vbuf[row + i]);
    }
    return half_of(vbuf[row + (i >> 1u)], i);
}

fn row_word(g: u32, t: u32) -> u32 {
    let slot = (P.start + t) % P.cap;
    return (g * P.cap + slot) * P.rw;
}

@compute @workgroup_size(64)
fn attn_split(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let split = wid.x;
    let r = wid.y + wid.z * nwg.y;
    if (r >= P.rows) {
        return;
    }
    let d = P.d;
    let tq = r / P.q_heads;
    let h = r % P.q_heads;
    let g = h / P.group;
    let vis = u32(clamp(P.vis0 + i32(tq), 0, i32(P.len)));
    let t0 = split * P.split_len;
    let t1 = min(t0 + P.split_len, vis);

    for (var i = tid; i < d; i += WG) {
        qs[i] = q[r * d + i];
    }
    workgroupBarrier();

    var acc: array<f32, NACC>;
    for (var k = 0u; k < NACC; k++) {
        acc[k] = 0.0;
    }
    var m_run = 0.0;
    var l_run = 0.0;
    // A non-finite score (NaN or inf in q or K, or an overflow) makes the
    // row NaN instead of being dropped by `max`.
    var bad = false;
    for (var b = t0; b < t1; b += WG) {
        let t = b + tid;
        let valid = t < t1;
        var s = 0.0;
        if (valid) {
            let row = row_word(g, t);
            var dot = 0.0;
            for (var i = 0u; i < d; i++) {
                dot = fma(qs[i], load_k(row, i), dot);
            }
            s = dot * P.scale;
            if (P.want_scores != 0u) {
                scores[h * P.len + t] = s;
            }
            if (!is_finite(s)) {
                bad = true;
                s = 0.0;
            }
        }
        // Block max (invalid lanes repeat a valid lane's score: lane 0 is always valid).
        red[tid] = s;
        workgroupBarrier();
        if (!valid) {
            red[tid] = red[0];
        }
        workgroupBarrier();
        for (var off = WG / 2u; off > 0u; off >>= 1u) {
            if (tid < off) {
                red[tid] = max(red[tid], red[tid + off]);
            }
            workgroupBarrier();
        }
        let bm = red[0];
        workgroupBarrier();
        let first = b == t0;
        let m_new = select(max(m_run, bm), bm, first);
        var p = 0.0;
        if (valid) {
            p = exp(s - m_new);
        }
        pw[tid] = p;
        red[tid] = p;
        workgroupBarrier();
        for (var off = WG / 2u; off > 0u; off >>= 1u) {
            if (tid < off) {
                red[tid] = red[tid] + red[tid + off];
            }
            workgroupBarrier();
        }
        let corr = select(exp(m_run - m_new), 0.0, first);
        l_run = l_run * corr + red[0];
        let nb = min(WG, t1 - b);
        for (var k = 0u; k < NACC; k++) {
            acc[k] = acc[k] * corr;
        }
        for (var j = 0u; j < nb; j++) {
            let row = row_word(g, b + j);
            let pj = pw[j];
            for (var k = 0u; k < NACC; k++) {
                let i = tid + k * WG;
                if (i < d) {
                    acc[k] = fma(pj, load_v(row, i), acc[k]);
                }
            }
        }
        m_run = m_new;
        workgroupBarrier();
    }

    red[tid] = select(0.0, 1.0, bad);
    workgroupBarrier();
    for (var off = WG / 2u; off > 0u; off >>= 1u) {
        if (tid < off) {
            red[tid] = max(red[tid], red[tid + off]);
        }
        workgroupBarrier();
    }
    let any_bad = red[0] > 0.5;

    let base = split * P.rows + r;
    if (any_bad) {
        for (var i = tid; i < d; i += WG) {
            part_o[base * d + i] = bitcast<f32>(NAN_BITS);
        }
        if (tid == 0u) {
            part_lse[base] = bitcast<f32>(NAN_BITS);
        }
    } else if (t1 > t0) {
        let inv = 1.0 / l_run;
        for (var k = 0u; k < NACC; k++) {
            let i = tid + k * WG;
            if (i < d) {
                part_o[base * d + i] = acc[k] * inv;
            }
        }
        if (tid == 0u) {
            part_lse[base] = m_run + log(l_run);
        }
    } else {
        for (var i = tid; i < d; i += WG) {
            part_o[base * d + i] = 0.0;
        }
        if (tid == 0u) {
            part_lse[base] = bitcast<f32>(NEG_INF_BITS);
        }
    }
}
