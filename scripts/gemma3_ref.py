#!/usr/bin/env python3
"""An independent Gemma 3 forward pass in numpy, from a GGUF file.

    gemma3_ref.py MODEL.gguf IDS OUT.npy

IDS is a comma-separated list of token ids. Writes the logits of every
position, float32 [len(IDS), vocab], to OUT.npy. Weights are dequantised
with gguf-py (PyPI `gguf`), everything else is written out here from the
model's published definition, not from hgca-llm's code: embeddings scaled
by sqrt(dim); per layer an RMS norm, Q/K/V projections, RMS norms of each
query and key head, rotary embeddings on the two halves of a head (base
10000 on local layers, `rope.freq_base` on global ones; a layer is global
when its index is 5 mod 6), attention with scale 1/sqrt(head_dim), causal,
and on local layers only keys less than `attention.sliding_window`
positions back; the output projection and an RMS norm before the residual
add; then an RMS norm, the GELU(tanh)-gated FFN and an RMS norm before the
second residual add. GGUF holds the norms' weights with Gemma's `1 +`
already added. Computed in float64.
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    path, ids, out = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3]
    r = GGUFReader(path)

    def meta(key, default=None):
        f = r.fields.get(key)
        if f is None:
            if default is None:
                raise KeyError(key)
            return default
        return f.contents()

    assert meta("general.architecture") == "gemma3"
    a = "gemma3."
    dim = int(meta(a + "embedding_length"))
    n_layers = int(meta(a + "block_count"))
    n_heads = int(meta(a + "attention.head_count"))
    n_kv = int(meta(a + "attention.head_count_kv"))
    hd = int(meta(a + "attention.key_length"))
    eps = float(meta(a + "attention.layer_norm_rms_epsilon"))
    base_global = float(meta(a + "rope.freq_base"))
    window = int(meta(a + "attention.sliding_window"))

    tensors = {t.name: t for t in r.tensors}

    def w(name):
        t = tensors[name]
        x = dequantize(t.data, t.tensor_type).astype(np.float64)
        # GGUF's shape is [ne0, ne1], ne0 the contiguous (input) dimension:
        # reversed, a matrix is [out, in].
        return x.reshape([int(d) for d in reversed(t.shape)])

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def rope(x, pos, base):
        # x: [n, heads, hd]; rotate (x[i], x[i + hd/2]).
        half = hd // 2
        inv = base ** (-2.0 * np.arange(half) / hd)
        ang = pos[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a_, b_ = x[..., :half], x[..., half:]
        return np.concatenate([a_ * c - b_ * s, a_ * s + b_ * c], axis=-1)

    def gelu(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    n = len(ids)
    emb = w("token_embd.weight")
    x = emb[ids] * np.sqrt(dim)
    pos = np.arange(n, dtype=np.float64)
    group = n_heads // n_kv
    for il in range(n_layers):
        p = f"blk.{il}."
        local = il % 6 < 5
        h = rms(x, w(p + "attn_norm.weight"))
        q = (h @ w(p + "attn_q.weight").T).reshape(n, n_heads, hd)
        k = (h @ w(p + "attn_k.weight").T).reshape(n, n_kv, hd)
        v = (h @ w(p + "attn_v.weight").T).reshape(n, n_kv, hd)
        q = rms(q, w(p + "attn_q_norm.weight"))
        k = rms(k, w(p + "attn_k_norm.weight"))
        base = 10000.0 if local else base_global
        q, k = rope(q, pos, base), rope(k, pos, base)
        qi, kj = np.arange(n)[:, None], np.arange(n)[None, :]
        visible = kj <= qi
        if local:
            visible &= (qi - kj) < window
        att = np.zeros((n, n_heads, hd))
        for hh in range(n_heads):
            g = hh // group
            s = (q[:, hh, :] @ k[:, g, :].T) / np.sqrt(hd)
            s = np.where(visible, s, -np.inf)
            s = s - s.max(axis=1, keepdims=True)
            e = np.exp(s)
            att[:, hh, :] = (e / e.sum(axis=1, keepdims=True)) @ v[:, g, :]
        o = att.reshape(n, n_heads * hd) @ w(p + "attn_output.weight").T
        x = x + rms(o, w(p + "post_attention_norm.weight"))
        h = rms(x, w(p + "ffn_norm.weight"))
        f = gelu(h @ w(p + "ffn_gate.weight").T) * (h @ w(p + "ffn_up.weight").T)
        f = f @ w(p + "ffn_down.weight").T
        x = x + rms(f, w(p + "post_ffw_norm.weight"))
    x = rms(x, w("output_norm.weight"))
    head = w("output.weight") if "output.weight" in tensors else emb
    np.save(out, (x @ head.T).astype(np.float32))


if __name__ == "__main__":
    main()
