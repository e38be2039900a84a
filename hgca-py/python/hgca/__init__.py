"""hgca: hybrid GPU-CPU attention kernels, from Python.

LSE CONVENTION — READ THIS FIRST
================================
Every function here that reads or writes a log-sum-exp takes two keywords:

* ``lse_base``: ``2`` (the DEFAULT, FlashInfer's convention) or ``"e"``
  (natural log: vLLM's ``merge_attn_states`` and its attention outputs);
* ``lse_layout``: ``"tokens_heads"`` (the DEFAULT, FlashInfer's ``[seq, heads]``)
  or ``"heads_tokens"`` (vLLM's ``[heads, tokens]``).

The defaults are FlashInfer's because the merge functions carry FlashInfer's
names (``merge_state``, ``merge_state_in_place``, ``merge_states``) and
shapes: a drop-in replacement must mean the same numbers. Nothing is ever
inferred; mixing bases is the most common real bug in this area. The empty
partial is ``(v = 0, s = -inf)``; ``+inf`` (FlashAttention-2's empty rows)
is read as empty; NaN in gives NaN out.

Arrays
------
numpy arrays, read in place (no copy) when C-contiguous; anything else is a
``ValueError`` naming the argument (``numpy.ascontiguousarray`` fixes it).
KV caches are float32 or float16; bfloat16 is passed as its ``uint16`` bits
with ``dtype="bf16"`` (numpy has no bfloat16). Block tables and sequence
lengths are int32 (vLLM's and FlashInfer's). A torch CPU tensor passes with
no copy through ``tensor.numpy()`` (bf16: ``tensor.view(torch.int16).numpy()
.view(numpy.uint16)``). The GIL is released around every kernel call, so
Python threads run kernels side by side.

Caches (``layout=``)
--------------------
``"vllm_cpu"``   one array ``(2, num_blocks, kv_heads, block_size, head_size)``
``"vllm_flash"`` one array ``(2, num_blocks, block_size, kv_heads, head_size)``
``"nhd"``        FlashInfer NHD: ``[pages, 2, page_size, kv_heads, d]`` or a tuple
                 ``(k, v)`` of ``[pages, page_size, kv_heads, d]``
``"hnd"``        FlashInfer HND: ``[pages, 2, kv_heads, page_size, d]`` or a tuple
                 ``(k, v)`` of ``[pages, kv_heads, page_size, d]``

``threads=``: 0 (default) runs a call on all cores, 1 on the calling thread
(for a server that runs one call per Python thread).
"""

from ._hgca import (
    HybridAttention,
    KeyBounds,
    __version__,
    append_attention,
    dense_decode,
    merge_state,
    merge_state_in_place,
    merge_states,
    select_by_mass,
    select_top_pages,
    sparse_decode,
)

__all__ = [
    "HybridAttention",
    "KeyBounds",
    "__version__",
    "append_attention",
    "dense_decode",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "select_by_mass",
    "select_top_pages",
    "sparse_decode",
]
