"""Frame-by-frame streaming decode for many streams at once.

`StreamingDecoder` preallocates the per-stream decoder state for `max_streams` slots (every state tensor
has a leading slot dim; one extra scratch slot, `scratch_slot`, takes padding rows). A call gathers the
states of the given slots, runs the decoder's chunk path on the new frames only, and scatters the
states back, except the resident ones (the transformer's key/value windows, 2.4 MB a stream at the
released size), which the decoder reads and writes in the pool's rows of those slots: nothing is ever re-decoded, shapes are static per batch size, and there is no host sync,
so `decode_frame` can be captured in a CUDA graph. Each stream sits at its own frame position.

A stream that starts after a context (Base ICL: the reference frames) gets its state from `prime_state`,
which decodes the context into private tensors (never the pool), so it may run on another thread while
the pool's streams are stepped; `load_states` then copies such states into the streams' slots. A state is
packed as the pool is (one row per dtype), so loading it is a copy per dtype, not one per state tensor. It
depends only on the context and the decoder (its call shape is fixed per engine) and is only ever read,
so one may be kept and loaded into any number of streams (the engine's voice cache does).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from q3tts import kernels
from q3tts.models.layers import rows_at
from q3tts.models.transfer import upload

from .decoder import CodecDecoder


class StreamingDecoder:
    """Per-stream state pool around a `CodecDecoder` (moved to `dtype` / `device`)."""

    def __init__(self, decoder: CodecDecoder, max_streams: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", pad_to: tuple[int, ...] = (), use_kernels: bool = False,
                 fuse: bool = False) -> None:
        """`pad_to`: batch sizes every call is padded up to (with scratch rows), so a stream's bits
        never depend on how many streams share the call (GEMM kernels differ by row count).
        `use_kernels`: convs and SnakeBeta through `q3tts.kernels` (see EngineConfig.codec_kernels); `fuse`: their
        fusions too (`CodecDecoder.use_kernels`, EngineConfig.codec_fusion)."""
        self.decoder = decoder.to(device=device, dtype=dtype).eval()
        self.decoder.use_kernels(use_kernels, fuse)
        self.pad_to = tuple(sorted(pad_to))
        self.max_streams = max_streams
        self.scratch_slot = max_streams
        self.samples_per_frame = decoder.config.samples_per_frame
        self.dtype = dtype
        # [slots + 1, ...] each: views into one buffer [slots + 1, n] per dtype, and the resident states; `buffers`
        # holds them all (what `reset` zeroes and `load_states` fills), the first `_packed` are the packed ones
        self.pool, self.buffers = decoder.spec.zeros_packed(max_streams + 1, dtype, device)
        self._packed = decoder.spec.num_packed(dtype)

    @torch.no_grad()
    def reset(self, slots: Tensor | list[int]) -> None:
        """Start fresh streams in `slots` (a list of ids, or an int64 tensor on any device).

        One index_fill_ per state dtype over the packed buffers, no host sync (this runs on the time-to-first-audio
        path of every admitted batch: zeroing each state's row of each stream took milliseconds of host time)."""
        ids = self._slot_ids(slots)
        for rows in self.buffers:
            rows.index_fill_(0, ids, 0)

    def _slot_ids(self, slots: Tensor | list[int]) -> Tensor:
        """`slots` as int64 ids on the pool's device, uploaded without waiting for the work queued there."""
        return upload(torch.as_tensor(slots, dtype=torch.int64), self.buffers[0].device)

    def padded_rows(self, num: int) -> int:
        """The rows a call for `num` streams runs with (`pad_to`)."""
        return next((b for b in self.pad_to if b >= num), num)

    @torch.no_grad()
    def decode_chunk(self, slots: Tensor, codes: Tensor) -> Tensor:
        """Decode the next T frames of each stream: slots [B], codes [B, 16, T] -> pcm [B, T·1920].

        Slots must be distinct, except `scratch_slot`, which padding rows may share (its state is junk). A code
        outside the codebook decodes as the nearest one in it: with two decode steps in flight, a row whose
        sequence ended at EOS runs once more and its frame (c0 = the EOS id, past the codebook) reaches the codec,
        its audio and state dropped; an index out of range would be a device-side assert on CUDA, which takes
        down every stream of the process."""
        codes = codes.clamp(0, self.decoder.config.codebook_size - 1)
        num = slots.shape[0]
        rows = self.padded_rows(num)
        if rows > num:
            slots = torch.cat([slots, slots.new_full((rows - num,), self.scratch_slot)])
            codes = torch.cat([codes, codes.new_zeros((rows - num, *codes.shape[1:]))])
        states = self.gather_states(slots)
        pcm = self.decoder.forward_chunk(codes, states, rows=slots)
        self.scatter_states(slots, states)
        return pcm[:num]

    def gather_states(self, slots: Tensor) -> list[Tensor]:
        """The states of streams `slots` [B] (distinct but for the scratch slot) as views, what `decode_chunk` hands
        the decoder: the packed ones gathered one launch per packed buffer (not one per state tensor), the resident
        ones the pool's own tensors, read and written in place at rows `slots`."""
        packed, resident = self.buffers[:self._packed], self.buffers[self._packed:]
        return self.decoder.spec.views([rows_at(rows, slots) for rows in packed], self.dtype, resident)

    def scatter_states(self, slots: Tensor, states: list[Tensor]) -> None:
        """Write `states` (`gather_states`' list after a decoder call) back into the pool rows of `slots`: one
        `kernels.scatter_rows` per dtype (22 states at the released size: one launch each as `index_copy_`)."""
        by_dtype: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
        for state, new in zip(self.pool, states):
            if new is not state:  # a resident state is its pool tensor, already written
                dsts, srcs = by_dtype.setdefault(state.dtype, ([], []))
                dsts.append(state)
                srcs.append(new)
        for dsts, srcs in by_dtype.values():
            kernels.scatter_rows(dsts, slots, srcs)

    def decode_frame(self, slots: Tensor, codes: Tensor) -> Tensor:
        """Decode the newest frame of each stream: slots [B], codes [B, 16] -> pcm [B, 1920]."""
        return self.decode_chunk(slots, codes[:, :, None])

    @torch.no_grad()
    def prime_state(self, codes: Tensor, rows: int = 1) -> list[Tensor]:
        """The state of a fresh stream after decoding `codes` [16, F] (its audio is dropped), packed: one
        row [1, n] per buffer of the pool (`buffers`). Computed in private tensors, so it is safe on another
        thread while the pool is stepped (on CUDA on its own stream, finished before it returns). The stream
        is row 0 of a call of `rows` rows (padded further as `decode_chunk` pads), the others zero codes on
        zero state: bit for bit the state that `reset` + `decode_chunk` of the same call shape leave."""
        rows = self.padded_rows(rows)
        codes = torch.cat((codes[None], codes.new_zeros((rows - 1, *codes.shape))))  # [rows, 16, F]
        dtype, device = self.dtype, self.buffers[0].device
        with _side_stream(device) as side:
            states = self.decoder.spec.zeros(rows, dtype, device)
            self.decoder.forward_chunk(codes.to(device), states)
            row, packed = self.decoder.spec.zeros_packed(1, dtype, device)
            for dst, src in zip(row, states):
                dst.copy_(src[:1])
        if side is not None:
            side.synchronize()
        return packed

    @torch.no_grad()
    def load_states(self, slots: list[int], states: list[list[Tensor]]) -> None:
        """Copy `prime_state` results into `slots` (replaces `reset` for those streams): one index copy per
        pool buffer, no host sync."""
        ids = self._slot_ids(slots)
        for k, dst in enumerate(self.buffers):
            dst.index_copy_(0, ids, torch.cat([state[k] for state in states]))  # [n slots, width]
        for src in (t for state in states for t in state if t.is_cuda):
            src.record_stream(torch.cuda.current_stream(src.device))  # made on another stream: keep its memory


@contextlib.contextmanager
def _side_stream(device: torch.device):
    """A CUDA stream of its own for work off the engine thread (None on CPU)."""
    if device.type != "cuda":
        yield None
        return
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        yield side
