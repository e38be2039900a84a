"""pytest over the built wheel: every function against a float64 numpy
reference of softmax over the union of attended tokens, FlashInfer's and
vLLM's LSE conventions, a mini engine, the GIL released, bad input."""

import math
import threading
import time

import numpy as np
import pytest

import hgca

LN2 = math.log(2.0)


def ref_attend(q, k, v, scale):
    """q [d], k/v [n, d] float64: (out [d], natural lse)."""
    if len(k) == 0:
        return np.zeros(q.shape[-1]), -np.inf
    s = (k.astype(np.float64) @ q.astype(np.float64)) * scale
    m = s.max()
    w = np.exp(s - m)
    return (w @ v.astype(np.float64)) / w.sum(), m + math.log(w.sum())


def ref_weights(q, k, scale):
    s = (k.astype(np.float64) @ q.astype(np.float64)) * scale
    w = np.exp(s - s.max())
    return w / w.sum()


# ------------------------------------------------------------------ caches


class PagedCache:
    """Sequences of K/V in an engine's layout over shuffled pages; pages no
    sequence owns are NaN, so a wrong row shows."""

    def __init__(self, lens, kv_heads, d, block, layout="vllm_cpu", dtype=np.float32, seed=0, spare=3):
        rng = np.random.default_rng(seed)
        self.lens, self.hk, self.d, self.bs, self.layout = list(lens), kv_heads, d, block, layout
        self.k = [rng.standard_normal((n, kv_heads, d)).astype(np.float32) for n in lens]
        self.v = [(rng.standard_normal((n, kv_heads, d)) + 0.25).astype(np.float32) for n in lens]
        if dtype != np.float32:  # the reference sees exactly the stored values
            self.k = [x.astype(dtype).astype(np.float32) for x in self.k]
            self.v = [x.astype(dtype).astype(np.float32) for x in self.v]
        pages = [-(-n // block) for n in lens]
        nb = sum(pages) + spare
        order = rng.permutation(nb).astype(np.int32)
        self.pages, at = [], 0
        for p in pages:
            self.pages.append(order[at:at + p])
            at += p
        self.nb = nb
        self.table = np.zeros((len(lens), max(pages) + 1), dtype=np.int32)
        for b, p in enumerate(self.pages):
            self.table[b, : len(p)] = p
        self.seq_lens = np.array(lens, dtype=np.int32)
        self.cache = self._build(dtype)

    def _build(self, dtype):
        nb, bs, hk, d = self.nb, self.bs, self.hk, self.d
        if self.layout == "vllm_cpu":
            c = np.full((2, nb, hk, bs, d), np.nan, dtype=np.float32)
            for b, n in enumerate(self.lens):
                for j in range(n):
                    p, i = self.pages[b][j // bs], j % bs
                    c[0, p, :, i] = self.k[b][j]
                    c[1, p, :, i] = self.v[b][j]
        elif self.layout == "vllm_flash":
            c = np.full((2, nb, bs, hk, d), np.nan, dtype=np.float32)
            for b, n in enumerate(self.lens):
                for j in range(n):
                    p, i = self.pages[b][j // bs], j % bs
                    c[0, p, i] = self.k[b][j]
                    c[1, p, i] = self.v[b][j]
        elif self.layout in ("nhd", "nhd_tuple"):
            c = np.full((nb, 2, bs, hk, d), np.nan, dtype=np.float32)
            for b, n in enumerate(self.lens):
                for j in range(n):
                    p, i = self.pages[b][j // bs], j % bs
                    c[p, 0, i] = self.k[b][j]
                    c[p, 1, i] = self.v[b][j]
            if self.layout == "nhd_tuple":
                return (np.ascontiguousarray(c[:, 0]).astype(dtype), np.ascontiguousarray(c[:, 1]).astype(dtype))
        elif self.layout == "hnd":
            c = np.full((nb, 2, hk, bs, d), np.nan, dtype=np.float32)
            for b, n in enumerate(self.lens):
                for j in range(n):
                    p, i = self.pages[b][j // bs], j % bs
                    c[p, 0, :, i] = self.k[b][j]
                    c[p, 1, :, i] = self.v[b][j]
        else:
            raise ValueError(self.layout)
        return c.astype(dtype)

    @property
    def api_layout(self):
        return "nhd" if self.layout == "nhd_tuple" else self.layout


def random_selection(rng, lens, hk):
    return [
        [np.sort(rng.choice(n, size=rng.integers(0, n + 1), replace=False)).astype(np.int32) for _ in range(hk)]
        for n in lens
    ]


def to_bf16_bits(x):
    """float32 -> bfloat16 bits (round to nearest even), and the value they hold."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r, (r.astype(np.uint32) << 16).view(np.float32)


# ------------------------------------------------------------------ merge


def split_partials(rng, seq, heads, d, n_parts, base, layout):
    """Reference partials of a random partition of 12 tokens, and the union's."""
    q = rng.standard_normal((seq, heads, d))
    k = rng.standard_normal((12, d))
    v = rng.standard_normal((12, d))
    part_of = rng.integers(0, n_parts, size=12)
    scale = 1 / math.sqrt(d)
    parts = []
    for p in range(n_parts):
        idx = np.nonzero(part_of == p)[0]
        vo = np.zeros((seq, heads, d), np.float32)
        so = np.zeros((seq, heads), np.float64)
        for t in range(seq):
            for h in range(heads):
                o, l = ref_attend(q[t, h], k[idx], v[idx], scale)
                vo[t, h], so[t, h] = o, l
        parts.append((vo, so))
    want_v = np.zeros((seq, heads, d))
    want_s = np.zeros((seq, heads))
    for t in range(seq):
        for h in range(heads):
            want_v[t, h], want_s[t, h] = ref_attend(q[t, h], k, v, scale)

    def conv(s):
        s = s / LN2 if base == 2 else s
        s = s.T if layout == "heads_tokens" else s
        return np.ascontiguousarray(s, dtype=np.float32)

    return [(vo, conv(so)) for vo, so in parts], want_v, conv(want_s)


@pytest.mark.parametrize("base", [2, "e"])
@pytest.mark.parametrize("layout", ["tokens_heads", "heads_tokens"])
def test_merge_state_both_conventions(base, layout):
    rng = np.random.default_rng(1)
    parts, want_v, want_s = split_partials(rng, 5, 3, 8, 2, base, layout)
    (va, sa), (vb, sb) = parts
    v, s = hgca.merge_state(va, sa, vb, sb, lse_base=base, lse_layout=layout)
    np.testing.assert_allclose(v, want_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-6)
    hgca.merge_state_in_place(va, sa, vb, sb, lse_base=base, lse_layout=layout)
    np.testing.assert_allclose(va, v, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sa, s, rtol=1e-6, atol=1e-7)


def test_merge_states_n_way_and_default_is_base_2():
    rng = np.random.default_rng(2)
    parts, want_v, want_s = split_partials(rng, 4, 2, 16, 4, 2, "tokens_heads")
    v = np.ascontiguousarray(np.stack([p[0] for p in parts], axis=1))  # [seq, n, H, D]
    s = np.ascontiguousarray(np.stack([p[1] for p in parts], axis=1))  # [seq, n, H]
    mv, ms = hgca.merge_states(v, s)  # FlashInfer's default: base 2
    np.testing.assert_allclose(mv, want_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ms, want_s, rtol=1e-5, atol=1e-6)


def test_flashinfer_partials_merged_equal_converting_first():
    rng = np.random.default_rng(3)
    parts, want_v, _ = split_partials(rng, 6, 4, 8, 2, 2, "tokens_heads")
    (va, sa), (vb, sb) = parts
    v2, s2 = hgca.merge_state(va, sa, vb, sb, lse_base=2)
    ve, se = hgca.merge_state(va, (sa * LN2).astype(np.float32), vb, (sb * LN2).astype(np.float32), lse_base="e")
    np.testing.assert_allclose(v2, ve, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s2 * LN2, se, rtol=1e-5, atol=1e-6)
    # Reading base-2 values as natural logs gives another (wrong) answer: the bug the keyword prevents.
    vw, _ = hgca.merge_state(va, sa, vb, sb, lse_base="e")
    assert not np.allclose(vw, want_v, rtol=1e-3, atol=1e-4)


def test_empty_partials_merge_to_zero_not_nan():
    v = np.zeros((1, 1, 4), np.float32)
    s = np.full((1, 1), -np.inf, np.float32)
    mv, ms = hgca.merge_state(v, s, v.copy(), s.copy())
    assert ms[0, 0] == -np.inf and not np.isnan(mv).any() and (mv == 0).all()


# ------------------------------------------------------------------ decode


def check_decode(pc, q, out, lse, sel, base, layout, weights=None, scale=None):
    B, qh, d = q.shape
    group = qh // pc.hk
    scale = scale if scale is not None else 1 / math.sqrt(d)
    wat = 0
    for b in range(B):
        for g in range(pc.hk):
            idx = np.arange(pc.lens[b]) if sel is None else sel[b][g]
            for i in range(group):
                h = g * group + i
                o, l = ref_attend(q[b, h], pc.k[b][idx, g], pc.v[b][idx, g], scale)
                np.testing.assert_allclose(out[b, h], o, rtol=2e-5, atol=2e-5)
                got = lse[b, h] if layout == "tokens_heads" else lse[h, b]
                want = l / LN2 if base == 2 else l
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
                if weights is not None and len(idx):
                    if sel is None:
                        at = wat + h * pc.lens[b]
                    else:
                        at = wat + group * sum(len(x) for x in sel[b][:g]) + i * len(idx)
                    np.testing.assert_allclose(weights[at: at + len(idx)], ref_weights(q[b, h], pc.k[b][idx, g], scale), rtol=1e-4, atol=1e-6)
        wat += qh * pc.lens[b] if sel is None else group * sum(len(x) for x in sel[b])
    if weights is not None:
        assert wat == len(weights)


@pytest.mark.parametrize("layout", ["vllm_cpu", "vllm_flash", "nhd", "nhd_tuple", "hnd"])
@pytest.mark.parametrize("block", [1, 16])
def test_sparse_and_dense_decode_match_reference(layout, block):
    rng = np.random.default_rng(4)
    pc = PagedCache([70, 1, 0, 33], kv_heads=2, d=16, block=block, layout=layout, seed=5)
    q = rng.standard_normal((4, 8, 16)).astype(np.float32)
    sel = random_selection(rng, pc.lens, 2)
    for base, lay in [(2, "tokens_heads"), ("e", "heads_tokens")]:
        out, lse, w = hgca.sparse_decode(q, pc.cache, pc.table, pc.seq_lens, sel, layout=pc.api_layout, lse_base=base, lse_layout=lay, return_weights=True)
        check_decode(pc, q, out, lse, sel, base, lay, w)
        out, lse, w = hgca.dense_decode(q, pc.cache, pc.table, pc.seq_lens, layout=pc.api_layout, lse_base=base, lse_layout=lay, return_weights=True)
        check_decode(pc, q, out, lse, None, base, lay, w)


def test_f16_and_bf16_caches():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    pc = PagedCache([40, 17], 2, 8, 16, dtype=np.float16, seed=7)
    sel = random_selection(rng, pc.lens, 2)
    out, lse = hgca.sparse_decode(q, pc.cache, pc.table, pc.seq_lens, sel)
    check_decode(pc, q, out, lse, sel, 2, "tokens_heads")
    pc32 = PagedCache([40, 17], 2, 8, 16, seed=8)
    bits, vals = to_bf16_bits(pc32.cache)
    pc32.k = [to_bf16_bits(x)[1] for x in pc32.k]
    pc32.v = [to_bf16_bits(x)[1] for x in pc32.v]
    out, lse = hgca.sparse_decode(q, bits, pc32.table, pc32.seq_lens, sel, dtype="bf16")
    check_decode(pc32, q, out, lse, sel, 2, "tokens_heads")


def test_append_attention_is_causal():
    rng = np.random.default_rng(9)
    pc = PagedCache([50], 2, 8, 16, seed=10)
    n_q = 6
    q = rng.standard_normal((n_q, 4, 8)).astype(np.float32)
    out, lse = hgca.append_attention(q, pc.cache, pc.pages[0], 50, lse_base="e")
    for i in range(n_q):
        vis = 50 - n_q + 1 + i
        for h in range(4):
            o, l = ref_attend(q[i, h], pc.k[0][:vis, h // 2], pc.v[0][:vis, h // 2], 1 / math.sqrt(8))
            np.testing.assert_allclose(out[i, h], o, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(lse[i, h], l, rtol=2e-5, atol=2e-5)


def test_key_bounds_and_selectors():
    rng = np.random.default_rng(11)
    pc = PagedCache([100, 37], 2, 8, 16, seed=12)
    kb = hgca.KeyBounds(pc.cache)
    q = rng.standard_normal((4, 8)).astype(np.float32)
    kb.update(pc.cache, pc.table, pc.seq_lens, 0)
    ub = kb.upper_bounds(q, pc.cache, pc.table, pc.seq_lens, 0)
    pages = -(-100 // 16)
    assert ub.shape == (2, pages)
    for h in range(4):
        g = h // 2
        s = pc.k[0][:, g] @ q[h] / math.sqrt(8)
        for p in range(pages):
            assert s[p * 16:(p + 1) * 16].max() <= ub[g, p] + 1e-5
    top = hgca.select_top_pages(ub, 16, 100, 2)
    for g in range(2):
        chosen = sorted(set(int(j) // 16 for j in top[g]))
        assert len(chosen) == 2 and min(ub[g, chosen]) >= max(np.delete(ub[g], chosen))
    sel, report = hgca.select_by_mass(ub, 16, 100, 1.0)
    assert all(len(s) == 100 for s in sel) and all(r["pages"] == pages for r in report)
    sel, report = hgca.select_by_mass(ub, 16, 100, 0.9, max_share=1e-6)
    for s, r in zip(sel, report):
        # a share of 1e-6 allows one page: a head that needs more takes all, and says so
        if r["dense"]:
            assert r["pages"] == pages and len(s) == 100
        else:
            assert r["pages"] == 1 and r["estimated"] >= 0.9
    # a page given to another owner: reset, and the bounds follow its new keys
    p0 = int(pc.pages[0][0])
    pc.cache[0, p0, 0, 0, 0] = 100.0
    kb.update(pc.cache, pc.table, pc.seq_lens, 0)
    kb.reset(p0)
    kb.update(pc.cache, pc.table, pc.seq_lens, 0)
    qe = np.zeros((4, 8), np.float32)
    qe[0, 0] = 1.0
    assert kb.upper_bounds(qe, pc.cache, pc.table, pc.seq_lens, 0)[0, 0] >= 100.0 / math.sqrt(8) - 1e-4
    pc.cache[0, p0, 0, 0, 0] = pc.k[0][0, 0, 0]
    # the selection decodes
    out, lse = hgca.sparse_decode(q[None], pc.cache, pc.table[:1], pc.seq_lens[:1], [top])
    check_decode(pc, q[None], out, lse, [top], 2, "tokens_heads")


# ------------------------------------------------------------------ mini engine


def test_mini_engine_decode_loop():
    """4 sequences of different lengths in a vLLM-layout cache with shuffled
    pages, decode steps: (a) select pages by key bounds, CPU sparse decode,
    merged with a "GPU" partial over each sequence's recent window, against
    the reference over the union; (b) the same sequence through
    HybridAttention (every entry selected) against full attention."""
    rng = np.random.default_rng(13)
    hk, qh, d, bs, win = 2, 4, 16, 16, 24
    pc = PagedCache([90, 40, 65, 30], hk, d, bs, seed=14, spare=40)
    kb = hgca.KeyBounds(pc.cache)
    layers = [hgca.HybridAttention(qh, hk, d, window=32, block=8, sinks=10**6, dtype="f32", threads=1) for _ in range(4)]
    for b, layer in enumerate(layers):  # prefill the layers with what the cache holds
        n = pc.lens[b]
        layer.forward(rng.standard_normal((n, qh, d)).astype(np.float32), pc.k[b], pc.v[b])
    for step in range(5):
        # each sequence gets a token: into its pages and its layer
        for b in range(4):
            j = pc.lens[b]
            k = rng.standard_normal((1, hk, d)).astype(np.float32)
            v = rng.standard_normal((1, hk, d)).astype(np.float32)
            if j % bs == 0:
                free = sorted(set(range(pc.nb)) - set(np.concatenate(pc.pages).tolist()))
                pc.pages[b] = np.append(pc.pages[b], np.int32(free[0]))
                if len(pc.pages[b]) > pc.table.shape[1]:
                    pc.table = np.pad(pc.table, ((0, 0), (0, 1)))
                pc.table[b, len(pc.pages[b]) - 1] = free[0]
            p = pc.pages[b][j // bs]
            pc.cache[0, p, :, j % bs] = k[0]
            pc.cache[1, p, :, j % bs] = v[0]
            pc.k[b] = np.concatenate([pc.k[b], k])
            pc.v[b] = np.concatenate([pc.v[b], v])
            pc.lens[b] += 1
            layers[b].append(k, v)
        pc.seq_lens = np.array(pc.lens, np.int32)
        q = rng.standard_normal((4, qh, d)).astype(np.float32)
        # (a) CPU side: the older tokens' pages by bounds; "GPU" side: the window, base 2
        sels, gpu_v, gpu_s = [], np.zeros((4, qh, d), np.float32), np.zeros((4, qh), np.float32)
        for b in range(4):
            n, old = pc.lens[b], max(pc.lens[b] - win, 0)
            kb.update(pc.cache, pc.table, pc.seq_lens, b)
            ub = kb.upper_bounds(q[b], pc.cache, pc.table, pc.seq_lens, b)
            top = hgca.select_top_pages(ub, bs, n, 2)
            sels.append([t[t < old] for t in top])
            for h in range(qh):
                o, l = ref_attend(q[b, h], pc.k[b][old:, h // 2], pc.v[b][old:, h // 2], 1 / math.sqrt(d))
                gpu_v[b, h], gpu_s[b, h] = o, l / LN2
        cpu_v, cpu_s = hgca.sparse_decode(q, pc.cache, pc.table, pc.seq_lens, sels)
        v, s = hgca.merge_state(cpu_v, cpu_s, gpu_v, gpu_s)
        for b in range(4):
            n, old = pc.lens[b], max(pc.lens[b] - win, 0)
            for h in range(qh):
                idx = np.concatenate([sels[b][h // 2], np.arange(old, n)])
                o, l = ref_attend(q[b, h], pc.k[b][idx, h // 2], pc.v[b][idx, h // 2], 1 / math.sqrt(d))
                np.testing.assert_allclose(v[b, h], o, rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(s[b, h], l / LN2, rtol=1e-4, atol=1e-5)
        # (b) the hybrid layer, every entry selected: full attention
        for b in range(4):
            out = layers[b].attend(q[b])
            for h in range(qh):
                o, _ = ref_attend(q[b, h], pc.k[b][:, h // 2], pc.v[b][:, h // 2], 1 / math.sqrt(d))
                np.testing.assert_allclose(out[h], o, rtol=1e-4, atol=1e-5)
            st = layers[b].stats()
            assert len(layers[b]) == pc.lens[b] and st["cpu_tokens"] + st["window_tokens"] == pc.lens[b]
        print(f"mini engine step {step + 1}/5: 4 sequences, {sum(pc.lens)} tokens, merged with the GPU partial")


# ------------------------------------------------------------------ threads


def test_the_gil_is_released_during_kernel_calls():
    """While another thread is inside hgca's kernels, this thread runs
    Python: its loop keeps at least a quarter of the pace it has alone
    (with the GIL held through each call it would crawl, getting the GIL
    only between calls). A functional check with a wide margin, not a
    speed test: one core shared by both threads still gives about half."""
    rng = np.random.default_rng(15)
    n, hk, d = 32768, 4, 128
    pc_k = rng.standard_normal((2, 1, hk, n, d)).astype(np.float16)
    table = np.zeros((1, 1), np.int32)
    lens = np.array([n], np.int32)
    q = rng.standard_normal((1, 16, d)).astype(np.float32)
    hgca.dense_decode(q, pc_k, table, lens, threads=1)  # warm up

    def spin(seconds):
        end, k = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            k += 1
        return k

    alone = spin(0.2)
    stop = threading.Event()
    calls = [0]

    def work():
        while not stop.is_set():
            hgca.dense_decode(q, pc_k, table, lens, threads=1)
            calls[0] += 1

    th = threading.Thread(target=work)
    th.start()
    time.sleep(0.05)
    beside = spin(0.2)
    stop.set()
    th.join()
    print(f"python loop beside kernel calls: {beside / alone:.2f} of its pace alone ({calls[0]} calls)")
    assert calls[0] >= 3, "the kernel calls did not run"
    assert beside > 0.25 * alone, f"{beside} vs {alone} iterations: the GIL is held during kernel calls?"


# ------------------------------------------------------------------ bad input


def test_bad_input_is_a_clear_error():
    pc = PagedCache([20, 5], 2, 8, 16, seed=16)
    q = np.zeros((2, 4, 8), np.float32)
    sel = [[np.array([0, 1], np.int32)] * 2, [np.array([0], np.int32)] * 2]
    args = (pc.cache, pc.table, pc.seq_lens)
    cases = [
        (ValueError, "expected \\[batch, q_heads, head_dim\\]", lambda: hgca.dense_decode(q[0], *args)),
        (TypeError, "float32", lambda: hgca.dense_decode(q.astype(np.float64), *args)),
        (ValueError, "C-contiguous", lambda: hgca.dense_decode(np.zeros((2, 4, 16), np.float32)[:, :, ::2], *args)),
        (ValueError, "5 dimensions", lambda: hgca.dense_decode(q, pc.cache[0], pc.table, pc.seq_lens)),
        (TypeError, "float32 or float16", lambda: hgca.dense_decode(q, pc.cache.astype(np.float64), pc.table, pc.seq_lens)),
        (TypeError, "int32", lambda: hgca.dense_decode(q, pc.cache, pc.table.astype(np.float32), pc.seq_lens)),
        (ValueError, "block_table page", lambda: hgca.dense_decode(q, pc.cache, np.full_like(pc.table, pc.nb), pc.seq_lens)),
        (ValueError, "block_table page", lambda: hgca.dense_decode(q, pc.cache, np.full_like(pc.table, -1), pc.seq_lens)),
        (ValueError, "max_blocks", lambda: hgca.dense_decode(q, pc.cache, pc.table, np.array([20, 1000], np.int32))),
        (ValueError, "seq_lens", lambda: hgca.dense_decode(q, pc.cache, pc.table, np.array([20], np.int32))),
        (ValueError, "head_dim", lambda: hgca.dense_decode(np.zeros((2, 4, 4), np.float32), *args)),
        (ValueError, "scale is NaN", lambda: hgca.dense_decode(q, *args, scale=float("nan"))),
        (ValueError, "lse_base", lambda: hgca.dense_decode(q, *args, lse_base=10)),
        (ValueError, "lse_layout", lambda: hgca.dense_decode(q, *args, lse_layout="rows")),
        (ValueError, "layout=", lambda: hgca.dense_decode(q, *args, layout="paged")),
        (ValueError, "selected token", lambda: hgca.sparse_decode(q, *args, [[np.array([19], np.int32)] * 2, [np.array([5], np.int32)] * 2])),
        (ValueError, "negative index", lambda: hgca.sparse_decode(q, *args, [[np.array([-1], np.int32)] * 2, sel[1]])),
        (ValueError, "expected 2 sequences", lambda: hgca.sparse_decode(q, *args, sel[:1])),
        (ValueError, "expected 2 KV heads", lambda: hgca.sparse_decode(q, *args, [sel[0][:1], sel[1]])),
        (TypeError, "uint16", lambda: hgca.dense_decode(q, *args, dtype="bf16")),
        (ValueError, "shapes", lambda: hgca.merge_state(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.float32), np.zeros((2, 3, 4), np.float32), np.zeros((3, 2), np.float32))),
        (ValueError, "s expected shape", lambda: hgca.merge_state(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.float32), np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.float32), lse_layout="heads_tokens")),
        (ValueError, "beta", lambda: hgca.HybridAttention(4, 2, 8, beta=float("nan"))),
        (ValueError, "recovery", lambda: hgca.HybridAttention(4, 2, 8, recovery="magic")),
        (ValueError, "multiple", lambda: hgca.HybridAttention(5, 2, 8)),
        (ValueError, "mass target", lambda: hgca.select_by_mass(np.zeros((2, 2), np.float32), 16, 20, 0.0)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    layer = hgca.HybridAttention(4, 2, 8, window=16, block=4, dtype="f32")
    with pytest.raises(ValueError, match="heads \\* head_dim"):
        layer.forward(np.zeros((1, 4, 8), np.float32), np.zeros((1, 3, 8), np.float32), np.zeros((1, 3, 8), np.float32))
    assert len(layer) == 0


def test_hybrid_mass_selector():
    """The default rule is the mass selector: with target 1 it leaves out no
    entry of nonzero weight (full attention, against numpy), with a low
    target it attends fewer entries and reports its estimate."""
    rng = np.random.default_rng(21)
    qh, hk, d, n = 4, 2, 16, 120
    k = rng.standard_normal((n, hk, d)).astype(np.float32)
    v = rng.standard_normal((n, hk, d)).astype(np.float32)
    exact = hgca.HybridAttention(qh, hk, d, window=32, block=8, dtype="f32", threads=1, mass_target=1.0, mass_max_share=1.0)
    low = hgca.HybridAttention(qh, hk, d, window=32, block=8, dtype="f32", threads=1, recovery="mass", mass_target=0.5, mass_max_share=1.0)
    for layer in (exact, low):
        layer.forward(rng.standard_normal((n, qh, d)).astype(np.float32), k, v)
    q = (2.0 * rng.standard_normal((qh, d))).astype(np.float32)
    out = exact.attend(q)
    for h in range(qh):
        g = h // (qh // hk)
        want, _ = ref_attend(q[h], k[:, g], v[:, g], 1.0 / np.sqrt(d))
        np.testing.assert_allclose(out[h], want, rtol=1e-4, atol=1e-5)
    st = exact.stats()
    assert st["selected"] == hk * st["cpu_tokens"] and st["mass_estimated"] > 0.999, st
    low.attend(q)
    st = low.stats()
    assert 0 < st["selected"] < hk * st["cpu_tokens"], st
    assert 0.5 <= st["mass_estimated"] <= 1.0 and st["dense_heads"] == 0, st
    assert hgca.HybridAttention(qh, hk, d, recovery="bounds").stats()["mass_estimated"] is None
    with pytest.raises(ValueError, match="max page share"):
        hgca.HybridAttention(qh, hk, d, mass_max_share=0.0)


def test_version():
    assert hgca.__version__ == "0.1.0"
