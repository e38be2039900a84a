"""An engine-like decode loop with hgca from Python.

A batch of sequences keeps its KV cache in vLLM's CPU layout
(2, num_blocks, kv_heads, block_size, head_size), float16, pages handed out
in a shuffled order. Each decode step, per sequence: the newest tokens (the
"GPU window") are attended densely, standing in for the GPU's partial (here
by hgca.dense_decode over those pages, base-2 LSE as FlashInfer writes it);
the older pages are ranked by their key bounds (hgca.KeyBounds, updated as
pages fill) and the best ones attended on the CPU by hgca.sparse_decode;
hgca.merge_state combines the two partials exactly. Prints one progress
line per step with the selected share and the error against full attention.

    python examples/python/engine_decode.py [--steps N] [--batch B] [--context T]
"""

import argparse
import math
import sys
import time

import numpy as np

import hgca


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--top-pages", type=int, default=64)
    a = ap.parse_args()

    rng = np.random.default_rng(0)
    qh, hk, d, bs = 32, 8, 128, 16
    lens = [a.context // (b + 1) + 17 * b for b in range(a.batch)]
    max_len = max(lens) + a.steps
    pages_per_seq = [-(-(n + a.steps) // bs) for n in lens]
    nb = sum(pages_per_seq) + 8
    order = rng.permutation(nb).astype(np.int32)
    table = np.zeros((a.batch, -(-max_len // bs)), np.int32)
    at = 0
    for b, p in enumerate(pages_per_seq):
        table[b, :p] = order[at:at + p]
        at += p
    cache = np.zeros((2, nb, hk, bs, d), np.float16)
    # A context of topics, each a run of 256 tokens whose keys share a
    # direction; each step's query asks about one topic, so its attention is
    # sparse and lies in a few runs of pages (as a real model's on a
    # document that changes subject).
    topics = rng.standard_normal((hk, 8, d)).astype(np.float32)

    def token(b, j):
        t = topics[:, (j // 256 + b) % 8] * 0.5 + rng.standard_normal((hk, d)).astype(np.float32) * 0.5
        return t, rng.standard_normal((hk, d)).astype(np.float32)

    def put(b, j, k, v):
        p, i = table[b, j // bs], j % bs
        cache[0, p, :, i] = k
        cache[1, p, :, i] = v

    for b, n in enumerate(lens):
        for j in range(n):
            put(b, j, *token(b, j))
    bounds = hgca.KeyBounds(cache)
    scale = 1 / math.sqrt(d)
    for step in range(a.steps):
        t0 = time.perf_counter()
        for b in range(a.batch):
            put(b, lens[b], *token(b, lens[b]))
            lens[b] += 1
        seq_lens = np.array(lens, np.int32)
        q = (topics[np.arange(hk).repeat(qh // hk), (step % 8)] + rng.standard_normal((qh, d)) * 0.3)
        q = np.ascontiguousarray(np.broadcast_to(q, (a.batch, qh, d)), dtype=np.float32)
        # The "GPU" partial: the window's pages, dense (a table of just those pages).
        old = [max(n - a.window, 0) for n in lens]
        first_page = [o // bs for o in old]
        # Window starts on a page boundary: the CPU side owns tokens before it.
        old = [p * bs for p in first_page]
        win_table = np.zeros_like(table)
        for b in range(a.batch):
            rest = table[b, first_page[b]:]
            win_table[b, : len(rest)] = rest
        win_lens = np.array([n - o for n, o in zip(lens, old)], np.int32)
        gpu_v, gpu_s = hgca.dense_decode(q, cache, win_table, win_lens)  # base 2, FlashInfer's
        # The CPU side: the best older pages by their key bounds.
        sel = []
        for b in range(a.batch):
            bounds.update(cache, table, seq_lens, b)
            ub = bounds.upper_bounds(q[b], cache, table, seq_lens, b)
            older = np.ascontiguousarray(ub[:, : first_page[b]])
            top = hgca.select_top_pages(older, bs, old[b], a.top_pages) if old[b] else [np.zeros(0, np.int32)] * hk
            sel.append(top)
        cpu_v, cpu_s = hgca.sparse_decode(q, cache, table, seq_lens, sel)
        out, lse = hgca.merge_state(cpu_v, cpu_s, gpu_v, gpu_s)
        # Against full attention (the yardstick), and the attention mass the selection kept.
        full, full_s = hgca.dense_decode(q, cache, table, seq_lens)
        err = float(np.abs(out - full).max())
        kept = float(np.mean(np.exp2(lse - full_s)))
        share = sum(sum(len(s) for s in sb) for sb in sel) / max(1, sum(o * hk for o in old))
        sys.stdout.write(
            f"step {step + 1:3d}/{a.steps}: {a.batch} sequences, {sum(lens)} tokens, "
            f"{100 * share:5.1f}% of older entries selected, mass kept {100 * kept:6.2f}%, "
            f"max |out - full| {err:.3e}, step {1e3 * (time.perf_counter() - t0):.1f} ms (with the full yardstick)\n"
        )
    assert np.isfinite(out).all()


if __name__ == "__main__":
    main()
