"""Python call overhead over the Rust call: hgca.sparse_decode on one
sequence of 32k tokens (q 32 / kv 8 / d 128, f16, vLLM CPU layout, pages of
16 shuffled, 10% of the tokens selected per KV head), each call timed from
Python and, inside it, the Rust work (views built and the kernel, what a
Rust caller does: hgca._hgca._last_rust_seconds()). Prints the medians and
their ratio.

    .venv/py/bin/python hgca-py/bench_overhead.py [threads] [calls]
"""

import sys
import time

import numpy as np

import hgca
from hgca import _hgca


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    rng = np.random.default_rng(0)
    qh, hk, d, bs, n = 32, 8, 128, 16, 32 << 10
    nb = n // bs
    cache = rng.standard_normal((2, nb, hk, bs, d)).astype(np.float16)
    table = rng.permutation(nb).astype(np.int32)[None, :]
    lens = np.array([n], np.int32)
    q = rng.standard_normal((1, qh, d)).astype(np.float32)
    sel = [[np.sort(rng.choice(n, n // 10, replace=False)).astype(np.int32) for _ in range(hk)]]
    for _ in range(10):
        hgca.sparse_decode(q, cache, table, lens, sel, threads=threads)
    py, rust = [], []
    for _ in range(calls):
        t = time.perf_counter()
        hgca.sparse_decode(q, cache, table, lens, sel, threads=threads)
        py.append(time.perf_counter() - t)
        rust.append(_hgca._last_rust_seconds())
    mp, mr = float(np.median(py)), float(np.median(rust))
    gbs = (n // 10) * hk * d * 2 * 2 / mr / 1e9
    print(
        f"sparse decode, 32k tokens, 10% selected ({threads} thread(s), {calls} calls): "
        f"Rust {mr * 1e6:.1f} us ({gbs:.1f} GB/s), from Python {mp * 1e6:.1f} us; Python / Rust = {mp / mr:.3f}"
    )


if __name__ == "__main__":
    main()
