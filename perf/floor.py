"""The decode step's bandwidth floor: the bytes one engine step must read from device memory, over its bandwidth.

One step makes a frame for each of its B rows. Whatever B, it reads once (bf16 at the released sizes):
  - the talker's decoder layers, final norm and codec head (one token per row);
  - the code predictor 15 times (15 dependent passes, each its layers, final norm and input projection; the
    157 MB of the 1.7B predictor does not stay in the H200's 50 MB L2 between passes) plus its 15 heads, each
    read by one pass;
  - the codec decoder's weights (it decodes each frame once).
Per row it reads its talker KV cache (every layer's K and V of every context token) and its codec stream's
state. Embedding rows, activations and the code predictor's own 17-position cache are left out (under 1 %).
At the 1.7B shapes that is 5.317 GB of language-model weights a frame (talker 1 415 701 504 parameters,
code predictor 1 242 766 080 read per frame) and 112 KiB of KV per context token. The floor ignores compute:
at these batch sizes the step's FLOPs take a small fraction of its memory time.

The bandwidth: the H200's HBM3e at its specified 4.8 TB/s (`H200_BYTES_PER_S`); what a kernel reaches is lower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

H200_BYTES_PER_S = 4.8e12


def param_bytes(*modules: nn.Module) -> int:
    """Bytes of the parameters of `modules`, in the dtypes they hold."""
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


@dataclass(frozen=True)
class StepBytes:
    """What one decode step reads: `weights` once, `per_token` for each context token of each row (talker KV),
    `per_row` for each row (its codec stream's state)."""

    weights: int
    per_token: int
    per_row: int

    @classmethod
    def of_runner(cls, runner) -> StepBytes:
        """The reads of an engine's `ModelRunner` (its talker, KV cache and codec, in their dtypes)."""
        talker = runner.talker
        cp = talker.code_predictor
        passes = len(cp.lm_head)  # one pass per head: codebooks 1..15
        lm = param_bytes(talker.model.layers, talker.model.norm, talker.codec_head)
        cp_pass = param_bytes(cp.model.layers, cp.model.norm, cp.small_to_mtp_projection)
        codec = runner.codec
        codec_weights = param_bytes(codec.decoder) if codec is not None else 0
        codec_state = sum(math.prod(shape) * (dt or codec.dtype).itemsize
                          for shape, dt, _ in codec.decoder.spec.entries) if codec is not None else 0
        kv = runner.kv
        per_token = 2 * kv.k[:, 0, 0].numel() * kv.k.element_size()  # K and V of every layer
        return cls(weights=lm + passes * cp_pass + param_bytes(cp.lm_head) + codec_weights,
                   per_token=per_token, per_row=codec_state)

    def total(self, rows: int, context_tokens: int) -> int:
        """Bytes of a step of `rows` rows holding `context_tokens` context tokens between them."""
        return self.weights + rows * self.per_row + context_tokens * self.per_token

    def floor_ms(self, rows: int, context_tokens: int, bytes_per_s: float = H200_BYTES_PER_S) -> float:
        """The step's time at `bytes_per_s` if it only read what it must, once."""
        return 1e3 * self.total(rows, context_tokens) / bytes_per_s


def context_tokens(engine) -> int:
    """KV tokens the next step of the engine's running sequences attends (`Sequence.num_tokens` each)."""
    return sum(s.num_tokens for s in engine.scheduler.running)


