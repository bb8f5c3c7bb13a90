"""perf/floor.py: the bytes a decode step must read, checked against counts made from the model's shapes
(the parameter formula of a Qwen3 decoder layer), not from the modules the code under test walks."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from floor import StepBytes  # noqa: E402

from q3tts.checkpoint.maker import make_checkpoint  # noqa: E402
from q3tts.checkpoint.presets import model_config_dict  # noqa: E402
from q3tts.config import ModelConfig  # noqa: E402
from q3tts.engine.config import EngineConfig  # noqa: E402
from q3tts.engine.engine import Engine  # noqa: E402
from q3tts.models.attention import PagedKVCache  # noqa: E402
from q3tts.models.tts_model import Qwen3TTS  # noqa: E402

TEXT_IDS = dict(im_start=1, im_end=2, assistant=3, tts_pad=4, tts_bos=5, tts_eos=6)
CODEBOOK = 2048  # each code predictor head scores one codebook
CODEC_VOCAB = 3072  # the talker's codec head


def layer_params(c) -> int:
    """One decoder layer: q, k, v, o projections, gate / up / down, two RMSNorms over the hidden size and the
    q / k norms over a head."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size + 2 * h + 2 * c.head_dim


def shapes_count(cfg) -> tuple[int, int]:
    """(talker parameters one step reads, code predictor parameters one frame reads) from the config."""
    t, c = cfg.talker.layers, cfg.talker.code_predictor
    talker = t.num_layers * layer_params(t) + t.hidden_size + t.hidden_size * CODEC_VOCAB
    passes = cfg.talker.num_code_groups - 1
    one_pass = (c.num_layers * layer_params(c) + c.hidden_size  # layers + final norm
                + t.hidden_size * c.hidden_size + c.hidden_size)  # input projection, with its bias
    return talker, passes * one_pass + passes * c.hidden_size * CODEBOOK


def test_released_1_7b_step_reads_5_3_gb_of_weights_and_112_kib_of_kv_per_token():
    cfg = ModelConfig.from_dict(model_config_dict("custom_voice", "1.7b", "full", TEXT_IDS, 1000))
    with torch.device("meta"):
        model = Qwen3TTS(cfg).to(torch.bfloat16)
    lc = cfg.talker.layers
    kv = PagedKVCache(lc.num_layers, 1, 1, lc.num_kv_heads, lc.head_dim, torch.bfloat16, "meta")
    got = StepBytes.of_runner(SimpleNamespace(talker=model.talker, kv=kv, codec=None))
    talker, cp = shapes_count(cfg)
    assert (talker, cp) == (1_415_701_504, 1_242_766_080)  # the 1.7B's shapes: 28 layers of 2048, 5 of 1024
    assert got.weights == 2 * (talker + cp)  # bf16: 5.317 GB
    assert got.per_token == 28 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16 = 112 KiB
    assert got.per_row == 0
    assert got.floor_ms(1, 0) == pytest.approx(1e3 * 5_316_935_168 / 4.8e12)


def test_an_engines_step_adds_its_codec_and_each_rows_kv_and_stream_state(tmp_path):
    ckpt = make_checkpoint(tmp_path / "cv", "custom_voice", "1.7b", "tiny", seed=0)
    engine = Engine(str(ckpt), EngineConfig(device="cpu", dtype="float32", max_slots=2, max_queue=2,
                                            num_pages=64, max_frames=16, max_prompt_tokens=128,
                                            max_text_tokens=64))
    runner = engine.runner
    got = StepBytes.of_runner(runner)
    talker, cp = shapes_count(engine.checkpoint.config)
    codec = runner.codec
    # the codec decoder's tensors as the checkpoint stores them (fp32 here, as the engine holds them)
    codec_weights = sum(t.numel() for k, t in engine.checkpoint.codec_weights.items() if k.startswith("decoder."))
    assert got.weights == 4 * (talker + cp + codec_weights)
    lc = engine.checkpoint.config.talker.layers
    assert got.per_token == lc.num_layers * 2 * lc.num_kv_heads * lc.head_dim * 4
    # a stream's state: one row of each of the pool's state tensors ([streams + 1, ...] each)
    assert got.per_row == sum(t[0].numel() * t.element_size() for t in codec.pool) > 0
    assert got.total(3, 100) == got.weights + 3 * got.per_row + 100 * got.per_token
