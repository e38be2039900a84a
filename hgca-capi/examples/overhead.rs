//! The C ABI's overhead over the Rust call: the same batched sparse decode
//! (one sequence of 32k tokens, 10% of them selected per KV head, q 32 /
//! kv 8 / d 128, f16, vLLM CPU layout with shuffled 16-token pages) through
//! `CpuBackend::decode_batch` and through `hgca_decode_batch`, alternating
//! call by call in one run; prints the median of each and their ratio.
//!
//! `cargo run --release -p hgca-capi --example overhead [threads] [calls]`

use std::time::Instant;

use ::hgca_cpu::{BatchTokens, CpuBackend};
use half::f16;
use hgca::*;
use hgca_kernels::{AttnShape, BlockTable, LseFormat, PagedBatch, PagedPool, Selection};

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    let calls: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(200);
    let (qh, hk, d, bs, n) = (32usize, 8usize, 128usize, 16usize, 32usize << 10);
    let nb = n / bs;
    // Pseudo-random values and a shuffled page order.
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let cache: Vec<f16> = (0..2 * nb * hk * bs * d)
        .map(|_| f16::from_f32((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5))
        .collect();
    let mut table: Vec<u32> = (0..nb as u32).collect();
    for i in (1..nb).rev() {
        table.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    let lens = [n as u32];
    let q: Vec<f32> = (0..qh * d)
        .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
        .collect();
    let mut sel = Selection::new();
    for _ in 0..hk {
        sel.push_head((0..n as u32).filter(|_| next() % 10 == 0));
    }
    let shape = AttnShape::new(qh, hk, d).unwrap();
    let (mut out, mut lse) = (vec![0.0f32; qh * d], vec![0.0f32; qh]);

    // The C side's descriptions of the same call.
    let c_shape = hgca_shape {
        size: core::mem::size_of::<hgca_shape>() as u32,
        q_heads: qh as u32,
        kv_heads: hk as u32,
        head_dim: d as u32,
        scale: 0.0,
    };
    let c_cache = hgca_paged_cache {
        size: core::mem::size_of::<hgca_paged_cache>() as u32,
        dtype: HGCA_DTYPE_F16,
        layout: HGCA_KV_VLLM_CPU,
        k: cache.as_ptr().cast(),
        k_len: cache.len(),
        v: core::ptr::null(),
        v_len: 0,
        num_blocks: nb,
        block_size: bs,
        kv_heads: hk,
        head_dim: d,
        block_stride: 0,
        token_stride: 0,
        head_stride: 0,
        k_offset: 0,
        v_offset: 0,
    };
    let c_table = hgca_block_table {
        size: core::mem::size_of::<hgca_block_table>() as u32,
        kind: HGCA_TABLE_DENSE,
        batch: 1,
        table: table.as_ptr(),
        max_blocks: nb,
        seq_lens: lens.as_ptr(),
        indptr: core::ptr::null(),
        indices: core::ptr::null(),
        indices_len: 0,
        last_page_len: core::ptr::null(),
    };
    let flat: Vec<u32> = (0..hk).flat_map(|g| sel.head(g).iter().copied()).collect();
    let offsets: Vec<usize> = (0..=hk).map(|g| sel.offset(g)).collect();
    let c_sel = hgca_selection {
        indices: flat.as_ptr(),
        indices_len: flat.len(),
        offsets: offsets.as_ptr(),
        offsets_len: offsets.len(),
    };
    let mut c_cpu: *mut hgca_cpu = core::ptr::null_mut();
    // SAFETY: a valid out pointer.
    let made = unsafe { hgca_cpu_new(threads, &mut c_cpu) };
    assert_eq!(made, hgca_status::HGCA_OK);
    // One backend (and thread pool) for both paths: the C handle's.
    // SAFETY: made by hgca_cpu_new just above.
    let cpu: &CpuBackend = unsafe { &*c_cpu }.backend();
    let (mut c_out, mut c_lse) = (vec![0.0f32; qh * d], vec![0.0f32; qh]);
    let outputs = hgca_outputs {
        size: core::mem::size_of::<hgca_outputs>() as u32,
        out: c_out.as_mut_ptr(),
        out_len: c_out.len(),
        lse: c_lse.as_mut_ptr(),
        lse_len: c_lse.len(),
        lse_base: HGCA_LSE_BASE_E,
        lse_layout: HGCA_LSE_TOKENS_HEADS,
        weights: core::ptr::null_mut(),
        weights_len: 0,
    };

    let sels = [sel];
    let mut rust = || {
        // A Rust engine builds its views each step too (tables change), as
        // the C call does inside: both timings include it.
        let t = Instant::now();
        let pool = PagedPool::vllm_cpu(&cache, nb, hk, bs, d).unwrap();
        let batch = PagedBatch::new(pool, BlockTable::dense(&table, nb, &lens).unwrap()).unwrap();
        cpu.decode_batch(
            &shape,
            &q,
            &batch,
            BatchTokens::Sparse(&sels),
            &mut out,
            &mut lse,
            LseFormat::NATURAL,
            None,
        )
        .unwrap();
        t.elapsed()
    };
    let c = || {
        let t = Instant::now();
        // SAFETY: every pointer is valid for its length for the call.
        let s = unsafe {
            hgca_decode_batch(
                c_cpu,
                &c_shape,
                q.as_ptr(),
                q.len(),
                &c_cache,
                &c_table,
                &c_sel,
                1,
                &outputs,
            )
        };
        assert_eq!(s, hgca_status::HGCA_OK);
        t.elapsed()
    };
    for _ in 0..10 {
        rust();
        c();
    }
    let (mut tr, mut tc) = (Vec::new(), Vec::new());
    for i in 0..2 * calls {
        if i % 2 == 0 {
            tr.push(rust().as_secs_f64());
        } else {
            tc.push(c().as_secs_f64());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mr, mc) = (median(&mut tr), median(&mut tc));
    assert_eq!(out, c_out, "the C call computes what the Rust call does");
    let bytes = (sels[0].total() * d * 2 * 2) as f64;
    println!(
        "sparse decode, 32k tokens, 10% selected ({threads} thread(s), {calls} calls each, alternating): Rust {:.1} us ({:.1} GB/s), C ABI {:.1} us; C / Rust = {:.3}",
        mr * 1e6,
        bytes / mr / 1e9,
        mc * 1e6,
        mc / mr
    );
    // SAFETY: made by hgca_cpu_new, not used again.
    unsafe { hgca_cpu_free(c_cpu) };
}
