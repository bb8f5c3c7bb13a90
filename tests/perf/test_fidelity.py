"""perf/fidelity.py on CPU with a tiny 1.7B CustomVoice checkpoint: fp32 against fp32 gives
identical figures and passes every gate; noise on the low side's weights fails every gate (exit 1
with --gates); teacher forcing feeds the given codes through the code predictor."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import fidelity  # noqa: E402

from q3tts.checkpoint.maker import make_checkpoint  # noqa: E402

FRAMES = 12
GATE_ROWS = ("talker logits cosine, min", "greedy c0 agreement (teacher-forced)",
             "streamed codec SNR")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fidelity") / "cv-1.7b-tiny"
    make_checkpoint(out, "custom_voice", "1.7b", "tiny", seed=0)
    return out


def cli(checkpoint: Path, *extra: str) -> list[str]:
    return ["--model", str(checkpoint), "--device", "cpu", "--dtype", "float32",
            "--frames", str(FRAMES), *extra]


def gate_results(text: str) -> dict[str, str]:
    """Row label -> PASS / FAIL of the three gate rows of the printed table."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        for label in GATE_ROWS:
            if cells[0].startswith(label):
                out[label] = cells[3]
    return out


def test_fp32_against_fp32_is_exact_and_passes(checkpoint, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = fidelity.parse_args(cli(checkpoint))
    f = fidelity.measure(args, checkpoint)
    assert f["cos_min"] == pytest.approx(1.0, abs=1e-12)
    assert f["cos_mean"] == pytest.approx(1.0, abs=1e-12)
    assert f["agree_forced"] == 1.0 and f["agree_free"] == 1.0 and f["first_divergence"] is None
    assert math.isinf(f["snr_db"])
    assert fidelity.main(cli(checkpoint, "--gates")) == 0
    printed = capsys.readouterr().out
    assert gate_results(printed) == dict.fromkeys(GATE_ROWS, "PASS"), printed
    assert (tmp_path / "fidelity.md").is_file()
    assert not (tmp_path / "fidelity.csv").exists()  # CSV rows come from CUDA runs only


def test_perturbed_low_side_fails_every_gate(checkpoint, capsys):
    assert fidelity.main(cli(checkpoint, "--perturb", "0.3")) == 0  # figures only
    printed = capsys.readouterr().out
    assert gate_results(printed) == dict.fromkeys(GATE_ROWS, "FAIL"), printed
    assert fidelity.main(cli(checkpoint, "--perturb", "0.3", "--gates")) == 1


def test_teacher_forcing_feeds_the_given_codes(checkpoint):
    side = fidelity.load_side(checkpoint, torch.float32, "cpu")
    cfg = side.model.config.talker
    gen = torch.Generator().manual_seed(1)
    forced = torch.randint(0, cfg.codebook_size, (4, cfg.num_code_groups), generator=gen)
    logits, codes = fidelity.run_talker(side, 4, forced=forced)
    assert torch.equal(codes, forced)
    _, greedy = fidelity.run_talker(side, 4)
    assert not torch.equal(greedy, forced)  # the forced codes are not what the model draws itself
    assert logits.shape == (4, cfg.vocab_size) and torch.isfinite(logits).all()


def test_fp32_residual_moves_bf16_closer_to_fp32(checkpoint):
    """--fp32-residual (EngineConfig.fp32_residual on the bf16 low side): keeping the residual stream in fp32
    brings the talker logits closer to the fp32 reference than rounding it to bf16 (deterministic here; on
    the real-size checkpoint it is the difference between failing and passing the gates:
    perf/results/RESULTS.md)."""
    bf16 = ["--dtype", "bfloat16"]
    plain = fidelity.measure(fidelity.parse_args(cli(checkpoint, *bf16)), checkpoint)
    kept = fidelity.measure(fidelity.parse_args(cli(checkpoint, *bf16, "--fp32-residual")), checkpoint)
    assert kept["cos_mean"] > plain["cos_mean"] and kept["cos_min"] >= plain["cos_min"]


def test_disagreements_name_the_frames_and_the_gaps():
    """Row 1's argmax differs (reference picks 0 by 0.5; the low side picks 2 by 0.25): it is the one listed."""
    ref = torch.tensor([[3.0, 1.0, 0.0], [2.0, 1.5, 1.0], [0.0, 0.0, 1.0]])
    low = torch.tensor([[3.0, 1.0, 0.0], [2.0, 1.0, 2.25], [0.0, 0.0, 1.0]])
    assert fidelity.disagreements(ref, low) == [(1, 0.5, 0.25)]
    assert fidelity.disagreements(ref, ref) == []


def test_fp32_logits_are_the_unrounded_head(checkpoint):
    """--fp32-logits: the low side's talker scores are the head's fp32 product, not the bf16-rounded one, so
    they differ from the rounded scores and are not representable in bf16."""
    rounded = fidelity.load_side(checkpoint, torch.bfloat16, "cpu")
    exact = fidelity.load_side(checkpoint, torch.bfloat16, "cpu", fp32_logits=True)
    hidden = torch.randn(2, rounded.model.config.talker.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    a, b = rounded.model.talker.logits(hidden), exact.model.talker.logits(hidden)
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)  # the same product, bf16 rounding apart
    assert not torch.equal(b.to(torch.bfloat16).float(), b)  # values bf16 cannot hold: never rounded
    expected = hidden.float() @ exact.model.talker.codec_head.weight.float().t()
    torch.testing.assert_close(b, expected, rtol=0, atol=0)
