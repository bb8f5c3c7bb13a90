"""`StreamingDecoder.prime_state` + `load_states` (a stream primed off the engine thread) against the priming
the engine did before them: `reset` + one `decode_chunk` of the context in the stream's slot, padded with
scratch rows. Bit for bit, on every state tensor and on the audio decoded after it; the pool untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from q3tts.codec import StreamingDecoder

SLOT = 2


def _primed_in_pool(codec, context, rows, pad_to=(), device="cpu"):
    """The old path: reset SLOT, decode `context` [16, F] there in a call of `rows` rows (the rest are
    zero codes on the scratch slot)."""
    stream = StreamingDecoder(copy.deepcopy(codec.decoder), max_streams=4, pad_to=pad_to, device=device)
    context = context.to(device)
    stream.reset([SLOT])
    slots = torch.tensor([SLOT] + [stream.scratch_slot] * (rows - 1), device=device)
    codes = torch.cat((context[None], context.new_zeros((rows - 1, *context.shape))))
    stream.decode_chunk(slots, codes)
    return stream


def _primed_by_state(codec, context, rows, pad_to=(), device="cpu"):
    stream = StreamingDecoder(copy.deepcopy(codec.decoder), max_streams=4, pad_to=pad_to, device=device)
    stream.load_states([SLOT], [stream.prime_state(context, rows)])
    return stream


@pytest.mark.parametrize("rows, pad_to", [(1, ()), (4, ()), (1, (2, 4))], ids=["alone", "bucket4", "pad_to"])
def test_prime_state_equals_decode_chunk_priming(codec, codes, rows, pad_to):
    _check_priming(codec, codes, rows, pad_to, "cpu")


@pytest.mark.gpu
def test_prime_state_equals_decode_chunk_priming_cuda(codec, codes):
    """The same on CUDA, where prime_state runs on a stream of its own (a bucket of 4 rows)."""
    _check_priming(codec, codes, 4, (), "cuda")


def _check_priming(codec, codes, rows, pad_to, device):
    """Equal pool state after priming both ways, and equal audio for the frames that follow."""
    context, more = codes[0, :, :80], codes[0, :, 80:].to(device)  # 80 > the 72-frame window: it is full
    old = _primed_in_pool(codec, context, rows, pad_to, device)
    new = _primed_by_state(codec, context, rows, pad_to, device)
    for a, b in zip(old.pool, new.pool):
        assert torch.equal(a[SLOT], b[SLOT])
    assert int(new.pool[codec.decoder.pre_transformer.pos_state][SLOT]) == 80  # it did decode the context
    slot = torch.tensor([SLOT], device=device)
    pcm_old = torch.cat([old.decode_frame(slot, more[None, :, t]) for t in range(more.shape[-1])], 1)
    pcm_new = torch.cat([new.decode_frame(slot, more[None, :, t]) for t in range(more.shape[-1])], 1)
    assert torch.equal(pcm_old, pcm_new) and pcm_new.abs().max() > 0


def test_prime_state_leaves_the_pool_alone(codec, codes):
    """Other streams mid-decode keep their state bit for bit while a context is primed beside them."""
    stream = StreamingDecoder(codec.decoder, max_streams=4)
    slots = torch.tensor([0, 1])
    stream.reset(slots)
    stream.decode_chunk(slots, codes[:2, :, :10])
    before = [state.clone() for state in stream.pool]
    state = stream.prime_state(codes[2, :, :50])
    assert all(torch.equal(a, b) for a, b in zip(before, stream.pool))
    assert [(s.shape, s.dtype) for s in state] == [((1, *b.shape[1:]), b.dtype) for b in stream.buffers]  # packed


def test_states_load_together_as_each_alone(codec, codes):
    """Two primed states loaded into two slots in one call: each slot's every state tensor equals the same
    state loaded alone, and a slot not loaded keeps its own state."""
    stream = StreamingDecoder(codec.decoder, max_streams=4)
    stream.reset([0, 1, 3])
    stream.decode_chunk(torch.tensor([3]), codes[:1, :, :5])  # slot 3 mid-stream
    keep = [state[3].clone() for state in stream.pool]
    primed = [stream.prime_state(codes[i, :, :30 + 10 * i]) for i in (1, 2)]
    stream.load_states([2, 0], primed)
    for slot, state in zip((2, 0), primed):
        alone = StreamingDecoder(codec.decoder, max_streams=4)
        alone.load_states([1], [state])
        assert all(torch.equal(a[slot], b[1]) for a, b in zip(stream.pool, alone.pool))
    assert all(torch.equal(a[3], b) for a, b in zip(stream.pool, keep))
    assert not torch.equal(stream.pool[0][0], stream.pool[0][2])  # two different contexts were loaded

