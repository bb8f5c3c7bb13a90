"""Run the official model's `generate` greedily for one request and capture its talker prefill.

Calls `Qwen3TTSForConditionalGeneration.generate` with inputs tokenized by the official wrapper's own
helpers (the wrapper's audio decode is skipped: only codes are compared). The talker's
`inputs_embeds` / `trailing_text_hidden` are captured by wrapping `talker.generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from q3tts.core import VoiceSpec


@dataclass
class ReferenceRun:
    prefill: torch.Tensor  # [L0, H]
    trailing: torch.Tensor  # [T, H]
    codes: torch.Tensor  # [frames, 16]


def _voice_kwargs(wrapper, variant: str, voice: VoiceSpec) -> dict:
    model = wrapper.model
    kwargs: dict = {"languages": [voice.language or "auto"]}
    if variant in ("custom_voice", "voice_design"):
        instruct = None if model.tts_model_size in "0b6" and variant == "custom_voice" else voice.instruct
        kwargs["instruct_ids"] = [wrapper._tokenize_texts([wrapper._build_instruct_text(instruct)])[0]
                                  if instruct else None]
        if variant == "custom_voice":
            kwargs["speakers"] = [voice.speaker]
        return kwargs
    icl = not voice.xvector_only
    kwargs["voice_clone_prompt"] = {
        "ref_code": [torch.as_tensor(np.asarray(voice.ref_codes), dtype=torch.long) if icl else None],
        "ref_spk_embedding": [torch.as_tensor(np.asarray(voice.xvector), dtype=torch.float32)],
        "x_vector_only_mode": [voice.xvector_only], "icl_mode": [icl],
    }
    kwargs["ref_ids"] = [wrapper._tokenize_texts([wrapper._build_ref_text(voice.ref_text)])[0]
                         if icl else None]
    return kwargs


@torch.no_grad()
def run_reference(wrapper, variant: str, text: str, voice: VoiceSpec, whole: bool,
                  frames: int) -> ReferenceRun:
    """Greedy reference run producing `frames` frames (max_new_tokens = frames + 1)."""
    model = wrapper.model
    captured = {}
    original = model.talker.generate

    def capture(*args, **kw):
        captured["prefill"] = kw["inputs_embeds"][0].clone()
        captured["trailing"] = kw["trailing_text_hidden"][0].clone()
        return original(*args, **kw)

    model.talker.generate = capture
    try:
        codes, _ = model.generate(
            input_ids=wrapper._tokenize_texts([wrapper._build_assistant_text(text)]),
            non_streaming_mode=whole, max_new_tokens=frames + 1, do_sample=False,
            subtalker_dosample=False, **_voice_kwargs(wrapper, variant, voice))
    finally:
        del model.talker.generate  # drop the instance attribute, back to the class method
    return ReferenceRun(prefill=captured["prefill"], trailing=captured["trailing"], codes=codes[0])
