"""Prefill embeddings and the trailing text queue for every variant and text mode (spec b.3).

`PromptBuilder.build(text, voice) -> Prompt(prefill [L0, H], trailing [T, H], pad [H])`.
Decode step t adds `trailing[t]` (or `pad` once the queue is empty) to the talker input.
"incremental" = the reference's streaming-text mode (`non_streaming_mode=False`: one text token
enters per frame), "whole" = all text in the prefill. Embeddings are computed with the same
groupings as the official model so the results match it bit for bit in fp32.
`embed_text(ids)` is exposed for engines that append text tokens to a live queue; `ref_ids`,
`is_icl` and `icl_prefill_rows` for engines that feed Base ICL text as it arrives (the same split).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from q3tts.checkpoint.tokenizer import TextTokenizer
from q3tts.core import TEXT_MODES, InvalidRequest, VoiceSpec
from q3tts.models.transfer import upload
from q3tts.models.tts_model import Qwen3TTS
from q3tts_client import protocol as P

DEFAULT_TEXT_MODE = {"custom_voice": "whole", "voice_design": "whole", "base": "incremental"}
# the chat template around the text to speak (the one statement of it; engine/text_stream.py reads it too)
TARGET_HEAD = "<|im_start|>assistant\n"
TARGET_TAIL = "<|im_end|>\n<|im_start|>assistant\n"
REF_TAIL = "<|im_end|>\n"
ROLE_TOKENS = 3  # tokens of TARGET_HEAD: <|im_start|> assistant \n
TARGET_TAIL_TOKENS = 5  # tokens of TARGET_TAIL: <|im_end|> \n <|im_start|> assistant \n
_REF_TAIL = 2  # tokens of REF_TAIL: <|im_end|> \n
HEAD_CACHE_SIZE = 64  # kept prompt heads, LRU: each (instruct tokens + ~12) rows of H (~50 KiB without one)
ICL_NEEDS = "ICL voice cloning needs ref_codes [F, 16] and ref_text (input REF_TEXT), or set xvector_only"
# VoiceSpec field -> the request input or parameter that sets it (a registered VOICE sets ref_codes, xvector)
VOICE_INPUTS = {"speaker": P.INPUT_SPEAKER, "instruct": P.INPUT_INSTRUCT, "ref_audio": P.INPUT_REF_AUDIO,
                "ref_text": P.INPUT_REF_TEXT, "ref_codes": P.INPUT_VOICE, "xvector": P.INPUT_VOICE,
                "xvector_only": P.PARAM_XVECTOR_ONLY}


@dataclass
class Prompt:
    """prefill [L0, H]; trailing [T, H] text rows for decode steps 0..T-1; pad [H] = E_pad."""

    prefill: torch.Tensor
    trailing: torch.Tensor
    pad: torch.Tensor


@dataclass(frozen=True)
class VoiceTensors:
    """What a Base prompt takes from its voice, on the model's device (`PromptBuilder.voice_tensors`):
    made once per voice, so the prompts of a voice the engine keeps copy nothing of it from the host."""

    xvector: torch.Tensor  # [H], the model's dtype
    ref_codes: torch.Tensor | None  # [F, 16] int64 (ICL; None: x-vector only)
    ref_ids: list[int] | None  # the transcript's text ids (`ref_ids`; ICL)


def target_string(text: str) -> str:
    return TARGET_HEAD + text + TARGET_TAIL


def text_ids(target_ids: list[int]) -> list[int]:
    """The text's own tokens among `PromptBuilder.target_ids` (the chat template's head and tail cut off)."""
    return target_ids[ROLE_TOKENS:-TARGET_TAIL_TOKENS]


def ref_string(text: str) -> str:
    return TARGET_HEAD + text + REF_TAIL


def instruct_string(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def icl_prefill_rows(num_ref_frames: int) -> int:
    """Base ICL, streamed text: how many rows of the text track x = ref ids ⧺ text ids ⧺ [tts_eos]
    enter the prefill, added row by row to the codec track y = [codec_bos] ⧺ reference frames
    (F + 1 rows, spec b.3). The rows of x past them trail, one per frame; a shorter x is padded
    with E_pad. The one definition of the split, for prompts (embedding rows) and engines (ids)."""
    return num_ref_frames + 1


class PromptBuilder:
    """Builds prompts for one loaded model and its tokenizer."""

    def __init__(self, model: Qwen3TTS, tokenizer: TextTokenizer):
        self.model = model
        self.talker = model.talker
        self.config = model.config
        self.tcfg = model.config.talker
        self.tokenizer = tokenizer
        self.device = self.talker.codec_head.weight.device
        # the rows before the text body of a speaker / instruct voice, per (role ids, instruct, language,
        # speaker): a prompt then embeds only its text on the caller's thread (the engine's, between steps)
        self._heads = functools.lru_cache(maxsize=HEAD_CACHE_SIZE)(self._make_head)

    # ------------------------------------------------------------------ embeddings

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return upload(torch.tensor(ids, dtype=torch.int64), self.device)

    def embed_text(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """P(ids) -> [N, H]: the text-track rows of text tokens."""
        ids = ids if isinstance(ids, torch.Tensor) else self._ids(ids)
        return self.talker.embed_text(ids)

    def _codec(self, ids: list[int]) -> torch.Tensor:
        return self.talker.embed_codec(self._ids(ids))  # [N, H]

    def special_embeds(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(E_bos, E_eos, E_pad), each [1, H] (made once; read only)."""
        return self._special_rows

    @functools.cached_property
    def _special_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        return self.embed_text([c.tts_bos_id, c.tts_eos_id, c.tts_pad_id]).split(1, dim=0)

    @functools.cached_property
    def _whole_codec_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """"whole" text mode: C(codec_pad) [1, H] under every text row (ICL too), and the prefill's last row
        E_pad + C(codec_bos) [1, H]."""
        _, _, pad = self.special_embeds()
        return self._codec([self.tcfg.codec_pad_id]), pad + self._codec([self.tcfg.codec_bos_id])

    def target_ids(self, text: str) -> list[int]:
        """Token ids of the full target string (`text_ids` picks the text's own)."""
        return self.tokenizer.encode(target_string(text))

    def ref_ids(self, ref_text: str) -> list[int]:
        """Base ICL: the text ids of the reference transcript (the head of the text track)."""
        return self.tokenizer.encode(ref_string(ref_text))[ROLE_TOKENS:-_REF_TAIL]

    def is_icl(self, voice: VoiceSpec) -> bool:
        """Base voice cloning with the reference in the prompt (not x-vector only)."""
        return self.config.variant == "base" and not voice.xvector_only

    # ------------------------------------------------------------------ validation

    def text_mode(self, voice: VoiceSpec) -> str:
        mode = voice.text_mode or DEFAULT_TEXT_MODE[self.config.variant]
        if mode not in TEXT_MODES:
            raise InvalidRequest(f"text_mode must be one of {TEXT_MODES}, got {mode!r}")
        return mode

    def _language_id(self, voice: VoiceSpec) -> int | None:
        lang = (voice.language or "auto").lower()
        supported = sorted(k for k in self.tcfg.language_ids if "dialect" not in k)
        if lang != "auto" and lang not in supported:
            raise InvalidRequest(f"unsupported language {voice.language!r}; supported: auto, "
                                 + ", ".join(supported))
        lang_id = None if lang == "auto" else self.tcfg.language_ids[lang]
        dialect = self.tcfg.speaker_dialects.get((voice.speaker or "").lower(), False)
        if voice.speaker and lang in ("chinese", "auto") and dialect:
            lang_id = self.tcfg.language_ids[dialect]
        return lang_id

    def validate(self, voice: VoiceSpec, encoded: bool = True) -> None:
        """Raise InvalidRequest for a voice that `build` would refuse (speaker, language, instruct,
        clone inputs, text mode), without computing any embedding, or that gives a field the variant
        does not use (the request table's `variants`, q3tts_client.protocol: `build` ignores those, as the
        reference does). `encoded=False`: its reference audio is still to be encoded (the clone inputs
        that encoding makes are not checked)."""
        self.text_mode(voice)
        self._check_voice(voice, encoded)
        self._language_id(voice)
        given = [wire for name, wire in VOICE_INPUTS.items() if _given(getattr(voice, name))]
        try:
            P.check_variant(self.config.variant, self.config.size, given)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    def _check_voice(self, voice: VoiceSpec, encoded: bool = True) -> None:
        variant = self.config.variant
        if variant == "custom_voice":
            speakers = sorted(self.tcfg.speaker_ids)
            if not voice.speaker:
                raise InvalidRequest(f"CustomVoice needs a speaker; one of {', '.join(speakers)}")
            if voice.speaker.lower() not in self.tcfg.speaker_ids:
                raise InvalidRequest(
                    f"unknown speaker {voice.speaker!r}; known: {', '.join(speakers)}")
        elif voice.speaker:
            raise InvalidRequest(f"a {variant} model has no named speakers (got {voice.speaker!r})")
        if variant == "voice_design" and not voice.instruct:
            raise InvalidRequest("VoiceDesign needs `instruct`: the voice description")
        if variant == "base":
            self._check_clone(voice, encoded)

    def _check_clone(self, voice: VoiceSpec, encoded: bool) -> None:
        if voice.instruct:
            raise InvalidRequest("Base models take no instruct")
        if not encoded:
            if not (voice.xvector_only or voice.ref_text):
                raise InvalidRequest(ICL_NEEDS)
            return
        if voice.xvector is None:
            raise InvalidRequest("Base needs an x-vector (or ref_audio encoded into one first)")
        if np.asarray(voice.xvector).shape != (self.tcfg.hidden_size,):
            raise InvalidRequest(f"xvector must have shape [{self.tcfg.hidden_size}], "
                                 f"got {list(np.asarray(voice.xvector).shape)}")
        if voice.xvector_only:
            return
        if voice.ref_codes is None or not voice.ref_text:
            raise InvalidRequest(ICL_NEEDS)
        codes = np.asarray(voice.ref_codes)
        groups = self.tcfg.num_code_groups
        if codes.ndim != 2 or codes.shape[1] != groups or codes.shape[0] == 0:
            raise InvalidRequest(
                f"ref_codes must have shape [F>0, {groups}], got {list(codes.shape)}")
        if codes.min() < 0 or codes.max() >= self.tcfg.codebook_size:
            raise InvalidRequest(f"ref_codes values must lie in [0, {self.tcfg.codebook_size})")

    # ------------------------------------------------------------------ building

    @torch.no_grad()
    def voice_tensors(self, voice: VoiceSpec) -> VoiceTensors | None:
        """A checked Base voice's x-vector and (ICL) reference codes on the device, with its transcript's
        ids; None for the other variants (their voice is a speaker id or an instruction)."""
        if self.config.variant != "base":
            return None
        weight = self.talker.codec_head.weight
        xvector = upload(torch.as_tensor(np.asarray(voice.xvector)), weight.device).to(weight.dtype)
        if not self.is_icl(voice):
            return VoiceTensors(xvector, None, None)
        codes = upload(torch.as_tensor(np.asarray(voice.ref_codes), dtype=torch.int64), self.device)
        return VoiceTensors(xvector, codes, self.ref_ids(voice.ref_text))

    @torch.no_grad()
    def build(self, text: str, voice: VoiceSpec, tensors: VoiceTensors | None = None,
              ids: list[int] | None = None) -> Prompt:
        """The prompt of one request; raises InvalidRequest on a bad voice/text. `tensors`: the voice's
        `voice_tensors`, when the caller keeps them (else they are made here); `ids`: `target_ids(text)`,
        when the caller has them (else the text is tokenized here)."""
        self._check_voice(voice)
        mode = self.text_mode(voice)
        ids = self.target_ids(text) if ids is None else ids
        body_ids = text_ids(ids)
        if not body_ids:
            raise InvalidRequest("text is empty")
        _, eos, pad = self.special_embeds()
        tensors = tensors or self.voice_tensors(voice)
        if self.config.variant == "base":  # the x-vector row is the voice's own: nothing to keep
            head, codec_last = self._make_head(tuple(ids[:ROLE_TOKENS]), None, self._language_id(voice),
                                               None, tensors.xvector)
        else:
            instruct = None if self.config.drops_instruct else voice.instruct or None
            head, codec_last = self._heads(tuple(ids[:ROLE_TOKENS]), instruct, self._language_id(voice),
                                           voice.speaker and voice.speaker.lower())
        if self.is_icl(voice):
            body, trailing = self._icl_rows(body_ids, tensors, eos, pad, mode == "whole")
        elif mode == "whole":
            x = torch.cat((self.embed_text(body_ids), eos))  # [n + 1, H]
            codec_pad, last = self._whole_codec_rows
            body = torch.cat((x + codec_pad.expand(x.shape[0], -1), last))
            trailing = pad
        else:
            body = self.embed_text(body_ids[:1]) + codec_last
            trailing = torch.cat((self.embed_text(body_ids[1:]), eos))
        return Prompt(prefill=torch.cat((head, body)), trailing=trailing, pad=pad[0])

    def _make_head(self, role_ids: tuple[int, ...], instruct: str | None, lang_id: int | None,
                   speaker: str | None, xvector: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt rows before the text body -> (head [K0, H]: instruct rows, role rows, the codec prefix
        but its last row over E_pad.. E_bos; that last codec row [1, H]). Read only once kept."""
        bos, _, pad = self.special_embeds()
        codec = self._codec_prefix(lang_id, speaker, xvector)  # [K, H]
        rows = [self._instruct_rows(instruct), self.embed_text(list(role_ids)),
                torch.cat((pad.expand(codec.shape[0] - 2, -1), bos)) + codec[:-1]]
        return torch.cat([r for r in rows if r is not None]), codec[-1:]

    def _instruct_rows(self, instruct: str | None) -> torch.Tensor | None:
        return None if instruct is None else self.embed_text(self.tokenizer.encode(instruct_string(instruct)))

    def _codec_prefix(self, lang_id: int | None, speaker: str | None,
                      xvector: torch.Tensor | None) -> torch.Tensor:
        """[think/nothink tags ..., speaker row (CustomVoice) or x-vector (Base)?, pad, bos] codec
        embeddings -> [K, H]."""
        t = self.tcfg
        tags = ([t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id] if lang_id is None
                else [t.codec_think_id, t.codec_think_bos_id, lang_id, t.codec_think_eos_id])
        parts = [self._codec(tags)]
        if self.config.variant == "custom_voice":
            parts.append(self._codec([t.speaker_ids[speaker]]))  # [1, H]
        elif self.config.variant == "base":
            parts.append(xvector[None])
        parts.append(self._codec([t.codec_pad_id, t.codec_bos_id]))
        return torch.cat(parts)

    def ref_code_embeds(self, codes: torch.Tensor) -> torch.Tensor:
        """[F, 16] int64 codes on the device -> [F, H]: sum over groups of talker C (group 0) and cp
        tables (1..15)."""
        cp_tables = self.talker.code_predictor.model.codec_embedding
        tables = [self.talker.model.codec_embedding, *cp_tables]
        per_group = [table(codes[:, g]) for g, table in enumerate(tables)]  # 16 x [F, H]
        return torch.stack(per_group, dim=1).sum(1)

    def _icl_rows(self, body_ids: list[int], tensors: VoiceTensors, eos: torch.Tensor, pad: torch.Tensor,
                  whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
        track = tensors.ref_ids + body_ids
        x = torch.cat((self.embed_text(track), eos))  # [n_r + n + 1, H]
        y = torch.cat((self._codec([self.tcfg.codec_bos_id]),
                       self.ref_code_embeds(tensors.ref_codes)))  # [F + 1, H]
        if whole:
            codec_pad, _ = self._whole_codec_rows
            body = torch.cat((x + codec_pad.expand(x.shape[0], -1), y + pad))
            return body, pad
        cut = icl_prefill_rows(len(tensors.ref_codes))  # = y.shape[0]
        if x.shape[0] > cut:
            return x[:cut] + y, x[cut:]
        x = torch.cat((x, pad.expand(cut - x.shape[0], -1)))
        return x + y, pad


def _given(value) -> bool:
    """Whether a VoiceSpec field was set (None, "" and False are its unset values; arrays are set)."""
    return value is not None and not (isinstance(value, (str, bool)) and not value)
