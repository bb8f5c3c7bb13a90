"""Paged KV cache and the attention contexts a decoder forward runs under.

One `AttentionContext` per forward call: layers hand it post-RoPE q/k/v and get the attention output.
`PrefillContext` is causal over the new tokens of one sequence; `DecodeContext` attends one token per
row over that row's pages. Both write K/V into the cache via `slot_mapping` (slot = page * page_size
+ offset, -1 = padding row). K/V stores and paged decode attention go through `q3tts.kernels`, which
dispatches to the Triton kernels on CUDA and to the torch references on CPU.
"""

from __future__ import annotations

import torch

from q3tts import kernels


class PagedKVCache:
    """K/V storage for all layers: `k, v: [num_layers, num_pages, page_size, KVH, D]`."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        # zeros, not empty: masked slots must stay finite (0 * NaN would poison the output)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]


class AttentionContext:
    """Per-forward attention metadata; `attend(layer, q, k, v) -> out` ([N, NH, D])."""

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor):
        self.cache = cache
        self.slot_mapping = slot_mapping

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kernels.store_kv(k, v, self.cache.k[layer], self.cache.v[layer], self.slot_mapping)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal GQA attention over one sequence's tokens (the prefill reference path).

    q: [N, NH, D]; k, v: [N, KVH, D] -> [N, NH, D]. Softmax in fp32, probabilities cast back to the
    input dtype before the value product (as the official eager attention).
    """
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    keys = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [NH, N, D]
    values = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [NH, N, D]
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale  # [NH, N, N]
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1)  # [N, NH, D]


class PrefillContext(AttentionContext):
    """Causal attention over the N new tokens of one sequence; K/V go to `slot_mapping [N]`."""

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, scale: float):
        super().__init__(cache, slot_mapping)
        self.scale = scale

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._store(layer, k, v)
        return causal_attention(q, k, v, self.scale)


class DecodeContext(AttentionContext):
    """One new token per row attending over its pages.

    slot_mapping [B] (-1 = padding row), block_tables [B, max_pages] page ids, context_lens [B]
    (keys visible including the new one).
    """

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float):
        super().__init__(cache, slot_mapping)
        self.block_tables = block_tables
        self.context_lens = context_lens
        self.scale = scale

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._store(layer, k, v)
        return kernels.paged_decode_attention(q, self.cache.k[layer], self.cache.v[layer],
                                              self.block_tables, self.context_lens, self.scale)
