"""Codec decoder: full and streaming decode against the official tokenizer (tiny random checkpoint)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from q3tts.codec import CodecDecoder, StreamingDecoder, read_speech_tokenizer

SPF = 1920
TOL = 1e-5


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.oracle
def test_reference_loads_our_folder_with_exact_keys(codec_dir, ref_tokenizer):
    ours = load_file(str(codec_dir / "model.safetensors"))
    ref = ref_tokenizer.model.state_dict()
    assert set(ours) == set(ref)
    assert all(tuple(ours[k].shape) == tuple(ref[k].shape) for k in ours)
    assert all(torch.equal(ours[k], ref[k]) for k in ours)  # nothing re-initialised by the loader


@pytest.mark.oracle
def test_full_decode_matches_reference(codec, codes, ref_pcm):
    pcm = codec.decoder.decode(codes)
    assert pcm.shape == ref_pcm.shape
    assert ref_pcm.std() > 0.01 and (ref_pcm.abs() < 1).float().mean() > 0.99  # not degenerate
    assert _max_err(pcm, ref_pcm) <= TOL


@pytest.mark.oracle
def test_chunked_decode_of_long_output_matches_reference(codec, ref_tokenizer):
    """Beyond 300 frames the reference decodes in 300-frame chunks with 25 frames of context."""
    long = torch.randint(0, 2048, (1, 16, 330), generator=torch.Generator().manual_seed(5))
    wavs, _ = ref_tokenizer.decode({"audio_codes": [long[0].T]})
    assert _max_err(codec.decoder.decode_like_reference(long)[0], torch.from_numpy(wavs[0])) <= TOL


@pytest.mark.oracle
def test_frame_by_frame_matches_reference(codec, codes, ref_pcm):
    stream = StreamingDecoder(codec.decoder, max_streams=4)
    slots = torch.tensor([3, 0, 1])
    stream.reset(slots)
    pcm = torch.cat([stream.decode_frame(slots, codes[:, :, t]) for t in range(codes.shape[-1])], dim=1)
    assert _max_err(pcm, ref_pcm) <= TOL


@pytest.mark.oracle
def test_streams_join_at_different_frames(codec, codes, ref_pcm):
    """Streams start at frames 0, 9 and 40 in slots 5, 2, 0; the batch changes size and order."""
    stream = StreamingDecoder(codec.decoder, max_streams=6)
    starts, slot_of = [0, 9, 40], [5, 2, 0]
    stream.reset(torch.tensor([1, 5]))  # slot 5 starts clean; slot 1 is never used
    frames = codes.shape[-1]
    out: list[list[torch.Tensor]] = [[] for _ in starts]
    for step in range(frames + max(starts)):
        active = [i for i in reversed(range(3)) if starts[i] <= step < starts[i] + frames]
        if not active:
            continue
        joining = [slot_of[i] for i in active if step == starts[i]]
        if joining:
            stream.reset(torch.tensor(joining))
        slots = torch.tensor([slot_of[i] for i in active])
        frame = torch.stack([codes[i, :, step - starts[i]] for i in active])
        pcm = stream.decode_frame(slots, frame)
        for row, i in enumerate(active):
            out[i].append(pcm[row])
    for i in range(3):
        assert _max_err(torch.cat(out[i]), ref_pcm[i]) <= TOL


@pytest.mark.oracle
def test_irregular_chunks_match_reference(codec, codes, ref_pcm):
    stream = StreamingDecoder(codec.decoder, max_streams=3)
    slots = torch.arange(3)
    stream.reset(slots)
    sizes = [1, 3, 7, 2, 30, 1, 1, 50, 4, 1]
    assert sum(sizes) == codes.shape[-1]
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    pcm = torch.cat([stream.decode_chunk(slots, codes[:, :, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
    assert _max_err(pcm, ref_pcm) <= TOL


def _stream_rows(codec, codes, frames, row, pad_to=()):
    """Decode `codes` [B, 16, frames] frame by frame in one batch; return row `row`'s pcm."""
    stream = StreamingDecoder(codec.decoder, max_streams=codes.shape[0], pad_to=pad_to)
    slots = torch.arange(codes.shape[0])
    stream.reset(slots)
    return torch.cat([stream.decode_frame(slots, codes[:, :, t])[row] for t in range(frames)])


def test_stream_output_does_not_depend_on_its_batch_companions(codec, codes):
    """Bit-identical whatever the other streams of a (fixed-size, e.g. graph-padded) batch decode."""
    others = torch.randint(0, 2048, codes.shape, generator=torch.Generator().manual_seed(7))
    mixed = torch.stack([others[0], codes[1], others[2]])
    assert torch.equal(_stream_rows(codec, codes, 24, 1), _stream_rows(codec, mixed, 24, 1))


def test_stream_in_batch_is_bit_identical_to_stream_alone(codec, codes):
    """Alone vs in a batch of 3, both padded to the same bucket (as the engine does): bit-identical."""
    together = _stream_rows(codec, codes, 24, 1, pad_to=(4,))
    alone = _stream_rows(codec, codes[1:2], 24, 0, pad_to=(4,))
    assert torch.equal(together, alone)


def test_unpadded_batch_sizes_differ_only_by_gemm_blocking(codec, codes):
    """Without padding, alone (M=1: gemv) vs a batch of 3 differ only by BLAS rounding."""
    together = _stream_rows(codec, codes, 24, 1)
    alone = _stream_rows(codec, codes[1:2], 24, 0)
    assert _max_err(together, alone) <= 1e-6


def test_a_frame_gathers_the_states_one_launch_per_packed_buffer(codec, codes):
    """decode_frame reads the streams' states with one gather per packed buffer (dtype), not one per state tensor
    (38 state tensors at the released size: 38 launches on every codec step), and neither gathers nor scatters the
    resident ones (the transformer's windows: 2 per layer), which it uses in place. Its gathers, the states' and the
    codebooks', index (`rows_at`): no index_select or embedding, whose CUDA kernel walks up to 16 ids one by one."""
    from torch.profiler import ProfilerActivity, profile

    spec = codec.decoder.spec
    resident = sum(res for _, _, res in spec.entries)
    stream = StreamingDecoder(codec.decoder, max_streams=3)
    slots = torch.arange(3)
    stream.reset(slots)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        stream.decode_frame(slots, codes[:, :, 0])
    top = [e for e in prof.events() if e.cpu_parent is None]  # not inside other ops
    names = [e.name for e in top]
    packed = [list(rows.shape) for rows in stream.buffers[:spec.num_packed(torch.float32)]]
    gathers = [e for e in top if e.name == "aten::index" and e.input_shapes[0] in packed]
    assert resident == 2 * len(codec.decoder.pre_transformer.layers) and len(packed) == 2
    assert len(gathers) == 2 and names.count("aten::index_copy_") == len(stream.pool) - resident
    assert "aten::index_select" not in names and "aten::embedding" not in names


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_the_kernel_path_scatters_the_states_one_launch_per_dtype(codec, codes, monkeypatch):
    """After a frame the kernel path writes the streams' states back with one `scatter_rows` launch per dtype (the
    model's, and the int64 frame counter's), no `index_copy_`: the pool then holds the torch path's bits."""
    from torch.profiler import ProfilerActivity, profile

    from q3tts.kernels import scatter

    launches, scatter_rows = [], scatter.scatter_rows
    monkeypatch.setattr(scatter, "scatter_rows", lambda d, r, s: launches.append(len(d)) or scatter_rows(d, r, s))
    slots, pools = torch.tensor([2, 0]), []
    for kernel_path in (False, True):
        stream = StreamingDecoder(codec.decoder, max_streams=3)
        stream.reset(slots)
        states = stream.gather_states(slots)
        with torch.no_grad():
            codec.decoder.forward_chunk(codes[:2, :, :1], states, rows=slots)  # the torch path both times
        monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1" if kernel_path else "0")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            stream.scatter_states(slots, states)
        assert ("aten::index_copy_" in [e.name for e in prof.events()]) != kernel_path
        pools.append([buf.clone() for buf in stream.buffers])
    resident = sum(res for _, _, res in codec.decoder.spec.entries)
    assert sorted(launches) == [1, len(stream.pool) - resident - 1]  # the counter, the model dtype's states
    assert all(torch.equal(a, b) for a, b in zip(*pools))


def test_a_code_past_the_codebook_decodes_as_the_last_one(codec, codes):
    """A frame whose c0 is the talker's EOS id, past the codebook (the frame of a row that runs once more after its
    sequence ended, two decode steps in flight), decodes as the codebook's last code: no index out of range, which
    on CUDA is a device-side assert that ends every stream of the process."""
    size = codec.decoder.config.codebook_size
    eos, last = codes[:, :, :4].clone(), codes[:, :, :4].clone()
    eos[1, 0, 2], last[1, 0, 2] = size + 102, size - 1  # 2150, the released EOS id, at 2048 codes
    assert torch.equal(_stream_rows(codec, eos, 4, 1), _stream_rows(codec, last, 4, 1))


def test_padding_rows_use_the_scratch_slot(codec, codes):
    stream = StreamingDecoder(codec.decoder, max_streams=2)
    pad = stream.scratch_slot
    slots = torch.tensor([0, pad, pad])
    stream.reset(torch.tensor([0]))
    got = torch.cat([stream.decode_frame(slots, codes[:, :, t])[0] for t in range(10)])
    ref = codec.decoder.decode(codes[:1, :, :10])[0]
    assert _max_err(got, ref) <= TOL


def test_bf16_streaming_tracks_fp32(codec_dir, codes):
    cfg, weights = read_speech_tokenizer(codec_dir)
    ref = CodecDecoder.from_weights(cfg, weights).decode(codes[:1, :, :40])[0]
    stream = StreamingDecoder(CodecDecoder.from_weights(cfg, weights), 1, dtype=torch.bfloat16)
    slots = torch.tensor([0])
    got = torch.cat([stream.decode_frame(slots, codes[:1, :, t])[0] for t in range(40)]).float()
    snr = 10 * torch.log10(ref.pow(2).sum() / (got - ref).pow(2).sum())
    assert got.shape == (40 * SPF,) and snr > 15, f"SNR {snr:.1f} dB"


@pytest.mark.oracle
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_frame_by_frame_through_triton_kernels_matches_reference(codec, codes, ref_pcm, monkeypatch):
    """The CUDA path's conv1d / SnakeBeta kernels (run by the interpreter) in the streaming decoder."""
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    frames = 3  # every conv history (pre-conv k3 included) is filled from real frames; interpreter is slow
    stream = StreamingDecoder(codec.decoder, max_streams=3, use_kernels=True)
    slots = torch.tensor([2, 0])
    stream.reset(slots)
    try:
        pcm = torch.cat([stream.decode_frame(slots, codes[:2, :, t]) for t in range(frames)], dim=1)
    finally:
        stream.decoder.use_kernels(False)  # the session's codec fixture is shared
    assert _max_err(pcm, ref_pcm[:2, : frames * SPF]) <= TOL


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_kernel_convs_reading_the_history_in_place_match_concatenating_it(codec, codes, monkeypatch):
    """Streaming with the conv kernel reading each conv's state in place (`history=`) gives, bit for bit,
    the pcm and states of the former path, which concatenated the state in front of the new samples.
    Frame by frame, both branches of the state update run: T < history (pre-conv, first conv) and
    T >= history."""
    from q3tts import kernels
    from q3tts.codec.layers import CausalConv1d, activated, channels_last

    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    split_forward = CausalConv1d.forward

    def cat_forward(self, x, states, residual=None, snake=None, keep=False):  # the kernel branch before `history=`
        if self.conv.groups != 1:
            return split_forward(self, x, states, residual, snake, keep)
        if self.history:
            x = torch.cat([self.history_of(states), x], dim=-1)
            self.keep_history(states, x[..., -self.history:])
        return activated(kernels.causal_conv1d(channels_last(x), self.conv.weight, self.conv.bias,
                                               self.conv.dilation[0], residual, self.weight_oik), snake, keep)

    def run(frames=2):
        stream = StreamingDecoder(codec.decoder, max_streams=3, use_kernels=True)
        slots = torch.tensor([1])  # one stream: the interpreter runs a program per batch row
        stream.reset(slots)
        pcm, states = [], []
        for t in range(frames):
            pcm.append(stream.decode_frame(slots, codes[1:2, :, t]))
            states.append([buf.clone() for buf in stream.buffers])
        return torch.cat(pcm, dim=1), states

    try:
        pcm, states = run()
        with monkeypatch.context() as m:
            m.setattr(CausalConv1d, "forward", cat_forward)
            want_pcm, want_states = run()
    finally:
        codec.decoder.use_kernels(False)  # the session's codec fixture is shared
    assert pcm.shape == (1, 2 * SPF) and torch.equal(pcm, want_pcm)
    for got, want in zip(states, want_states):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_the_fused_codec_gives_the_unfused_kernels_bits(codec, codes, monkeypatch):
    """`fuse` (EngineConfig.codec_fusion): every SnakeBeta made in the epilogue of the conv before it (`snake=`), the
    transposed convs' phases interleaved there (`phases=`), the codebook lookups in one launch: none of the decoder's
    1 + 7 a block snake launches and no codebook gather is left, and the pcm and states are the unfused kernels',
    bit for bit."""
    from q3tts import kernels
    from q3tts.codec import decoder

    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    launches = {"snake": 0, "gather": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            launches[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(kernels, "snake_beta", counted("snake", kernels.snake_beta))
    monkeypatch.setattr(decoder, "rows_at", counted("gather", decoder.rows_at))  # the codebook lookups

    def run(fuse: bool):
        stream = StreamingDecoder(codec.decoder, max_streams=3, use_kernels=True, fuse=fuse)
        slots = torch.tensor([1])  # one stream: the interpreter runs a program per batch row
        stream.reset(slots)
        launches.update(snake=0, gather=0)
        pcm = torch.cat([stream.decode_frame(slots, codes[1:2, :, t]) for t in range(2)], dim=1)
        return pcm, [buf.clone() for buf in stream.buffers], dict(launches)

    blocks, books = len(codec.decoder.decoder) - 3, codec.decoder.config.num_quantizers
    try:
        pcm, states, fused = run(True)
        want_pcm, want_states, unfused = run(False)
    finally:
        codec.decoder.use_kernels(False)  # the session's codec fixture is shared
    assert unfused == {"snake": 2 * (1 + 7 * blocks), "gather": 2 * books} and fused == {"snake": 0, "gather": 0}
    assert torch.equal(pcm, want_pcm) and all(torch.equal(g, w) for g, w in zip(states, want_states))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_kernel_chunks_on_one_states_list_match_the_streaming_pool(codec, codes, monkeypatch):
    """forward_chunk frame by frame on one states list with the kernels (perf/bench_codec.py --stages, a decode in
    pieces): a conv's history kept from a chunk shorter than it stays channels-last for the conv kernel's next
    call, and the pcm is the streaming pool's (which gathers the states afresh each frame), bit for bit."""
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    decoder = codec.decoder
    stream = StreamingDecoder(decoder, max_streams=2, use_kernels=True)
    slots = torch.tensor([0])
    stream.reset(slots)
    try:
        with torch.no_grad():
            states = decoder.zero_states(1)
            pcm = [decoder.forward_chunk(codes[1:2, :, t:t + 1], states) for t in range(2)]
            want = [stream.decode_frame(slots, codes[1:2, :, t]) for t in range(2)]
    finally:
        decoder.use_kernels(False)  # the session's codec fixture is shared
    assert torch.equal(torch.cat(pcm, dim=1), torch.cat(want, dim=1))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_quantizer_kernel_gives_the_lookups_bits_without_gathers(codec, codes, monkeypatch, dtype):
    """With the kernels, each residual VQ's codebook lookups and their sum are one `rvq_sum` launch: the quantizer's
    output is the gathers' and adds' bit for bit, and no gather or add of the lookups runs (the two halves' sum is
    the one add left)."""
    import copy

    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    quantizer = copy.deepcopy(codec.decoder.quantizer).to(dtype)
    frame = codes[:, :, :2]
    want = quantizer(frame)
    for half in (quantizer.rvq_first, quantizer.rvq_rest):
        half.use_kernels = True
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = quantizer(frame)
    names = [e.name for e in prof.events() if e.cpu_parent is None]
    assert got.dtype == dtype and torch.equal(got, want)
    assert "aten::index" not in names and names.count("aten::add") == 1, names


def test_reset_zeroes_exactly_the_given_slots(codec):
    stream = StreamingDecoder(codec.decoder, max_streams=3)
    for state in stream.pool:
        state.fill_(1)
    stream.reset([2, 0])
    stream.reset(torch.tensor([3]))  # tensor form: the scratch slot
    for state in stream.pool:
        assert not state[[0, 2, 3]].any() and bool((state[1] == 1).all())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_a_chunk_of_one_stream_through_the_batch_invariant_kernels(codec, codes, monkeypatch, switch):
    """Under the batch-invariance switch every codec layer runs a kernel or a row-independent path: a chunk of
    two frames of one stream (a Base voice's reference codes primed, `prime_state`) through them, the kernels in
    the interpreter, gives the plain decoder's pcm to fp32 rounding. The one-row [1, T, C] views the transformer
    hands its linears are not contiguous: the GEMM kernel refused them (5f1b9d0)."""
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    decoder, chunk = codec.decoder, codes[1:2, :, :2]  # [1, 16, 2]
    with torch.no_grad():
        want = decoder.forward_chunk(chunk, decoder.zero_states(1))
        switch(True)
        decoder.use_kernels(True)
        try:
            got = decoder.forward_chunk(chunk, decoder.zero_states(1))
        finally:
            decoder.use_kernels(False)  # the session's codec fixture is shared
    assert got.shape == want.shape == (1, 2 * SPF)
    assert _max_err(got, want) <= TOL
