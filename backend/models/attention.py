"""Paged KV cache and the attention contexts a decoder forward runs under.

One `AttentionContext` per forward call: layers hand it post-RoPE q/k/v and get the attention output.
`PrefillContext` is causal over the new tokens of one or more sequences whose rows are concatenated
(ragged / varlen: block-diagonal causal, each sequence sees only its own earlier rows);
`PackedPrefillContext` is the same with the sequence boundaries on the device (CUDA graphs);
`DecodeContext` attends one token per row over that row's pages. All write K/V into the cache via `slot_mapping` (slot = page * page_size
+ offset, -1 = padding row). K/V stores and paged decode attention go through `q3tts.kernels`, which
dispatches to the Triton kernels on CUDA and to the torch references on CPU.
"""

from __future__ import annotations

import torch

from q3tts import kernels
from q3tts.kernels.reference import causal_attention_ref as causal_attention  # the prefill reference path


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


# fp32 score bytes one padded attention batch may hold (`PrefillContext` on CUDA): sequences are
# grouped so that group_size * max_len^2 * heads * 4 stays under it (a lone sequence always goes)
PADDED_SCORE_BYTES = 256 << 20


class PrefillContext(AttentionContext):
    """Causal attention over the N new rows of one or more sequences; K/V go to `slot_mapping [N]`.

    seq_lens (host ints, default: one sequence of N rows): the rows are the sequences' prompts back to
    back, each at positions 0..L_i-1; rows past sum(seq_lens) are padding (slot -1, output 0).
    Attention is block-diagonal causal. `padded` picks the implementation for several sequences:
    False = `causal_attention` per sequence on slices of the one q/k/v (each sequence's arithmetic is
    exactly its single-sequence prefill: the CPU default); True = one batched attention per group of
    sequences padded to the group's longest (a few launches per layer whatever the count: the CUDA
    default, except under `kernels.batch_invariant()`: a row's result must not depend on the other
    prompts; equal to the loop up to floating-point rounding).
    prefixes (chunked prefill): per sequence None, or the cache slots [P_i] of its P_i earlier prompt
    rows already in the cache; its rows are then a piece at positions P_i.. that also attends to those
    keys (read from the cache: a sequence with a prefix always takes the per-sequence loop).
    """

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, scale: float,
                 seq_lens: list[int] | None = None, padded: bool | None = None,
                 prefixes: list[torch.Tensor | None] | None = None):
        super().__init__(cache, slot_mapping)
        self.scale = scale
        self.seq_lens = None if seq_lens is None else [int(n) for n in seq_lens]
        self.prefixes = prefixes if prefixes is not None and any(p is not None for p in prefixes) else None
        assert self.prefixes is None or len(self.prefixes) == len(self.seq_lens), "one prefix per sequence"
        default = slot_mapping.device.type == "cuda" and not kernels.batch_invariant()
        self.padded = (default if padded is None else padded) and not self.prefixes
        self._groups: list[_PaddedGroup] | None = None  # built on first use, shared by all layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._store(layer, k, v)
        lens = self.seq_lens
        if self.prefixes is None and (lens is None or (len(lens) == 1 and lens[0] == q.shape[0])):
            return causal_attention(q, k, v, self.scale)
        if self.padded:
            return self._attend_padded(q, k, v)
        parts, start = [], 0
        for i, n in enumerate(lens):
            rows = slice(start, start + n)
            keys, values = self._with_prefix(layer, i, k[rows], v[rows])
            parts.append(causal_attention(q[rows], keys, values, self.scale))
            start += n
        if start < q.shape[0]:
            parts.append(q.new_zeros((q.shape[0] - start, *q.shape[1:])))
        return torch.cat(parts)

    def _with_prefix(self, layer: int, i: int, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's keys / values [n, KVH, D] behind those of its earlier rows in the cache:
        [P_i + n, KVH, D] (unchanged without a prefix)."""
        prefix = None if self.prefixes is None else self.prefixes[i]
        if prefix is None:
            return k, v
        flat_k = self.cache.k[layer].flatten(0, 1)  # [pages * page_size, KVH, D]
        flat_v = self.cache.v[layer].flatten(0, 1)
        return torch.cat((flat_k[prefix], k)), torch.cat((flat_v[prefix], v))

    def _attend_padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._groups is None:
            self._groups = _padded_groups(self.seq_lens, q.shape[1], q.device)
        out = q.new_zeros(q.shape)
        for g in self._groups:
            res = padded_causal_attention(q, k, v, g.index, g.allowed, self.scale)  # [G*Lm, NH, D]
            out.index_copy_(0, g.dst, res.index_select(0, g.src))
        return out


class _PaddedGroup:
    """index [G, Lm] rows of the group's sequences (padding -> the sequence's first row);
    allowed [G, 1, Lm, Lm] bool (causal within the sequence's length); src [n] positions in the
    flattened [G*Lm] result of the real rows, dst [n] their rows in the concatenated batch."""

    def __init__(self, starts: list[int], lens: list[int], device: torch.device):
        lm = max(lens)
        j = torch.arange(lm)
        start_t, len_t = torch.tensor(starts), torch.tensor(lens)
        valid = j[None, :] < len_t[:, None]  # [G, Lm]
        self.index = torch.where(valid, start_t[:, None] + j[None, :], start_t[:, None]).to(device)
        causal = j[None, :] <= j[:, None]  # [Lm(query), Lm(key)]
        self.allowed = (causal[None] & valid[:, None, :])[:, None].to(device)
        flat = torch.arange(len(lens) * lm).view(len(lens), lm)
        self.src = flat[valid].to(device)
        self.dst = (start_t[:, None] + j[None, :])[valid].to(device)


def _padded_groups(lens: list[int], num_heads: int, device: torch.device) -> list[_PaddedGroup]:
    """Consecutive sequences grouped under PADDED_SCORE_BYTES of fp32 scores per group."""
    groups, starts, cur, cur_max, pos = [], [], [], 0, 0
    for n in lens:
        m = max(cur_max, n)
        if cur and (len(cur) + 1) * m * m * num_heads * 4 > PADDED_SCORE_BYTES:
            groups.append(_PaddedGroup(starts, cur, device))
            starts, cur, m = [], [], n
        starts.append(pos)
        cur.append(n)
        cur_max = m
        pos += n
    if cur:
        groups.append(_PaddedGroup(starts, cur, device))
    return groups


def padded_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                            allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """`causal_attention` of G sequences at once, each padded to Lm rows.

    q [N, NH, D], k/v [N, KVH, D]; index [G, Lm] rows of each sequence; allowed [G, 1, Lm, Lm].
    Returns [G*Lm, NH, D] (padding rows hold junk). Same math as `causal_attention` (fp32 softmax,
    probabilities in the input dtype); masked keys get probability 0.
    """
    g, lm = index.shape
    num_heads = q.shape[1]
    group = num_heads // k.shape[1]
    qb = q[index].transpose(1, 2)  # [G, NH, Lm, D]
    keys = k[index].repeat_interleave(group, dim=2).transpose(1, 2)  # [G, NH, Lm, D]
    values = v[index].repeat_interleave(group, dim=2).transpose(1, 2)  # [G, NH, Lm, D]
    scores = torch.matmul(qb, keys.transpose(2, 3)) * scale  # [G, NH, Lm, Lm]
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).transpose(1, 2).reshape(g * lm, num_heads, -1)


class PackedPrefillContext(AttentionContext):
    """`PrefillContext` with the sequence boundaries on the device (for CUDA graphs): cu_seqlens [S+1]
    (sequence i = rows cu[i]..cu[i+1]-1, at positions 0..); rows >= cu[S] are padding (slot -1, output
    rows junk). No host value, so one capture serves every mix of sequences of a row count.
    prefix_table [max_pages], prefix_len [1] (chunked prefill, optional): sequence 0 is a piece after
    the prefix_len rows of its prompt in the pages prefix_table lists (0: a whole prompt).
    Attention is `kernels.prefill_attention` (the torch reference on CPU)."""

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, cu_seqlens: torch.Tensor,
                 scale: float, prefix_table: torch.Tensor | None = None, prefix_len: torch.Tensor | None = None):
        super().__init__(cache, slot_mapping)
        self.cu_seqlens = cu_seqlens
        self.scale = scale
        self.prefix_table, self.prefix_len = prefix_table, prefix_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._store(layer, k, v)
        prefix = None if self.prefix_table is None else kernels.PagedPrefix(
            self.cache.k[layer], self.cache.v[layer], self.prefix_table, self.prefix_len)
        return kernels.prefill_attention(q, k, v, self.cu_seqlens, self.scale, prefix)


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
