"""Text tokenizer: Qwen2 byte-level BPE from vocab.json + merges.txt + tokenizer_config.json (spec g).

`TextTokenizer` rebuilds with the `tokenizers` library exactly the pipeline that transformers'
`Qwen2TokenizerFast` converts to at load time (NFC, Qwen2 split regex, byte-level without its own
regex, added tokens matched before BPE). `train_tiny_tokenizer` writes a small BPE in the same file
layout for test checkpoints, with the 33 added tokens in the released order right after the base vocab.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import trainers

SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Added tokens 151643..151675 in the released order; False = added but not special (as Qwen3).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
)

# Small multilingual corpus for the tiny test tokenizer (covers the prompt words and common scripts).
_CORPUS = (
    "<|im_start|>assistant\nHello world, this is a test of the speech system.<|im_end|>\n",
    "<|im_start|>user\nSpeak slowly and clearly with a warm, friendly voice.<|im_end|>\n",
    "The quick brown fox jumps over the lazy dog. It's 12:30 and we'll be there in 45 minutes!",
    "A deep male voice, calm and gentle; a young female voice, bright and energetic.",
    "今天天气很好，我们去公园散步吧。你好，世界！我叫通义千问。",
    "こんにちは、世界。今日はいい天気ですね。ありがとうございます。",
    "안녕하세요, 세계. 오늘 날씨가 좋네요. 감사합니다.",
    "Привет, мир! Как дела? Сегодня хорошая погода.",
    "Bonjour le monde, comment ça va ? Très bien, merci. Hallo Welt, wie geht's? Sehr gut.",
    "Hola mundo, ¿cómo estás? Ciao mondo, come stai? Olá mundo, tudo bem?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2026-11-29\n\n  indented line\ttab",
)


def _added_token(content: str, special: bool) -> AddedToken:
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                      special=special)


def build_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]],
                    added: dict[int, AddedToken]) -> Tokenizer:
    """The Qwen2 fast-tokenizer pipeline over a given vocab, merge list and added tokens."""
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    for token_id in sorted(added):
        tok.add_tokens([added[token_id]])
        got = tok.token_to_id(added[token_id].content)
        if got != token_id:
            raise ValueError(f"added token {added[token_id].content!r}: expected id {token_id}, "
                             f"got {got}")
    return tok


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line or line.startswith("#version"):
            continue
        left, right = line.split(" ")
        merges.append((left, right))
    return merges


class TextTokenizer:
    """Qwen2 byte-level BPE: `encode(str) -> list[int]` identical to the reference's fast tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        """Load from a folder holding vocab.json, merges.txt and tokenizer_config.json."""
        path = Path(path)
        vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
        merges = _read_merges(path / "merges.txt")
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        added = {int(i): _added_token(t["content"], bool(t.get("special", True)))
                 for i, t in config.get("added_tokens_decoder", {}).items()}
        return cls(build_tokenizer(vocab, merges, added))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no BOS/EOS added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens."""
        return self._tok.get_vocab_size(with_added_tokens=True)


def _tokenizer_config(added_ids: dict[str, int]) -> dict:
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    decoder = {str(added_ids[c]): {"content": c, **flags, "special": special}
               for c, special in ADDED_TOKENS}
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 400) -> dict[str, int]:
    """Train a small byte-level BPE and write vocab.json, merges.txt, tokenizer_config.json.

    The added tokens take ids `len(base vocab) ..` in the released order. Returns the ids the
    config.json needs: im_start, im_end, assistant, tts_pad, tts_bos, tts_eos, plus `vocab_size`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specials = [c for c, _ in ADDED_TOKENS]
    trainer_tok = build_tokenizer({}, [], {})
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [_strip_specials(line, specials) for line in _CORPUS]
    roles = ["assistant\nuser\n"] * 32  # the prompt's role words must become single tokens
    trainer_tok.train_from_iterator(corpus * 4 + roles, trainer=trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    added_ids = {c: len(vocab) + i for i, c in enumerate(specials)}
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(added_ids), indent=2, ensure_ascii=False), encoding="utf-8")
    tok = TextTokenizer.from_dir(out_dir)
    return {
        "im_start": added_ids["<|im_start|>"], "im_end": added_ids["<|im_end|>"],
        "assistant": _single_id(tok, "assistant"), "tts_pad": added_ids["<tts_pad>"],
        "tts_bos": added_ids["<tts_text_bos>"], "tts_eos": added_ids["<tts_text_eod>"],
        "vocab_size": tok.vocab_size,
    }


def _strip_specials(line: str, specials: list[str]) -> str:
    for s in specials:
        line = line.replace(s, "\n")
    return line


def _single_id(tok: TextTokenizer, word: str) -> int:
    ids = tok.encode(word)
    if len(ids) != 1:
        raise ValueError(f"tiny tokenizer must hold {word!r} as one token, got {ids}")
    return ids[0]
