"""Session fixtures for the codec tests: one tiny random speech_tokenizer folder, our codec loaded from
it, and (for `oracle` tests) the official tokenizer loaded from the same folder."""

from __future__ import annotations

import pytest
import torch

from q3tts.codec import load_codec, read_speech_tokenizer, write_speech_tokenizer

SEED = 1234
FRAMES = 100  # > sliding window 72: the KV window is exercised


def _import_official():
    import oracle  # noqa: PLC0415  (tests/ is on sys.path: rootdir-relative import mode)

    return oracle.import_qwen_tts()


@pytest.fixture(scope="session")
def codec_dir(tmp_path_factory):
    return write_speech_tokenizer(tmp_path_factory.mktemp("ckpt"), "tiny", SEED)


@pytest.fixture(scope="session")
def codec(codec_dir):
    return load_codec(*read_speech_tokenizer(codec_dir), dtype=torch.float32)


@pytest.fixture(scope="session")
def qwen_tts():
    return _import_official()


@pytest.fixture(scope="session")
def ref_tokenizer(qwen_tts, codec_dir):
    return qwen_tts.Qwen3TTSTokenizer.from_pretrained(str(codec_dir))


@pytest.fixture(scope="session")
def codes():
    """Random codes for 3 streams: [3, 16, FRAMES]."""
    return torch.randint(0, 2048, (3, 16, FRAMES), generator=torch.Generator().manual_seed(SEED))


@pytest.fixture(scope="session")
def ref_pcm(ref_tokenizer, codes):
    """The official decode of each stream of `codes`: [3, FRAMES·1920]."""
    wavs, sr = ref_tokenizer.decode({"audio_codes": [c.T for c in codes]})
    assert sr == 24000
    return torch.stack([torch.from_numpy(w) for w in wavs])
