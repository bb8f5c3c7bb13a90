"""The talker: first-codebook LM over text + codec embeddings, owning the code predictor.

`embed_text` = P(ids) = text_projection(text_embedding(ids)); `embed_codec` = C(ids);
`forward` runs the 28-layer stack over a paged KV cache; `logits` is the codec head in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from q3tts import kernels
from q3tts.config import TalkerConfig
from q3tts.models.attention import AttentionContext, DecodeContext
from q3tts.models.code_predictor import CodePredictor
from q3tts.models.layers import DecoderStack, Linear, rows_at

if TYPE_CHECKING:
    from q3tts.models.talker_fused import FusedTalker


class TalkerModel(DecoderStack):
    """`talker.model`: decoder stack + codec and text embedding tables."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.layers, max_positions=cfg.layers.max_position_embeddings)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    """`talker.text_projection`: fc2(silu(fc1(x))), text width -> talker width."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    """`talker.*` of the released checkpoint."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.hidden_size)
        self.codec_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg, self.embed_codec)
        self._fused: FusedTalker | None = None
        self._fused_max_batch = 0

    def use_fused(self, max_batch: int) -> None:
        """Decode forwards (under a `DecodeContext`) of at most `max_batch` rows through the fused
        kernels (models/talker_fused.py) where they serve the inputs' device (EngineConfig.fused_talker);
        larger batches, 0, without triton, or for prefill: the eager stack."""
        self._fused, self._fused_max_batch = None, max_batch
        if max_batch and kernels.HAS_TRITON:
            from q3tts.models.talker_fused import FusedTalker  # imports triton

            self._fused = FusedTalker(self.model)

    @property
    def fused(self) -> FusedTalker | None:
        """The fused decode forward `use_fused` set up (None: off, or no triton)."""
        return self._fused

    def keep_fp32_residual(self, on: bool) -> None:
        """The residual streams of both stacks (talker, code predictor) in fp32 instead of the model dtype
        (EngineConfig.fp32_residual). The fused decode paths round the stream, so they do not serve it (the
        eager stacks run)."""
        self.model.fp32_residual = self.code_predictor.model.fp32_residual = on

    @property
    def attn_scale(self) -> float:
        return self.model.attn_scale

    def fuse_(self) -> Talker:
        """Fused q/k/v and gate/up weights and RoPE tables of both stacks (see models/layers.py);
        call after loading, before CUDA graph capture."""
        self.model.fuse_()
        self.code_predictor.model.fuse_()
        return self

    def warm_kernels(self, page_size: int, max_pages: int, batch_sizes: Sequence[int]) -> None:
        """Compile and tune the decode-step kernels of both stacks before CUDA-graph capture: the
        talker over the engine's pages (`page_size`, block tables `max_pages` wide), the code predictor
        over its one page of num_code_groups slots per row."""
        self.model.warm_kernels(page_size, max_pages, batch_sizes)
        self.code_predictor.model.warm_kernels(self.cfg.num_code_groups, 1, batch_sizes)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """P(ids): ids [N] -> [N, H]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """C(ids): ids [N] -> [N, H]."""
        return rows_at(self.model.codec_embedding.weight, ids)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        """x [N, H] at positions [N] -> final-normed hidden [N, H]."""
        if (self._fused is not None and isinstance(attn, DecodeContext) and x.shape[0] <= self._fused_max_batch
                and self._fused.serves(x)):
            return self._fused.forward(x, positions, attn)
        return self.model(x, positions, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> codec logits [B, vocab] float32."""
        return self.codec_head(hidden).float()
