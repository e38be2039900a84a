//! Fuzzes the paged views (every named layout and the strided form, any
//! slice lengths) and the block tables (dense and CSR, any contents): each
//! is either built or refused with a typed error, and a built one is read by
//! the CPU kernels (dense and sparse batched decode) without a read out of
//! bounds (this target runs under the address sanitizer, over exactly sized
//! heap buffers), giving no NaN from finite data and the attention hgca-ref
//! computes from the layout's own definition.
#![no_main]

use arbitrary::Arbitrary;
use hgca_cpu::{BatchTokens, CpuBackend, Par};
use hgca_kernels::{
    AttnShape, BlockTable, LseFormat, PagedBatch, PagedLayout, PagedPool, Selection,
};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Case {
    kind: u8,
    num_blocks: u8,
    block_size: u8,
    kv_heads: u8,
    group: u8,
    head_dim: u8,
    strides: [u16; 3],
    offsets: [u16; 2],
    /// Added to the exact lengths: a short slice must be refused.
    k_extra: i8,
    v_extra: i8,
    csr: bool,
    max_blocks: u8,
    table: Vec<u8>,
    lens: Vec<u8>,
    sparse: bool,
    picks: Vec<u16>,
    threads: bool,
    data: Vec<i8>,
}

/// The element offset of (page, token, head) in K and in V, by each layout's
/// definition (independent of hgca's strides).
fn addr(c: &Case, d: Dims, p: usize, i: usize, h: usize) -> (usize, usize) {
    let Dims { nb, bs, kvh, hd } = d;
    match c.kind % 9 {
        // vLLM CPU: [2, nb, kvh, bs, d] in one tensor.
        1 => (
            (((p) * kvh + h) * bs + i) * hd,
            (((nb + p) * kvh + h) * bs + i) * hd,
        ),
        // vLLM flash: [2, nb, bs, kvh, d].
        2 => (
            (((p) * bs + i) * kvh + h) * hd,
            (((nb + p) * bs + i) * kvh + h) * hd,
        ),
        // FlashInfer NHD, K and V apart: [nb, bs, kvh, d].
        3 => {
            let a = ((p * bs + i) * kvh + h) * hd;
            (a, a)
        }
        // FlashInfer HND: [nb, kvh, bs, d].
        4 => {
            let a = ((p * kvh + h) * bs + i) * hd;
            (a, a)
        }
        // Combined NHD: [nb, 2, bs, kvh, d].
        5 => (
            ((p * 2 * bs + i) * kvh + h) * hd,
            (((p * 2 + 1) * bs + i) * kvh + h) * hd,
        ),
        // Combined HND: [nb, 2, kvh, bs, d].
        6 => (
            ((p * 2 * kvh + h) * bs + i) * hd,
            (((p * 2 + 1) * kvh + h) * bs + i) * hd,
        ),
        // Token-major rows of `row_stride` (one page).
        7 => {
            let a = i * row_stride(c, d) + h * hd;
            (a, a)
        }
        // Head-major [kvh, tokens, d] (one page).
        8 => {
            let a = (h * bs + i) * hd;
            (a, a)
        }
        // Strided, from the case's own strides and offsets.
        _ => {
            let [b, t, hs] = c.strides.map(usize::from);
            let a = p * b + i * t + h * hs;
            (a + usize::from(c.offsets[0]), a + usize::from(c.offsets[1]))
        }
    }
}

#[derive(Clone, Copy)]
struct Dims {
    nb: usize,
    bs: usize,
    kvh: usize,
    hd: usize,
}

fn row_stride(c: &Case, d: Dims) -> usize {
    d.kvh * d.hd + usize::from(c.strides[0] % 8)
}

/// Exact slice lengths of the named layouts (K, V; V 0 for one tensor).
fn exact_lens(c: &Case, d: Dims) -> (usize, usize) {
    let Dims { nb, bs, kvh, hd } = d;
    let one = nb * bs * kvh * hd;
    match c.kind % 9 {
        1 | 2 | 5 | 6 => (2 * one, 0),
        3 | 4 => (one, one),
        // The last row needs only its heads, not the whole stride.
        7 => {
            let n = (bs - 1) * row_stride(c, d) + kvh * hd;
            (n, n)
        }
        8 => (one, one),
        _ => {
            // Strided: long enough for the farthest row, or short by the case.
            let far = |off: u16| {
                let [b, t, hs] = c.strides.map(usize::from);
                usize::from(off) + (nb - 1) * b + (bs - 1) * t + (kvh - 1) * hs + hd
            };
            (far(c.offsets[0]), far(c.offsets[1]))
        }
    }
}

fn adjust(n: usize, extra: i8) -> usize {
    // Mostly exact; sometimes off by a few elements either way.
    if extra.unsigned_abs() > 100 {
        n.saturating_add_signed(isize::from(extra % 4))
    } else {
        n
    }
}

/// One sequential and one two-thread backend for the whole run.
fn backend(threads: bool) -> &'static CpuBackend {
    static B: std::sync::OnceLock<[CpuBackend; 2]> = std::sync::OnceLock::new();
    let b = B.get_or_init(|| {
        let mk = |p| CpuBackend::new().with_par(p).expect("a valid thread count");
        [mk(Par::Seq), mk(Par::Rayon(2))]
    });
    &b[usize::from(threads)]
}

fuzz_target!(|c: Case| {
    let one_page = matches!(c.kind % 9, 7 | 8);
    let d = Dims {
        nb: if one_page {
            1
        } else {
            1 + usize::from(c.num_blocks % 8)
        },
        bs: 1 + usize::from(c.block_size % 20),
        kvh: 1 + usize::from(c.kv_heads % 3),
        hd: 1 + usize::from(c.head_dim % 24),
    };
    let (kl, vl) = exact_lens(&c, d);
    let (kl, vl) = (
        adjust(kl, c.k_extra),
        if vl == 0 { 0 } else { adjust(vl, c.v_extra) },
    );
    if kl + vl > 1 << 16 {
        return;
    }
    let val = |j: usize| {
        let x = c.data.get(j % c.data.len().max(1)).copied().unwrap_or(1);
        f32::from(x) / 16.0 + (j % 7) as f32 * 0.01
    };
    let k: Vec<f32> = (0..kl).map(val).collect();
    let v: Vec<f32> = (0..vl).map(|j| val(j + 3)).collect();
    let Dims { nb, bs, kvh, hd } = d;
    let pool = match c.kind % 9 {
        1 => PagedPool::vllm_cpu(&k, nb, kvh, bs, hd),
        2 => PagedPool::vllm_flash(&k, nb, bs, kvh, hd),
        3 => PagedPool::flashinfer_nhd(&k, &v, nb, bs, kvh, hd),
        4 => PagedPool::flashinfer_hnd(&k, &v, nb, bs, kvh, hd),
        5 => PagedPool::flashinfer_nhd_combined(&k, nb, bs, kvh, hd),
        6 => PagedPool::flashinfer_hnd_combined(&k, nb, bs, kvh, hd),
        7 => PagedPool::token_major(&k, &v, bs, kvh, hd, row_stride(&c, d)),
        8 => PagedPool::head_major(&k, &v, kvh, bs, hd),
        _ => {
            let [b, t, hs] = c.strides.map(usize::from);
            let layout = PagedLayout {
                num_blocks: nb,
                block_size: bs,
                kv_heads: kvh,
                head_dim: hd,
                block_stride: b,
                token_stride: t,
                head_stride: hs,
            };
            PagedPool::strided(&k, c.offsets[0].into(), &v, c.offsets[1].into(), layout, 1)
        }
    };
    let (kl0, vl0) = exact_lens(&c, d);
    let Ok(pool) = pool else {
        return;
    };
    // Built: then the slices held every row (short slices must be refused).
    assert!(
        kl >= kl0 && (vl0 == 0 || vl >= vl0),
        "built over short slices: {c:?}"
    );
    let one_tensor = vl0 == 0 && c.kind % 9 != 0;
    // Block tables from the case's bytes.
    let batch = 1 + c.lens.len().min(3);
    let lens: Vec<u32> = (0..batch)
        .map(|b| u32::from(c.lens.get(b).copied().unwrap_or(1)))
        .collect();
    let table_u32: Vec<u32> = c.table.iter().map(|&x| u32::from(x % 10)).collect();
    let (indptr, last);
    let table = if c.csr {
        // Pages per sequence from lens; indices from the table bytes.
        let mut ip = vec![0u32];
        for b in 0..batch {
            let n = lens[b] % 4;
            ip.push(ip[b] + n);
        }
        indptr = ip;
        last = lens
            .iter()
            .map(|&l| l % (bs as u32 + 2))
            .collect::<Vec<u32>>();
        let n = *indptr.last().unwrap() as usize;
        if table_u32.len() < n {
            return;
        }
        BlockTable::csr(&indptr, &table_u32[..n], &last)
    } else {
        let mb = usize::from(c.max_blocks % 5);
        if table_u32.len() < batch * mb {
            return;
        }
        BlockTable::dense(&table_u32[..batch * mb], mb, &lens)
    };
    let Ok(table) = table else {
        return;
    };
    let Ok(kvb) = PagedBatch::new(pool, table) else {
        return;
    };
    let Ok(shape) = AttnShape::new(kvh * (1 + usize::from(c.group % 3)), kvh, hd) else {
        return;
    };
    if kvb.check_shape(&shape).is_err() {
        return;
    }
    // Each sequence's pages, for the reference.
    let seq_pages: Vec<Vec<usize>> = (0..batch)
        .map(|b| {
            let s = kvb.seq(b).expect("b < batch");
            s.pages().iter().map(|&p| p as usize).collect()
        })
        .collect();
    let q: Vec<f32> = (0..batch * shape.q_len())
        .map(|j| val(j + 11) * 0.5)
        .collect();
    let sels: Vec<Selection> = (0..batch)
        .map(|b| {
            let n = kvb.seq_len(b);
            let heads: Vec<Vec<u32>> = (0..kvh)
                .map(|g| {
                    let mut ix: Vec<u32> = c
                        .picks
                        .iter()
                        .skip(g)
                        .step_by(kvh)
                        .map(|&x| u32::from(x) % (n as u32 + 1))
                        .collect();
                    ix.sort_unstable();
                    ix.dedup();
                    ix
                })
                .collect();
            Selection::from_heads(&heads)
        })
        .collect();
    let cpu = backend(c.threads);
    let rows = batch * shape.q_heads();
    let mut out = vec![f32::NAN; rows * hd];
    let mut lse = vec![f32::NAN; rows];
    let tokens = if c.sparse {
        BatchTokens::Sparse(&sels)
    } else {
        BatchTokens::Dense
    };
    let r = cpu.decode_batch(
        &shape,
        &q,
        &kvb,
        tokens,
        &mut out,
        &mut lse,
        LseFormat::NATURAL,
        None,
    );
    let any_out_of_range = c.sparse
        && sels.iter().enumerate().any(|(b, s)| {
            (0..kvh).any(|g| s.head(g).iter().any(|&j| j as usize >= kvb.seq_len(b)))
        });
    if any_out_of_range {
        assert!(r.is_err(), "an index past seq_len was accepted");
        return;
    }
    r.expect("a valid call");
    let group = shape.group();
    for b in 0..batch {
        let n = kvb.seq_len(b);
        for g in 0..kvh {
            let set: Vec<usize> = if c.sparse {
                sels[b].head(g).iter().map(|&j| j as usize).collect()
            } else {
                (0..n).collect()
            };
            // Gather the rows by the layout's definition.
            let mut kk = vec![0f32; n * hd];
            let mut vv = vec![0f32; n * hd];
            for t in 0..n {
                let (ka, va) = addr(&c, d, seq_pages[b][t / bs], t % bs, g);
                kk[t * hd..(t + 1) * hd].copy_from_slice(&k[ka..ka + hd]);
                let vsrc = if one_tensor { &k } else { &v };
                vv[t * hd..(t + 1) * hd].copy_from_slice(&vsrc[va..va + hd]);
            }
            for h in 0..group {
                let row = b * shape.q_heads() + g * group + h;
                let qr = &q[row * hd..(row + 1) * hd];
                let want = hgca_ref::attend_row(qr, &kk, &vv, hd, f64::from(shape.scale()), &set);
                let got = &out[row * hd..(row + 1) * hd];
                assert!(
                    got.iter().all(|x| x.is_finite()),
                    "non-finite output from finite data"
                );
                if set.is_empty() {
                    assert_eq!(lse[row], f32::NEG_INFINITY);
                    continue;
                }
                let vmax = vv.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
                for (x, w) in got.iter().zip(&want.out) {
                    assert!(
                        (f64::from(*x) - w).abs() <= 1e-4 * vmax.max(1.0),
                        "out {x} vs {w}: {c:?}"
                    );
                }
                assert!(
                    (f64::from(lse[row]) - want.lse).abs() <= 1e-4 * want.lse.abs().max(1.0),
                    "lse"
                );
            }
        }
    }
});
