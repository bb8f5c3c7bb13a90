"""TextTokenizer equals the reference's Qwen2TokenizerFast (converted from the same vocab/merges)."""

from __future__ import annotations

import json

import pytest

from q3tts.checkpoint.tokenizer import ADDED_TOKENS, TextTokenizer, train_tiny_tokenizer

STRINGS = [
    "<|im_start|>assistant\nHello world, this is a test.<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces and trailing   ",
    "\nstarts with a newline\n\n\nand blank lines\r\n",
    "digits 1234567890 3.14159 2026-11-29 and 12:30",
    "今天天气很好，我们去公园散步吧。",
    "こんにちは、世界。안녕하세요. Привет, мир!",
    "Café naïve e\u0301 (combining) ﬁ ligature Ｆｕｌｌｗｉｄｔｈ",
    "it's we'LL they'Re I'M you'd",
    "tabs\tand\tmixed \t \n whitespace",
    "emoji 😀🎉 and symbols ©®™ <tts_pad><tts_text_bos>x<|audio_pad|>",
    "<|im_start|>user\nSpeak slowly.<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(path)
    return path


def test_added_tokens_follow_base_vocab_in_released_order(tok_dir):
    vocab = json.loads((tok_dir / "vocab.json").read_text())
    tok = TextTokenizer.from_dir(tok_dir)
    assert len(ADDED_TOKENS) == 33
    for offset, (content, _) in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(content) == len(vocab) + offset
    assert tok.token_to_id("<tts_pad>") - tok.token_to_id("<|endoftext|>") == 151671 - 151643


def test_matches_reference_fast_tokenizer(tok_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.Qwen2TokenizerFast.from_pretrained(str(tok_dir))
    tok = TextTokenizer.from_dir(tok_dir)
    for text in STRINGS:
        assert tok.encode(text) == ref(text)["input_ids"], text


def test_roundtrip_decode(tok_dir):
    tok = TextTokenizer.from_dir(tok_dir)
    for text in STRINGS[1:5]:
        assert tok.decode(tok.encode(text)) == text
