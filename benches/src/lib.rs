//! Shared helpers of hgca's criterion benches.
#![deny(missing_docs)]

/// Deterministic pseudo-random f32 in `[-1, 1)` (no dependency, no hidden zeros).
pub fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}
