//! Fuzzes the C ABI's entry points with arbitrary counts, lengths, layouts,
//! lse conventions and buffer sizes (every buffer really is as long as the
//! length passed with it, on the heap, under the address sanitizer): a call
//! either succeeds or returns a status; it never panics (`HGCA_PANIC` is a
//! failure here) and never reads or writes past a buffer; from finite input
//! a successful call writes no NaN.
#![no_main]

use std::ptr::{null, null_mut};

use arbitrary::Arbitrary;
use hgca::hgca_status::{HGCA_OK, HGCA_PANIC};
use hgca::*;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Call {
    Merge {
        parts: u8,
        tokens: u8,
        heads: u8,
        d: u8,
        base: u8,
        layout: u8,
        short: u8,
    },
    Decode {
        cache: Cache,
        table: Table,
        q_heads: u8,
        /// `(ith, nth)`: with `nth > 0`, also shard `ith` of `nth`.
        shard: (u8, u8),
        sparse: bool,
        weights: bool,
        base: u8,
        layout: u8,
        short: u8,
    },
    Append {
        cache: Cache,
        table: Table,
        q_heads: u8,
        n_q: u8,
        visible0: u8,
        seq: u8,
    },
    Bounds {
        cache: Cache,
        table: Table,
        q_heads: u8,
        seq: u8,
        k: u8,
        target: u8,
        cap: u8,
    },
    Maw {
        len: u8,
        n: u8,
        alpha: u8,
        kv_heads: u8,
        tokens: u8,
        n_gpu: u8,
        cap: u8,
    },
    Hybrid {
        cfg: Cfg,
        q_heads: u8,
        kv_heads: u8,
        d: u8,
        steps: Vec<(u8, bool)>,
    },
}

#[derive(Debug, Arbitrary)]
struct Cache {
    dtype: u8,
    layout: u8,
    k_len: u16,
    v_len: u16,
    one_tensor: bool,
    num_blocks: u8,
    block_size: u8,
    kv_heads: u8,
    head_dim: u8,
    strides: [u16; 3],
    offsets: [u16; 2],
}

#[derive(Debug, Arbitrary)]
struct Table {
    csr: bool,
    batch: u8,
    max_blocks: u8,
    entries: Vec<u8>,
    lens: Vec<u8>,
}

#[derive(Debug, Arbitrary)]
struct Cfg {
    window: u8,
    block: u8,
    sinks: u8,
    beta: u8,
    recovery: u8,
    param: u8,
    refresh: u8,
    threads: u8,
}

#[derive(Debug, Arbitrary)]
struct Case {
    calls: Vec<Call>,
    data: Vec<i8>,
}

fn cpu() -> *const hgca_cpu {
    struct P(*mut hgca_cpu);
    // SAFETY: the handle is thread-safe (documented) and lives for the run.
    unsafe impl Send for P {}
    unsafe impl Sync for P {}
    static CPU: std::sync::OnceLock<P> = std::sync::OnceLock::new();
    CPU.get_or_init(|| {
        let mut p = null_mut();
        // SAFETY: `p` is a valid out pointer.
        assert_eq!(unsafe { hgca_cpu_new(1, &mut p) }, HGCA_OK);
        P(p)
    })
    .0
}

fn ok(s: hgca_status) -> bool {
    assert_ne!(s, HGCA_PANIC, "a panic inside hgca");
    s == HGCA_OK
}

struct Data<'a>(&'a [i8], usize);
impl Data<'_> {
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.1 += 1;
                f32::from(
                    self.0
                        .get(self.1 % self.0.len().max(1))
                        .copied()
                        .unwrap_or(1),
                ) / 32.0
            })
            .collect()
    }
}

fn shape(q_heads: u8, kv_heads: usize, d: usize) -> hgca_shape {
    hgca_shape {
        size: size_of::<hgca_shape>() as u32,
        q_heads: (kv_heads * (1 + usize::from(q_heads % 3))) as u32 ^ u32::from(q_heads >= 250),
        kv_heads: kv_heads as u32,
        head_dim: d as u32,
        scale: 0.0,
    }
}

/// Buffers of a cache: owned here, exactly `k_len`/`v_len` elements.
struct CacheBufs {
    k32: Vec<f32>,
    v32: Vec<f32>,
    k16: Vec<u16>,
    v16: Vec<u16>,
}

fn cache(c: &Cache, bufs: &CacheBufs) -> hgca_paged_cache {
    let half = c.dtype % 3 != 0;
    let (k, v): (*const core::ffi::c_void, *const core::ffi::c_void) = if half {
        (bufs.k16.as_ptr().cast(), bufs.v16.as_ptr().cast())
    } else {
        (bufs.k32.as_ptr().cast(), bufs.v32.as_ptr().cast())
    };
    hgca_paged_cache {
        size: size_of::<hgca_paged_cache>() as u32,
        dtype: u32::from(c.dtype % 4),
        layout: u32::from(c.layout % 10),
        k,
        k_len: usize::from(c.k_len % 4096),
        v: if c.one_tensor { null() } else { v },
        v_len: if c.one_tensor {
            0
        } else {
            usize::from(c.v_len % 4096)
        },
        num_blocks: usize::from(c.num_blocks % 9),
        block_size: usize::from(c.block_size % 20),
        kv_heads: usize::from(c.kv_heads % 3),
        head_dim: usize::from(c.head_dim % 20),
        block_stride: usize::from(c.strides[0]),
        token_stride: usize::from(c.strides[1]),
        head_stride: usize::from(c.strides[2]),
        k_offset: usize::from(c.offsets[0]),
        v_offset: usize::from(c.offsets[1]),
    }
}

fn cache_bufs(c: &Cache, data: &mut Data<'_>) -> CacheBufs {
    let (kl, vl) = (usize::from(c.k_len % 4096), usize::from(c.v_len % 4096));
    let k32 = data.f32s(kl);
    let v32 = data.f32s(vl);
    let to16 = |x: &[f32]| {
        x.iter()
            .map(|&x| hgca_kernels::f16::from_f32(x).to_bits())
            .collect()
    };
    CacheBufs {
        k16: to16(&k32),
        v16: to16(&v32),
        k32,
        v32,
    }
}

/// A block table's arrays, owned here, and the struct over them.
struct TableBufs {
    entries: Vec<u32>,
    lens: Vec<u32>,
    indptr: Vec<u32>,
}

fn table_bufs(t: &Table) -> TableBufs {
    let batch = usize::from(t.batch % 4);
    let entries: Vec<u32> = t.entries.iter().map(|&x| u32::from(x % 12)).collect();
    let lens: Vec<u32> = (0..batch)
        .map(|b| u32::from(t.lens.get(b).copied().unwrap_or(0)))
        .collect();
    let mut indptr = vec![0u32];
    for b in 0..batch {
        let next = (indptr[b] + lens[b] % 4).min(entries.len() as u32);
        indptr.push(next);
    }
    TableBufs {
        entries,
        lens,
        indptr,
    }
}

fn table(t: &Table, b: &TableBufs) -> hgca_block_table {
    let batch = b.lens.len();
    let mb = usize::from(t.max_blocks % 5);
    let dense_ok = b.entries.len() >= batch * mb;
    hgca_block_table {
        size: size_of::<hgca_block_table>() as u32,
        kind: u32::from(t.csr),
        batch,
        // The dense table is as long as batch * max_blocks, or absent.
        table: if dense_ok { b.entries.as_ptr() } else { null() },
        max_blocks: mb,
        seq_lens: b.lens.as_ptr(),
        indptr: b.indptr.as_ptr(),
        indices: b.entries.as_ptr(),
        indices_len: b.entries.len(),
        last_page_len: b.lens.as_ptr(),
    }
}

fn finite_if_ok(ok: bool, xs: &[f32], what: &str) {
    if ok {
        assert!(
            xs.iter().all(|x| !x.is_nan()),
            "{what}: NaN from finite input"
        );
    }
}

/// A cache and block table over buffers owned beside them (the structs'
/// pointers point into the vectors' heap storage, which moves with them),
/// and a shape that fits the cache's heads.
struct Inputs {
    _bufs: (CacheBufs, TableBufs),
    cache: hgca_paged_cache,
    table: hgca_block_table,
    shape: hgca_shape,
}

fn inputs(cc: &Cache, tt: &Table, q_heads: u8, data: &mut Data<'_>) -> Inputs {
    let cb = cache_bufs(cc, data);
    let tb = table_bufs(tt);
    let (pc, bt) = (cache(cc, &cb), table(tt, &tb));
    let shape = shape(q_heads, pc.kv_heads.max(1), pc.head_dim.max(1));
    Inputs {
        _bufs: (cb, tb),
        cache: pc,
        table: bt,
        shape,
    }
}

/// Outputs over the caller's buffers (weights optional).
fn outputs(
    out: &mut [f32],
    lse: &mut [f32],
    base: u32,
    layout: u32,
    w: Option<&mut [f32]>,
) -> hgca_outputs {
    let (weights, weights_len) = w.map_or((null_mut(), 0), |w| (w.as_mut_ptr(), w.len()));
    hgca_outputs {
        size: size_of::<hgca_outputs>() as u32,
        out: out.as_mut_ptr(),
        out_len: out.len(),
        lse: lse.as_mut_ptr(),
        lse_len: lse.len(),
        lse_base: base,
        lse_layout: layout,
        weights,
        weights_len,
    }
}

fuzz_target!(|c: Case| {
    let mut data = Data(&c.data, 0);
    for call in c.calls.iter().take(6) {
        match call {
            &Call::Merge {
                parts,
                tokens,
                heads,
                d,
                base,
                layout,
                short,
            } => {
                let (n, t, h, d) = (
                    usize::from(parts % 5),
                    usize::from(tokens % 4),
                    usize::from(heads % 4),
                    usize::from(d % 17),
                );
                let bufs: Vec<(Vec<f32>, Vec<f32>)> = (0..n)
                    .map(|i| {
                        let cut = usize::from(short % 7 == 1 && i == 0);
                        (data.f32s((t * h * d).saturating_sub(cut)), data.f32s(t * h))
                    })
                    .collect();
                let states: Vec<hgca_state> = bufs
                    .iter()
                    .map(|(o, l)| hgca_state {
                        out: o.as_ptr(),
                        out_len: o.len(),
                        lse: l.as_ptr(),
                        lse_len: l.len(),
                    })
                    .collect();
                let mut out = vec![0f32; (t * h * d).saturating_sub(usize::from(short % 7 == 2))];
                let mut lse = vec![0f32; t * h];
                // SAFETY: every pointer is valid for the length passed with it.
                let s = unsafe {
                    hgca_merge(
                        states.as_ptr(),
                        n,
                        t,
                        h,
                        d,
                        u32::from(base % 3),
                        u32::from(layout % 3),
                        out.as_mut_ptr(),
                        out.len(),
                        lse.as_mut_ptr(),
                        lse.len(),
                    )
                };
                let good = ok(s);
                finite_if_ok(good, &out, "merge out");
                finite_if_ok(good, &lse, "merge lse");
                if let Some(first) = states.first() {
                    // SAFETY: as above; `out`/`lse` do not alias the states.
                    let s = unsafe {
                        hgca_merge_into(
                            out.as_mut_ptr(),
                            out.len(),
                            lse.as_mut_ptr(),
                            lse.len(),
                            first,
                            t,
                            h,
                            d,
                            u32::from(base % 3),
                            u32::from(layout % 3),
                        )
                    };
                    let good = ok(s);
                    finite_if_ok(good, &out, "merge_into out");
                }
            }
            Call::Decode {
                cache: cc,
                table: tt,
                q_heads,
                shard,
                sparse,
                weights,
                base,
                layout,
                short,
            } => {
                let inp = inputs(cc, tt, *q_heads, &mut data);
                let (pc, bt, sh) = (&inp.cache, &inp.table, inp.shape);
                let (batch, qh, d) = (bt.batch, sh.q_heads as usize, sh.head_dim as usize);
                let q = data.f32s(batch * qh * d);
                // One selection per sequence: the first tokens, per KV head.
                let kvh = pc.kv_heads.max(1);
                let idx: Vec<u32> = (0..8).collect();
                let offs: Vec<usize> = (0..=kvh).map(|g| g * 2).collect();
                let sels: Vec<hgca_selection> = (0..batch)
                    .map(|_| hgca_selection {
                        indices: idx.as_ptr(),
                        indices_len: 2 * kvh.min(4),
                        offsets: offs.as_ptr(),
                        offsets_len: offs.len(),
                    })
                    .collect();
                let cut = usize::from(*short % 5 == 1);
                let mut out = vec![0f32; (batch * qh * d).saturating_sub(cut)];
                let mut lse = vec![0f32; batch * qh];
                let mut w = vec![0f32; batch * qh * 64];
                let w = weights.then_some(&mut w[..]);
                let outs = outputs(
                    &mut out,
                    &mut lse,
                    u32::from(base % 3),
                    u32::from(layout % 3),
                    w,
                );
                // SAFETY: every pointer is valid for the length passed with it.
                let s = unsafe {
                    hgca_decode_batch(
                        cpu(),
                        &sh,
                        q.as_ptr(),
                        q.len(),
                        pc,
                        bt,
                        if *sparse { sels.as_ptr() } else { null() },
                        if *sparse { sels.len() } else { 0 },
                        &outs,
                    )
                };
                let good = ok(s);
                finite_if_ok(good, &out, "decode out");
                // One shard on this thread, its rows and weights sized by hgca.
                let (ith, nth) = (usize::from(shard.0 % 5), usize::from(shard.1 % 4));
                let (mut first, mut count, mut wfirst, mut wcount) = (0, 0, 0, 0);
                let sels_ptr = if *sparse { sels.as_ptr() } else { null() };
                let n_sels = if *sparse { sels.len() } else { 0 };
                // SAFETY: valid pointers for the call.
                let rows_ok =
                    ok(unsafe { hgca_shard_rows(&sh, batch, ith, nth, &mut first, &mut count) });
                // SAFETY: as above.
                let w_ok = ok(unsafe {
                    hgca_shard_weights(
                        &sh,
                        pc,
                        bt,
                        sels_ptr,
                        n_sels,
                        ith,
                        nth,
                        &mut wfirst,
                        &mut wcount,
                    )
                });
                if rows_ok && count <= 64 && wcount <= 1 << 16 {
                    let mut so = vec![0f32; count * d];
                    let mut sl = vec![0f32; count];
                    let mut sw = vec![0f32; wcount];
                    let w = (*weights && w_ok).then_some(&mut sw[..]);
                    let outs = outputs(&mut so, &mut sl, u32::from(base % 3), 0, w);
                    // SAFETY: every pointer is valid for the length passed with it.
                    let s = unsafe {
                        hgca_decode_batch_shard(
                            cpu(),
                            ith,
                            nth,
                            &sh,
                            q.as_ptr(),
                            q.len(),
                            pc,
                            bt,
                            sels_ptr,
                            n_sels,
                            &outs,
                        )
                    };
                    finite_if_ok(ok(s), &so, "shard out");
                }
            }
            Call::Append {
                cache: cc,
                table: tt,
                q_heads,
                n_q,
                visible0,
                seq,
            } => {
                let inp = inputs(cc, tt, *q_heads, &mut data);
                let (pc, bt, sh) = (&inp.cache, &inp.table, inp.shape);
                let (nq, qh, d) = (
                    usize::from(n_q % 6),
                    sh.q_heads as usize,
                    sh.head_dim as usize,
                );
                let q = data.f32s(nq * qh * d);
                let mut out = vec![0f32; nq * qh * d];
                let mut lse = vec![0f32; nq * qh];
                let outs = outputs(&mut out, &mut lse, 0, 0, None);
                // SAFETY: every pointer is valid for the length passed with it.
                let s = unsafe {
                    hgca_append_attention(
                        cpu(),
                        &sh,
                        q.as_ptr(),
                        nq,
                        usize::from(*visible0),
                        pc,
                        bt,
                        usize::from(*seq % 4),
                        &outs,
                    )
                };
                finite_if_ok(ok(s), &out, "append out");
            }
            Call::Bounds {
                cache: cc,
                table: tt,
                q_heads,
                seq,
                k,
                target,
                cap,
            } => {
                let inp = inputs(cc, tt, *q_heads, &mut data);
                let (pc, bt, sh) = (&inp.cache, &inp.table, inp.shape);
                let mut b = null_mut();
                // SAFETY: valid pointers for the call.
                if !ok(unsafe { hgca_page_bounds_new(pc, &mut b) }) {
                    continue;
                }
                let seq = usize::from(*seq % 4);
                // SAFETY: as above; `b` is the live handle.
                let _ = ok(unsafe { hgca_page_bounds_update(b, pc, bt, seq) });
                let q = data.f32s(sh.q_heads as usize * sh.head_dim as usize);
                let pages = pc.num_blocks;
                let mut ub = vec![0f32; pc.kv_heads * pages];
                // SAFETY: as above.
                let good = ok(unsafe {
                    hgca_page_upper_bounds(
                        cpu(),
                        &sh,
                        q.as_ptr(),
                        q.len(),
                        pc,
                        bt,
                        seq,
                        b,
                        ub.as_mut_ptr(),
                        ub.len(),
                    )
                });
                finite_if_ok(good, &ub, "upper bounds");
                let mut idx = vec![0u32; usize::from(*cap)];
                let mut offs = vec![0usize; pc.kv_heads + 1];
                let mut so = hgca_selection_out {
                    indices: idx.as_mut_ptr(),
                    capacity: idx.len(),
                    offsets: offs.as_mut_ptr(),
                    offsets_len: offs.len(),
                    written: 0,
                };
                let tokens = pages * pc.block_size;
                // SAFETY: as above.
                let _ = ok(unsafe {
                    hgca_select_top_pages(
                        ub.as_ptr(),
                        ub.len(),
                        pc.kv_heads,
                        pages,
                        pc.block_size,
                        tokens,
                        usize::from(*k),
                        &mut so,
                    )
                });
                let mut reports = vec![
                    hgca_head_mass {
                        pages: 0,
                        estimated: 0.0,
                        dense: 0
                    };
                    pc.kv_heads
                ];
                // SAFETY: as above.
                let _ = ok(unsafe {
                    hgca_select_by_mass(
                        ub.as_ptr(),
                        ub.len(),
                        pc.kv_heads,
                        pages,
                        pc.block_size,
                        tokens,
                        f32::from(*target) / 255.0,
                        0.5,
                        &mut so,
                        reports.as_mut_ptr(),
                        reports.len(),
                    )
                });
                // SAFETY: `b` is live.
                let _ = ok(unsafe { hgca_page_bounds_reset(b, usize::from(*k % 10)) });
                // SAFETY: `b` is live and freed once.
                unsafe { hgca_page_bounds_free(b) };
            }
            &Call::Maw {
                len,
                n,
                alpha,
                kv_heads,
                tokens,
                n_gpu,
                cap,
            } => {
                let mut maw = data
                    .f32s(usize::from(len))
                    .iter()
                    .map(|x| x.abs())
                    .collect::<Vec<_>>();
                let n = usize::from(n % 32);
                let idx: Vec<u32> = (0..n).map(|i| (i * 7 % 300) as u32).collect();
                let w = data.f32s(n).iter().map(|x| x.abs()).collect::<Vec<_>>();
                // SAFETY: every pointer is valid for the length passed with it.
                let _ = ok(unsafe {
                    hgca_maw_update_gather(
                        maw.as_mut_ptr(),
                        maw.len(),
                        idx.as_ptr(),
                        w.as_ptr(),
                        n,
                        f32::from(alpha) / 255.0,
                    )
                });
                let (kvh, t) = (usize::from(kv_heads % 4), usize::from(tokens));
                let betas = vec![1.0f32; kvh];
                let mut ix = vec![0u32; usize::from(cap)];
                let mut offs = vec![0usize; kvh + 1];
                let mut so = hgca_selection_out {
                    indices: ix.as_mut_ptr(),
                    capacity: ix.len(),
                    offsets: offs.as_mut_ptr(),
                    offsets_len: offs.len(),
                    written: 0,
                };
                // SAFETY: as above.
                let _ = ok(unsafe {
                    hgca_select_threshold(
                        maw.as_ptr(),
                        maw.len(),
                        kvh,
                        t,
                        betas.as_ptr(),
                        usize::from(n_gpu),
                        &mut so,
                    )
                });
            }
            Call::Hybrid {
                cfg,
                q_heads,
                kv_heads,
                d,
                steps,
            } => {
                let kvh = usize::from(kv_heads % 3);
                let sh = shape(*q_heads, kvh.max(1), usize::from(d % 12));
                let mut hc = hgca_hybrid_config {
                    size: 0,
                    dtype: 0,
                    window: 0,
                    block: 0,
                    sinks: 0,
                    beta: 0.0,
                    alpha: 0.0,
                    recovery: 0,
                    recovery_param: 0,
                    refresh_queries: 0,
                    threads: 0,
                    mass_target: 0.0,
                    mass_max_share: 0.0,
                };
                // SAFETY: a valid out pointer.
                assert!(ok(unsafe { hgca_hybrid_config_default(&mut hc) }));
                hc.window = usize::from(cfg.window % 40);
                hc.block = usize::from(cfg.block % 17);
                hc.sinks = usize::from(cfg.sinks % 5);
                hc.beta = f32::from(cfg.beta) / 64.0;
                // 0..=3 the rules (3: the mass selector), 4 an unknown one.
                hc.recovery = u32::from(cfg.recovery % 5);
                // Targets and shares in [0, 1]: 0 is refused, the rest valid.
                hc.mass_target = f32::from(cfg.param % 8) / 7.0;
                hc.mass_max_share = f32::from(cfg.refresh % 5) / 4.0;
                hc.recovery_param = usize::from(cfg.param % 4);
                hc.refresh_queries = usize::from(cfg.refresh % 3);
                hc.threads = u32::from(cfg.threads % 3);
                let mut h = null_mut();
                // SAFETY: valid pointers.
                if !ok(unsafe { hgca_hybrid_new(&sh, &hc, &mut h) }) {
                    continue;
                }
                let (ql, kl) = (
                    sh.q_heads as usize * sh.head_dim as usize,
                    kvh.max(1) * sh.head_dim as usize,
                );
                for &(n, attend) in steps.iter().take(8) {
                    let n = usize::from(n % 40);
                    let q = data.f32s(n.max(1) * ql);
                    let k = data.f32s(n * kl);
                    let v = data.f32s(n * kl);
                    let mut out = vec![0f32; n.max(1) * ql];
                    // SAFETY: valid pointers for their lengths; `h` is live.
                    let s = unsafe {
                        if attend {
                            hgca_hybrid_attend(h, q.as_ptr(), ql, out.as_mut_ptr(), ql)
                        } else {
                            hgca_hybrid_forward(
                                h,
                                q.as_ptr(),
                                n * ql,
                                k.as_ptr(),
                                k.len(),
                                v.as_ptr(),
                                v.len(),
                                n,
                                out.as_mut_ptr(),
                                n * ql,
                            )
                        }
                    };
                    finite_if_ok(ok(s), &out, "hybrid out");
                }
                // SAFETY: `h` is live and freed once.
                unsafe { hgca_hybrid_free(h) };
            }
        }
    }
});
