"""Incremental tokenization of text that arrives in pieces.

The reference tokenizes the whole target string `<|im_start|>assistant\\n{text}<|im_end|>\\n...` at
once and keeps ids[3:-5] as the text tokens (spec b.3). To feed tokens before the text is complete
and still get exactly those ids, `TextStream` commits only tokens that later text cannot change:
byte-level BPE merges never cross a pre-token boundary of the Qwen2 split regex, and every pre-token
except the last one is fixed once a following pre-token has started. So the last pre-token (a word
that may grow, a whitespace run whose split depends on what follows) is held back until more text
or `end()` arrives. As a guard the committed ids are also the common prefix of the tokenization
with and without the held-back tail.
"""

from __future__ import annotations

from typing import Callable

from tokenizers import Regex, pre_tokenizers

from q3tts.models.prompt import ROLE_TOKENS as HEAD_IDS
from q3tts.models.prompt import TARGET_HEAD, TARGET_TAIL
from q3tts.models.prompt import TARGET_TAIL_TOKENS as TAIL_IDS

QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_SPLIT = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")


class TextStreamError(ValueError):
    """Committed tokens disagree with the final tokenization (cannot happen for Qwen2 BPE)."""


class TextStream:
    """Text of one request, tokenized as it arrives. `ids` = committed text token ids T0, T1, ..."""

    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self.encode = encode
        self.text = ""
        self.done = False
        self.ids: list[int] = []

    def append(self, piece: str) -> list[int]:
        """Add text; return the ids that became final because of it."""
        assert not self.done, "TextStream: append after end"
        self.text += piece
        segment = "assistant\n" + self.text  # the regex runs over the role word + text as one span
        parts = _SPLIT.pre_tokenize_str(segment)
        cut = parts[-1][1][0] if parts else 0
        if cut <= len("assistant\n"):
            return []
        stable = self._text_ids(segment[:cut])
        full = self._text_ids(segment)
        n = 0
        while n < min(len(stable), len(full)) and stable[n] == full[n]:
            n += 1
        return self._commit(full[:n])

    def end(self) -> list[int]:
        """No more text: return the remaining ids (the whole-text tokenization minus what was committed)."""
        self.done = True
        ids = self.encode(TARGET_HEAD + self.text + TARGET_TAIL)[HEAD_IDS:-TAIL_IDS]
        return self._commit(ids)

    def _text_ids(self, segment: str) -> list[int]:
        return self.encode("<|im_start|>" + segment)[HEAD_IDS:]

    def _commit(self, ids: list[int]) -> list[int]:
        k = len(self.ids)
        if len(ids) < k:
            if ids != self.ids[:len(ids)]:
                raise TextStreamError(f"incremental tokenization diverged: committed {self.ids}, now {ids}")
            return []
        if ids[:k] != self.ids:
            raise TextStreamError(f"incremental tokenization diverged: committed {self.ids}, now {ids[:k]}")
        new = ids[k:]
        self.ids.extend(new)
        return new
