"""perf/peers/run.py on CPU with the tiny checkpoint, where the peers' packages are installed
(`bash perf/peers/site.sh cpu run/peers_cpu_site`, or Q3TTS_PEERS_SITE): qwen-tts-hf loads our checkpoint and
its rows land in the results CSV; faster-qwen3-tts refuses a machine without CUDA with one clear error."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import tiny_checkpoint  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("Q3TTS_PEERS_SITE", ROOT / "run" / "peers_cpu_site"))
pytestmark = [pytest.mark.skipif(not (SITE / "qwen_tts").is_dir(),
                                 reason=f"no peers' site at {SITE} (bash perf/peers/site.sh cpu {SITE})"),
              pytest.mark.timeout(900)]


def peer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "perf/peers/run.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=800, env={**os.environ, "PYTHONPATH": str(SITE), "HF_HUB_OFFLINE": "1"})


def test_official_peer_loads_our_checkpoint_and_writes_rows(tiny_checkpoint, tmp_path):  # noqa: F811
    out = peer("--peer", "qwen-tts-hf", "--checkpoint", str(tiny_checkpoint), "--batches", "1,2", "--max-frames", "3",
               "--repeats", "1", "--csv", str(tmp_path / "p.csv"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    with (tmp_path / "p.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["level"], r["streams"], r["errors"]) for r in rows] == [
        ("peer:qwen-tts-hf", "1", "1", "0"), ("peer:qwen-tts-hf", "2", "2", "0")]
    for r in rows:  # no audio streaming: the first audio is the whole batch
        assert float(r["ttfa_p50_ms"]) == float(r["e2e_p95_ms"]) > 0 and float(r["audio_s_per_s"]) > 0


def test_faster_peer_refuses_a_machine_without_cuda(tiny_checkpoint):  # noqa: F811
    out = peer("--peer", "faster-qwen3-tts", "--checkpoint", str(tiny_checkpoint), "--device", "cpu")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("faster-qwen3-tts runs only on CUDA")
