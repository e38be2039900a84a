#!/usr/bin/env python3
"""Offline study of the mass selector's key estimates on a real model's keys.

Reads the keys and last queries that `cargo run --release -p hgca-llm
--example qk_trace -- MODEL TEXT TOKENS LAST DIR` writes, and for every
layer, KV head and every 8th recorded query, with the window the last
RATIO of the tokens and the first 4 entries sinks, admits CPU entries in
decreasing estimated weight until the estimated share left out is at
most 1 - P (as the selector does, the normaliser taken as exact) and
prints, per estimate, the entries admitted, the exact mass they miss
(mean, 95th percentile), the share of head-steps that would fall back to
dense (over half the entries admitted) and the estimate's error.

Estimates: exact scores; int8 codes per row (hgca's `KeyCodes::Int8`);
int4 codes of whitened keys (`KeyCodes::Int4`), the whitening measured on
all CPU rows or on the first CALIB of them, with admission margins of 0,
0.5 and 2 rounding sigmas; and, for a cheaper copy, the same whitened keys
in 3-bit codes (-3..3) and 2-bit codes (four levels, +-0.5 and +-1.5 steps),
with margins of 0, 0.25 (3-bit only) and 0.5 sigma. The bytes column is
what each copy reads per entry and step (codes and an f32 scale per row)
against the f16 K and V rows full attention reads.

usage: selector_study.py DIR TOKENS [RATIO] [CALIB] [TARGET]   (numpy; TARGET 0.9)
"""
import sys

import numpy as np


def quant(x, levels):
    s = np.abs(x).max(1, keepdims=True) / levels
    s[s == 0] = 1
    return np.round(x / s) * s, s[:, 0]


def quant2(x):
    """Four levels per row, +-0.5 and +-1.5 steps (no zero): the step is a
    third of the row's largest magnitude, so the outer levels reach it."""
    s = np.abs(x).max(1, keepdims=True) / 1.5
    s[s == 0] = 1
    return (np.clip(np.floor(x / s), -2, 1) + 0.5) * s, s[:, 0]


def admit(est, w_true, target, margin):
    """Admits by estimated weight until the estimated omitted mass is at
    most 1 - target; returns (share admitted, exact mass missed)."""
    w = np.exp(est)
    o = np.argsort(-w)
    tail = np.append(np.cumsum(w[o][::-1])[::-1], 0.0)
    k = int(np.argmax(tail <= 1 - target))
    thr = est[o[k - 1]] if k else np.inf
    adm = est + margin >= thr
    return adm.mean(), w_true[~adm].sum()


def main():
    d_dir, n_tok = sys.argv[1], int(sys.argv[2])
    ratio = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
    calib = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    target = float(sys.argv[5]) if len(sys.argv) > 5 else 0.9
    ncpu, sinks = n_tok - int(n_tok * ratio), 4
    res, err = {}, {"int8": [], "int4": [], "int3": [], "int2": []}
    for line in open(f"{d_dir}/meta.txt"):
        l, qh, kvh, d, sc = line.split()
        l, qh, kvh, d, sc = int(l), int(qh), int(kvh), int(d), float(sc)
        k_all = np.fromfile(f"{d_dir}/k{l}.f32", np.float32).reshape(n_tok, kvh, d)
        q_all = np.fromfile(f"{d_dir}/q{l}.f32", np.float32).reshape(-1, qh, d)
        nq, g = q_all.shape[0], qh // kvh
        for h in range(kvh):
            kh = k_all[:, h].astype(np.float64)
            kc = kh[sinks:ncpu]
            cal = kc[:calib] if calib else kc
            c, gain = cal.mean(0), cal.std(0)
            gain = np.maximum(gain, gain.max() / 100)
            k8, _ = quant(kc, 127)
            white = (kc - c) / gain
            k4, s4 = quant(white, 7)
            k3, s3 = quant(white, 3)
            k2, s2 = quant2(white)
            for qi in range(0, nq, 8):
                pos = n_tok - nq + qi
                q = q_all[qi, h * g:(h + 1) * g].astype(np.float64)
                s = sc * q @ kh[:pos + 1].T
                m = s.max(1, keepdims=True)
                lse = (np.log(np.exp(s - m).sum(1, keepdims=True)) + m)[:, 0]
                ex = (s[:, sinks:ncpu] - lse[:, None]).max(0)
                w_true = np.exp(ex)
                e8 = (sc * q @ k8.T - lse[:, None]).max(0)
                qw = sc * q * gain
                base = (sc * q @ c)[:, None] - lse[:, None]
                e4, e3, e2 = ((qw @ k.T + base).max(0) for k in (k4, k3, k2))
                # A row's rounding sigma per unit of its scale.
                qn = np.sqrt((qw ** 2).sum(1)).max() / np.sqrt(12)
                rows = {
                    "exact": admit(ex, w_true, target, 0),
                    "int8": admit(e8, w_true, target, 0),
                    "int4": admit(e4, w_true, target, 0),
                    "int4 +0.5 sigma": admit(e4, w_true, target, 0.5 * s4 * qn),
                    "int4 +2 sigma": admit(e4, w_true, target, 2 * s4 * qn),
                    "int3": admit(e3, w_true, target, 0),
                    "int3 +0.25 sigma": admit(e3, w_true, target, 0.25 * s3 * qn),
                    "int3 +0.5 sigma": admit(e3, w_true, target, 0.5 * s3 * qn),
                    "int2": admit(e2, w_true, target, 0),
                    "int2 +0.5 sigma": admit(e2, w_true, target, 0.5 * s2 * qn),
                }
                for key, v in rows.items():
                    res.setdefault(key, []).append(v)
                err["int8"].append(np.std(e8 - ex))
                err["int4"].append(np.std(e4 - ex))
                err["int3"].append(np.std(e3 - ex))
                err["int2"].append(np.std(e2 - ex))
    what = f"all {ncpu - sinks} CPU rows" if not calib else f"the first {calib} CPU rows"
    print(f"{d_dir}: {n_tok} tokens, window ratio {ratio}, target {target}, "
          f"int4 whitening from {what}")
    # Bytes each estimate reads per entry and step, against an f16 K and V
    # row (4 d bytes; d of the last layer read, the same in every layer of
    # these models): the exact scores read the f16 key row.
    copy = {"exact": 2 * d, "int8": d + 4, "int4": d / 2 + 4, "int3": 3 * d / 8 + 4,
            "int2": d / 4 + 4}
    print(f"{'estimate':18s} {'admitted':>9s} {'missed':>8s} {'p95':>7s} {'dense':>7s} "
          f"{'copy bytes':>10s}")
    for key, v in res.items():
        v = np.array(v)
        b = copy[key.split()[0]] / (4 * d)
        print(f"{key:18s} {v[:, 0].mean() * 100:8.1f}% {v[:, 1].mean() * 100:7.2f}% "
              f"{np.percentile(v[:, 1], 95) * 100:6.2f}% {(v[:, 0] > 0.5).mean() * 100:6.1f}% "
              f"{b * 100:9.1f}%")
    for key, v in err.items():
        print(f"{key} estimate error (std over entries, in nats): median {np.median(v):.3f}")


if __name__ == "__main__":
    main()
