// Shared by every hgca wgpu kernel: the parameter block (one uniform buffer
// per submission, `Params` in backend.rs, 16 x 4 bytes) and the IEEE
// special-value tests.
//
// WGSL lets an implementation assume that no NaN or infinity occurs, so the
// kernels never rely on float comparisons to find them: they test the bits.

struct Params {
    rows: u32,        // query rows (token, head) of the partial
    q_heads: u32,
    group: u32,       // q_heads / kv_heads
    d: u32,           // head dim
    rw: u32,          // 32-bit words per K/V row in the window (d, or ceil(d / 2) for 16-bit storage)
    cap: u32,         // window capacity (ring slots)
    start: u32,       // ring slot of the oldest token
    len: u32,         // tokens held
    n_splits: u32,    // split-K factor
    split_len: u32,   // tokens per split
    vis0: i32,        // row token i sees clamp(vis0 + i, 0, len) oldest tokens
    want_scores: u32, // 1: the split kernel also writes raw scores [q_heads, len]
    scale: f32,
    n_parts: u32,     // parts merged by merge_rows
    nblk: u32,        // token blocks per head in attn_weights
    pad: u32,
}

const NEG_INF_BITS: u32 = 0xff800000u;
const NAN_BITS: u32 = 0x7fc00000u;

fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// Finite: neither infinite nor NaN.
fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}
