"""Frame-by-frame streaming decode for many streams at once.

`StreamingDecoder` preallocates the per-stream decoder state for `max_streams` slots (every state tensor
has a leading slot dim; one extra scratch slot, `scratch_slot`, takes padding rows). A call gathers the
states of the given slots, runs the decoder's chunk path on the new frames only, and scatters the
states back: nothing is ever re-decoded, shapes are static per batch size, and there is no host sync,
so `decode_frame` can be captured in a CUDA graph. Each stream sits at its own frame position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .decoder import CodecDecoder


class StreamingDecoder:
    """Per-stream state pool around a `CodecDecoder` (moved to `dtype` / `device`)."""

    def __init__(self, decoder: CodecDecoder, max_streams: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", pad_to: tuple[int, ...] = (), use_kernels: bool = False) -> None:
        """`pad_to`: batch sizes every call is padded up to (with scratch rows), so a stream's bits
        never depend on how many streams share the call (GEMM kernels differ by row count).
        `use_kernels`: convs and SnakeBeta through `q3tts.kernels` (see EngineConfig.codec_kernels)."""
        self.decoder = decoder.to(device=device, dtype=dtype).eval()
        self.decoder.use_kernels(use_kernels)
        self.pad_to = tuple(sorted(pad_to))
        self.max_streams = max_streams
        self.scratch_slot = max_streams
        self.samples_per_frame = decoder.config.samples_per_frame
        self.pool = decoder.spec.zeros(max_streams + 1, dtype, device)  # [slots + 1, ...] each

    @torch.no_grad()
    def reset(self, slots: Tensor | list[int]) -> None:
        """Start fresh streams in `slots` (a list of ids, or an int64 tensor: read on the host).

        One multi-tensor zeroing over every (state, slot) row: a few launches, not one per state tensor
        (this runs on the time-to-first-audio path of every admitted batch)."""
        ids = slots.tolist() if isinstance(slots, Tensor) else list(slots)
        rows: dict[torch.dtype, list[Tensor]] = {}  # the fused path needs one dtype per call
        for state in self.pool:
            rows.setdefault(state.dtype, []).extend(state[i] for i in ids)
        for group in rows.values():
            torch._foreach_zero_(group)

    @torch.no_grad()
    def decode_chunk(self, slots: Tensor, codes: Tensor) -> Tensor:
        """Decode the next T frames of each stream: slots [B], codes [B, 16, T] -> pcm [B, T·1920].

        Slots must be distinct, except `scratch_slot`, which padding rows may share (its state is junk)."""
        num = slots.shape[0]
        rows = next((b for b in self.pad_to if b >= num), num)
        if rows > num:
            slots = torch.cat([slots, slots.new_full((rows - num,), self.scratch_slot)])
            codes = torch.cat([codes, codes.new_zeros((rows - num, *codes.shape[1:]))])
        states = [state.index_select(0, slots) for state in self.pool]
        pcm = self.decoder.forward_chunk(codes, states)
        for state, new in zip(self.pool, states):
            state.index_copy_(0, slots, new)
        return pcm[:num]

    def decode_frame(self, slots: Tensor, codes: Tensor) -> Tensor:
        """Decode the newest frame of each stream: slots [B], codes [B, 16] -> pcm [B, 1920]."""
        return self.decode_chunk(slots, codes[:, :, None])
