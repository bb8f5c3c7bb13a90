"""Code predictor ("sub-talker", spec c): codes c1..c15 of a frame from the talker's hidden and c0.

Per frame it runs a fresh 16-position causal pass: step 0 feeds `[past_hidden, C(c0)]` at positions
0, 1, then step j = 1..14 feeds `codec_embedding[j-1](c_j)` at position j+1; head `lm_head[j]` draws
`c_{j+1}`. The KV lives in a private `PagedKVCache` with one 16-slot page per batch row, so every
step has a static shape (capturable in a CUDA graph); stale slots of earlier frames are masked out
by `context_lens`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from q3tts import kernels
from q3tts.config import TalkerConfig
from q3tts.models.attention import DecodeContext, PagedKVCache
from q3tts.models.layers import DecoderStack, Linear
from q3tts.models.sampling import SubtalkerSampler

if TYPE_CHECKING:
    from q3tts.models.code_predictor_fused import FusedCodePredictor


class CodePredictorModel(DecoderStack):
    """`talker.code_predictor.model`: decoder stack + 15 input tables of talker width."""

    def __init__(self, cfg: TalkerConfig):
        # one pass covers positions 0..num_code_groups-1 (past_hidden, c0, c1..c14)
        super().__init__(cfg.code_predictor, max_positions=cfg.num_code_groups)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.codebook_size, cfg.hidden_size) for _ in range(cfg.num_code_groups - 1))


class CodePredictor(nn.Module):
    """`talker.code_predictor`: projection, stack and the 15 heads (names = released keys)."""

    def __init__(self, cfg: TalkerConfig, embed_c0: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        cp = cfg.code_predictor
        self.num_groups = cfg.num_code_groups
        self.model = CodePredictorModel(cfg)
        self.lm_head = nn.ModuleList(Linear(cp.hidden_size, cfg.codebook_size, bias=False)
                                     for _ in range(self.num_groups - 1))
        same_width = cp.hidden_size == cfg.hidden_size
        self.small_to_mtp_projection = (
            nn.Identity() if same_width else Linear(cfg.hidden_size, cp.hidden_size, bias=True))
        self._embed_c0 = embed_c0  # the talker's codec embedding C(.), not a submodule
        self._cache: PagedKVCache | None = None
        self._fused: FusedCodePredictor | None = None
        self._fused_max_batch = 0

    def use_fused(self, max_batch: int) -> None:
        """`generate` of at most `max_batch` rows through the fused kernels (models/code_predictor_fused.py)
        where they serve the inputs' device (EngineConfig.fused_code_predictor); larger batches, 0, or no
        triton: the eager passes below."""
        self._fused, self._fused_max_batch = None, max_batch
        if max_batch and kernels.HAS_TRITON:
            from q3tts.models.code_predictor_fused import FusedCodePredictor  # imports triton

            self._fused = FusedCodePredictor(self)

    @property
    def fused(self) -> FusedCodePredictor | None:
        """The fused passes `use_fused` set up (None: off, or no triton)."""
        return self._fused

    def _kv(self, batch: int, ref: torch.Tensor) -> PagedKVCache:
        cp = self.model.cfg
        cache = self._cache
        if (cache is None or cache.num_pages < batch or cache.k.dtype != ref.dtype
                or cache.k.device != ref.device):
            cache = PagedKVCache(cp.num_layers, batch, self.num_groups, cp.num_kv_heads, cp.head_dim,
                                 ref.dtype, ref.device)
            self._cache = cache
        return cache

    def _step(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
              cache: PagedKVCache, head: int) -> torch.Tensor:
        """x [N, H_talker] inputs of rows `rows [N]` at `positions [N]` -> logits of head [N, V]."""
        ctx = DecodeContext(cache, slot_mapping=rows * self.num_groups + positions,
                            block_tables=rows[:, None].int(), context_lens=(positions + 1).int(),
                            scale=self.model.attn_scale)
        hidden = self.model(self.small_to_mtp_projection(x), positions, ctx)  # [N, Hc]
        return self.lm_head[head](hidden)

    def generate(self, past_hidden: torch.Tensor, c0: torch.Tensor, sampler: SubtalkerSampler
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """past_hidden [B, H] (talker final-normed hidden), c0 [B] ->
        codes [B, 15] int64 (c1..c15), next_input [B, H] = C(c0) + sum_g codec_embedding[g-1](c_g)."""
        if (self._fused is not None and c0.shape[0] <= self._fused_max_batch
                and self._fused.serves(past_hidden)):
            return self._fused.generate(past_hidden, c0, sampler)
        bsz = c0.shape[0]
        cache = self._kv(bsz, past_hidden)
        rows = torch.arange(bsz, device=c0.device)  # [B]
        e0 = self._embed_c0(c0)  # [B, H]
        x = torch.stack((past_hidden, e0), dim=1).reshape(2 * bsz, -1)  # [2B, H]: rows b*2 + {0,1}
        first_two = torch.arange(2, device=c0.device).repeat(bsz)  # [2B]: positions 0, 1
        logits = self._step(x, rows.repeat_interleave(2), first_two, cache, head=0)
        code = sampler(logits.view(bsz, 2, -1)[:, 1], 1)  # [B]
        codes, embeds = [code], [e0]
        for j in range(1, self.num_groups - 1):
            embeds.append(self.model.codec_embedding[j - 1](code))  # [B, H]
            positions = torch.full_like(rows, j + 1)
            code = sampler(self._step(embeds[-1], rows, positions, cache, head=j), j + 1)
            codes.append(code)
        embeds.append(self.model.codec_embedding[self.num_groups - 2](code))
        # a reduction over a non-inner dim of 16 values: torch sums each output's 16 in one thread, in an
        # order set by the 16 alone, whatever B (batch-invariant as it is)
        next_input = torch.stack(embeds, dim=1).sum(1)  # [B, 16, H] -> [B, H]
        return torch.stack(codes, dim=1), next_input
