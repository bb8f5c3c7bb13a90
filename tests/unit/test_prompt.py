"""Prompt builder: voice validation (InvalidRequest), name handling, text modes and lengths, no host reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from host_reads import HostReads  # tests/ is on sys.path
from q3tts.checkpoint.loader import load_checkpoint
from q3tts.checkpoint.maker import make_checkpoint
from q3tts.core import InvalidRequest, VoiceSpec
from q3tts.models.layers import rows_at
from q3tts.models.tts_model import Qwen3TTS
from q3tts.models.prompt import PromptBuilder

TEXT = "Hello world, this is a test."


def _builder(root, variant, size, seed):
    ckpt = load_checkpoint(make_checkpoint(root / variant / size, variant, size, "tiny", seed))
    return PromptBuilder(Qwen3TTS.from_checkpoint(ckpt), ckpt.tokenizer)


@pytest.fixture(scope="module")
def builders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt")
    return {"cv17": _builder(root, "custom_voice", "1.7b", 1),
            "cv06": _builder(root, "custom_voice", "0.6b", 2),
            "vd17": _builder(root, "voice_design", "1.7b", 3),
            "base06": _builder(root, "base", "0.6b", 4)}


def _text_tokens(builder) -> int:
    return len(builder.target_ids(TEXT)) - 8


def test_custom_voice_lengths_per_mode(builders):
    b = builders["cv17"]
    n = _text_tokens(b)
    inc = b.build(TEXT, VoiceSpec(speaker="ryan", language="english", text_mode="incremental"))
    whole = b.build(TEXT, VoiceSpec(speaker="ryan", language="english"))  # default: whole
    assert inc.prefill.shape[0] == 3 + 6 + 1 and inc.trailing.shape[0] == n  # n-1 text + E_eos
    assert whole.prefill.shape[0] == 3 + 6 + n + 2 and whole.trailing.shape[0] == 1
    assert torch.equal(whole.trailing[0], whole.pad)


def test_names_are_case_insensitive_and_dialect_overrides_auto(builders):
    b = builders["cv17"]
    lower = b.build(TEXT, VoiceSpec(speaker="ryan", language="english"))
    upper = b.build(TEXT, VoiceSpec(speaker="RYAN", language="English"))
    assert torch.equal(lower.prefill, upper.prefill)
    auto = b.build(TEXT, VoiceSpec(speaker="ryan", language="auto"))
    dialect = b.build(TEXT, VoiceSpec(speaker="Eric", language="auto"))
    assert dialect.prefill.shape[0] == auto.prefill.shape[0] + 1  # think form with the dialect id


def test_instruct_dropped_on_small_model(builders):
    b = builders["cv06"]
    plain = b.build(TEXT, VoiceSpec(speaker="serena"))
    instructed = b.build(TEXT, VoiceSpec(speaker="serena", instruct="Whisper."))
    assert torch.equal(plain.prefill, instructed.prefill)
    big = builders["cv17"]
    assert (big.build(TEXT, VoiceSpec(speaker="serena", instruct="Whisper.")).prefill.shape[0]
            > big.build(TEXT, VoiceSpec(speaker="serena")).prefill.shape[0])


def test_base_modes(builders):
    b = builders["base06"]
    xvec = np.zeros(48, dtype=np.float32)
    xonly = b.build(TEXT, VoiceSpec(xvector=xvec, xvector_only=True))
    assert xonly.prefill.shape[0] == 3 + 5 + 1  # nothink tags (3) + x-vector + pad rows
    codes = np.zeros((3, 16), dtype=np.int64)
    icl = b.build(TEXT, VoiceSpec(xvector=xvec, ref_codes=codes, ref_text="Hi there."))
    assert icl.prefill.shape[0] == 3 + 5 + 4  # streaming ICL: |Y| = 1 + 3 rows
    assert icl.trailing.shape[0] > 1


@pytest.mark.parametrize("name,voice,match", [
    ("cv17", VoiceSpec(speaker="nobody"), "unknown speaker"),
    ("cv17", VoiceSpec(), "needs a speaker"),
    ("cv17", VoiceSpec(speaker="ryan", language="klingon"), "unsupported language"),
    ("cv17", VoiceSpec(speaker="ryan", language="beijing_dialect"), "unsupported language"),
    ("cv17", VoiceSpec(speaker="ryan", text_mode="chunked"), "text_mode"),
    ("vd17", VoiceSpec(speaker="ryan", instruct="x"), "no named speakers"),
    ("vd17", VoiceSpec(), "instruct"),
    ("base06", VoiceSpec(xvector_only=True), "x-vector"),
    ("base06", VoiceSpec(xvector=np.zeros(7), xvector_only=True), "shape"),
    ("base06", VoiceSpec(xvector=np.zeros(48)), "ref_codes"),
    ("base06", VoiceSpec(xvector=np.zeros(48), ref_codes=np.zeros((3, 8)), ref_text="a"), "shape"),
    ("base06", VoiceSpec(xvector=np.zeros(48), ref_codes=np.full((3, 16), 4096), ref_text="a"),
     "values"),
    ("base06", VoiceSpec(xvector=np.zeros(48), xvector_only=True, instruct="x"), "instruct"),
])
def test_invalid_voices(builders, name, voice, match):
    """`validate` (what Engine.add runs) refuses exactly what `build` refuses, with the same message."""
    with pytest.raises(InvalidRequest, match=match):
        builders[name].validate(voice)
    with pytest.raises(InvalidRequest, match=match):
        builders[name].build(TEXT, voice)


def test_empty_text_rejected(builders):
    with pytest.raises(InvalidRequest, match="empty"):
        builders["cv17"].build("", VoiceSpec(speaker="ryan"))


def test_embed_text_is_the_trailing_row(builders):
    b = builders["cv17"]
    prompt = b.build(TEXT, VoiceSpec(speaker="ryan", text_mode="incremental"))
    ids = b.target_ids(TEXT)[3:-5]
    # one row vs a batch of rows: same math, GEMM blocking may differ in the last bit
    assert torch.allclose(b.embed_text(ids[1:2])[0], prompt.trailing[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("ref_text, frames", [("Hi there, this is a much longer transcript of it.", 2),
                                              ("Hi.", 5), ("Hi.", 40)])
def test_icl_split_matches_the_engine_text_feed(builders, ref_text, frames):
    """Streamed Base ICL: the engine's text feed (ids, `TextFeed`) and the prompt (embedding rows)
    split the text track ref ⧺ text ⧺ tts_eos at the same row (`icl_prefill_rows`)."""
    from q3tts.engine.text_feed import TextFeed
    from q3tts.engine.text_stream import TextStream
    from q3tts.models.prompt import icl_prefill_rows

    b = builders["base06"]
    voice = VoiceSpec(xvector=np.zeros(48, np.float32), ref_codes=np.zeros((frames, 16), np.int64),
                      ref_text=ref_text, text_mode="incremental")
    prompt = b.build(TEXT, voice)
    feed = TextFeed("incremental", TextStream(b.tokenizer.encode), b.ref_ids(ref_text),
                    icl_prefill_rows(frames), eos_id=b.config.tts_eos_id)
    feed.add(TEXT, done=True)
    assert prompt.prefill.shape[0] == 3 + 5 + icl_prefill_rows(frames)  # tags + x-vector + pad/bos, then x + y
    if not feed.trailing:  # the whole track fits in the prompt: E_pad from frame 0
        assert len(b.ref_ids(ref_text)) + len(b.target_ids(TEXT)) - 8 + 1 <= icl_prefill_rows(frames)
        assert prompt.trailing.shape[0] == 1 and torch.equal(prompt.trailing[0], prompt.pad)
        return
    assert feed.trailing[-1] == b.config.tts_eos_id and prompt.trailing.shape[0] == len(feed.trailing)
    rows = torch.cat((b.embed_text(feed.trailing[:-1]), b.special_embeds()[1]))  # the feed's ids, embedded
    torch.testing.assert_close(rows, prompt.trailing, rtol=0, atol=1e-6)


@pytest.mark.parametrize("ids", [torch.tensor(3), torch.tensor([3, 7, 3]), torch.randint(0, 10, (2, 16, 3))[:, 5]],
                         ids=["0-dim", "1-dim", "strided column"])
def test_rows_at_is_the_embedding_reads_nothing_back_and_copies_no_ids(ids):
    table = torch.randn(10, 4)
    with HostReads() as host:
        rows = rows_at(table, ids)
    assert host.reads == []  # a 0-dim index through table[ids] was an item()
    if ids.dim():
        assert host.ops == ["aten.index.Tensor"]  # one gather, the codec's strided code columns not copied first
    assert torch.equal(rows, torch.nn.functional.embedding(ids, table))


def test_building_a_prompt_reads_nothing_back(tmp_path):
    """The CustomVoice speaker row came from a 0-dim id: a host read (a CUDA sync) on the first admission of each
    voice (a fresh builder: the prompt heads are cached per voice)."""
    builder = _builder(tmp_path, "custom_voice", "1.7b", 1)
    with HostReads() as host:
        builder.build(TEXT, VoiceSpec(speaker="ryan", language="english"))
    assert host.reads == []
