"""EngineConfig.fp32_residual: the talker's and code predictor's residual stream kept in fp32.

How far it moves bf16 toward the fp32 model is tests/perf/test_fidelity.py's; here: in fp32 it changes no
bit (the stream is fp32 already; the first layer's h = x + 0 is x), the switch reaches both stacks, and the
fused paths, which round the stream, do not serve it even where their kernels run (the interpreter)."""

from __future__ import annotations

import pytest

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.models.code_predictor_fused import FusedCodePredictor  # imports triton
from q3tts.models.talker_fused import FusedTalker

TEXTS = ("Hello there.", "A second, somewhat longer sentence to speak.")


def _run(ckpt_dir, speaker, fp32_residual: bool) -> tuple[Engine, dict[str, list[list[int]]]]:
    cfg = EngineConfig(device="cpu", dtype="float32", num_pages=64, max_slots=2, max_frames=6,
                       max_prompt_tokens=128, max_text_tokens=64, graph_batch_sizes=(2,),
                       use_cuda_graphs=False, fused_talker=2, fp32_residual=fp32_residual)
    engine = Engine(str(ckpt_dir), cfg, with_codec=False)
    for i, text in enumerate(TEXTS):
        engine.add(f"s{i}", VoiceSpec(speaker=speaker), SamplingParams(greedy=i == 0, seed=i, max_frames=5),
                   text, True)
    codes: dict[str, list[list[int]]] = {}
    while engine.has_work():
        for out in engine.step():
            codes.setdefault(out.seq_id, []).extend(out.codes.tolist())
    return engine, codes


def test_fp32_residual_changes_no_fp32_bit_and_turns_the_fused_paths_off(tiny_ckpt_dir, speaker, monkeypatch):
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")  # the eager stacks on the torch references
    _, want = _run(tiny_ckpt_dir, speaker, False)
    fused_calls: list[str] = []
    for cls, name in ((FusedCodePredictor, "generate"), (FusedTalker, "forward")):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _f=original, _n=name: fused_calls.append(_n) or _f(self, *a))
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")  # the fused kernels would serve (interpreter): not this stream
    engine, got = _run(tiny_ckpt_dir, speaker, True)
    assert sorted(got) == ["s0", "s1"] and got == want
    talker = engine.runner.talker
    assert talker.model.fp32_residual and talker.code_predictor.model.fp32_residual
    assert talker.code_predictor._fused is not None and talker._fused is not None  # switched on, yet unused
    assert fused_calls == []
    with pytest.raises(ValueError, match="fp32_residual must be true or false"):
        EngineConfig(fp32_residual="yes")
