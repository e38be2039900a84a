"""Type stubs of hgca's native module (see hgca's docstring for the conventions)."""

from typing import List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

__version__: str

LseBase = Union[Literal[2], Literal["2"], Literal["e"]]
LseLayout = Literal["tokens_heads", "heads_tokens"]
Layout = Literal["vllm_cpu", "vllm_flash", "nhd", "hnd"]
KvDType = Optional[Literal["f32", "f16", "bf16"]]
F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
Cache = Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]
Selection = Sequence[Sequence[npt.ArrayLike]]

def merge_state(
    v_a: F32, s_a: F32, v_b: F32, s_b: F32, *, lse_base: LseBase = 2, lse_layout: LseLayout = "tokens_heads"
) -> Tuple[F32, F32]:
    """Merges two partials ``v [seq, heads, d]``, ``s [seq, heads]`` (FlashInfer's); returns ``(v, s)``."""

def merge_state_in_place(
    v: F32, s: F32, v_other: F32, s_other: F32, *, lse_base: LseBase = 2, lse_layout: LseLayout = "tokens_heads"
) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))``, writing into ``v`` and ``s``."""

def merge_states(v: F32, s: F32, *, lse_base: LseBase = 2, lse_layout: LseLayout = "tokens_heads") -> Tuple[F32, F32]:
    """Merges ``v [seq, num_states, heads, d]``, ``s [seq, num_states, heads]``; returns ``v [seq, heads, d]``, ``s [seq, heads]``."""

def sparse_decode(
    q: F32,
    kv_cache: Cache,
    block_table: I32,
    seq_lens: I32,
    selection: Selection,
    *,
    layout: Layout = "vllm_cpu",
    dtype: KvDType = None,
    scale: Optional[float] = None,
    lse_base: LseBase = 2,
    lse_layout: LseLayout = "tokens_heads",
    return_weights: bool = False,
    threads: int = 0,
) -> Union[Tuple[F32, F32], Tuple[F32, F32, F32]]:
    """Batched decode: ``q [batch, q_heads, d]``, sequence ``b`` attending ``selection[b][g]`` of KV head ``g``.

    Returns ``out [batch, q_heads, d]``, ``lse`` (``[batch, q_heads]`` or ``[q_heads, batch]``) and,
    with ``return_weights``, the softmax weights of the attended entries (per sequence, per KV head
    ``g`` a ``[group, len(selection[b][g])]`` block)."""

def dense_decode(
    q: F32,
    kv_cache: Cache,
    block_table: I32,
    seq_lens: I32,
    *,
    layout: Layout = "vllm_cpu",
    dtype: KvDType = None,
    scale: Optional[float] = None,
    lse_base: LseBase = 2,
    lse_layout: LseLayout = "tokens_heads",
    return_weights: bool = False,
    threads: int = 0,
) -> Union[Tuple[F32, F32], Tuple[F32, F32, F32]]:
    """Batched decode over every token of each sequence (weights ``[q_heads, seq_len]`` per sequence)."""

def append_attention(
    q: F32,
    kv_cache: Cache,
    block_table: I32,
    seq_len: int,
    *,
    visible0: Optional[int] = None,
    layout: Layout = "vllm_cpu",
    dtype: KvDType = None,
    scale: Optional[float] = None,
    lse_base: LseBase = 2,
    lse_layout: LseLayout = "tokens_heads",
    threads: int = 0,
) -> Tuple[F32, F32]:
    """Causal append of one sequence (pages ``block_table [num_pages]``): query ``i`` of ``q [n_q, q_heads, d]``
    sees tokens ``0 .. visible0 + i`` (default ``visible0 = seq_len - n_q + 1``: the chunk's own K/V are last)."""

class KeyBounds:
    """Quest-style key bounds per page and KV head of one cache pool, updated as pages fill."""

    def __init__(self, kv_cache: Cache, *, layout: Layout = "vllm_cpu", dtype: KvDType = None) -> None: ...
    def update(self, kv_cache: Cache, block_table: I32, seq_lens: I32, seq: int, *, dtype: KvDType = None) -> None:
        """Brings the bounds of sequence ``seq``'s pages up to its tokens (only new tokens are read)."""
    def reset(self, page: int) -> None:
        """Forgets a page's bounds: call it when the engine gives the page to another sequence."""
    def upper_bounds(
        self,
        q: F32,
        kv_cache: Cache,
        block_table: I32,
        seq_lens: I32,
        seq: int,
        *,
        dtype: KvDType = None,
        scale: Optional[float] = None,
        threads: int = 0,
    ) -> F32:
        """Upper bounds ``[kv_heads, pages]`` of the scores of ``q [q_heads, d]`` on each page of sequence ``seq``."""

def select_top_pages(ub: F32, block_size: int, seq_len: int, k: int) -> List[I32]:
    """Every token of each KV head's ``k`` pages of highest bound, in token order (one array per KV head)."""

def select_by_mass(
    ub: F32, block_size: int, seq_len: int, target: float, *, max_share: float = 1.0
) -> Tuple[List[I32], List[dict]]:
    """Pages by estimated attention mass until ``target``; a head needing more than ``max_share`` of its pages
    takes all of them (``report[g]["dense"]``). Returns ``(selection, report)``."""

class HybridAttention:
    """The hybrid attention layer of one sequence: a dense window (here on the CPU too) and a CPU store
    attended sparsely by MAW selection, merged exactly."""

    def __init__(
        self,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        window: int = 1024,
        block: int = 64,
        sinks: int = 4,
        beta: float = 1.0,
        alpha: float = 0.9,
        recovery: Literal["frozen", "rescore", "bounds", "mass"] = "mass",
        recovery_param: int = 32,
        mass_target: float = 0.93,
        mass_max_share: float = 0.5,
        refresh_queries: int = 1,
        dtype: Literal["f32", "f16", "bf16"] = "f16",
        threads: int = 0,
    ) -> None: ...
    def forward(self, q: F32, k: F32, v: F32) -> F32:
        """``n`` tokens: ``q [n, q_heads, d]``, ``k``/``v`` ``[n, kv_heads, d]``; returns ``out [n, q_heads, d]``."""
    def append(self, k: F32, v: F32) -> None:
        """Appends tokens without attending."""
    def attend(self, q: F32) -> F32:
        """One decode query ``q [q_heads, d]`` over every token held; returns ``out [q_heads, d]``."""
    def stats(self) -> dict:
        """The last step: window_tokens, cpu_tokens, selected, full_cpu, dense_s, sparse_s, merge_s, total_s,
        mass_estimated (the mass selector's estimate of the attended share, or None), dense_heads."""
    def __len__(self) -> int: ...
