"""perf/tune_chain.py's coordinate descent on a made-up cost (the GPU chain it times has no CPU form), and the
candidates `kernels.autotune.pick` remembers for it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from q3tts.kernels import autotune

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from tune_chain import descend  # noqa: E402

# two keys whose best choices interact: b's best is 2 when a is 3, else 1
KEYS = {"a": (1, 2, 3), "b": (0, 1, 2)}


def cost(table) -> float:
    a, b = table["a"], table["b"]
    return 10.0 - 2 * a + (abs(b - 2) if a == 3 else abs(b - 1))


def test_descent_reaches_the_joint_best_and_logs_each_change():
    calls = []
    tuned, changes = descend(KEYS, {"a": 1, "b": 0}, lambda t: calls.append(dict(t)) or cost(t), 3, 0.01)
    assert tuned == {"a": 3, "b": 2} and cost(tuned) == 4.0
    assert len(changes) == 2 and changes[0].startswith("round 1: a: 1 -> 3")
    assert all(set(t) == {"a", "b"} for t in calls)


def test_a_change_must_win_by_the_margin_and_a_quiet_round_stops():
    flat = lambda t: 5.0 - 0.01 * t["a"]  # noqa: E731 - a's candidates 0.2 % apart
    calls = []
    tuned, changes = descend(KEYS, {"a": 1, "b": 0}, lambda t: calls.append(1) or flat(t), 5, 0.01)
    assert tuned == {"a": 1, "b": 0} and changes == []
    assert len(calls) == 1 + 2 + 1 + 2  # one round: per key the incumbent and its two rivals


def test_pick_remembers_the_candidates_of_every_key_it_is_asked_for(monkeypatch):
    monkeypatch.setattr(autotune, "_SEEN", {})
    monkeypatch.setattr(autotune, "_BEST", {("k2",): "y"})
    launched = []
    assert autotune.pick(("k1",), ["x", "z"], launched.append, torch.device("cpu")) == "x"  # CPU: no timing
    assert autotune.pick(("k2",), ["z", "y"], launched.append, torch.device("cpu")) == "y"  # a tuned key
    assert autotune.seen_candidates() == {("k1",): ("x", "z"), ("k2",): ("z", "y")} and not launched
    autotune.set_tuned(("k1",), "z")
    assert autotune.pick(("k1",), ["x", "z"], launched.append, torch.device("cpu")) == "z"


def test_the_tool_refuses_a_machine_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    import tune_chain

    with pytest.raises(SystemExit):
        tune_chain.main(["--out", "/dev/null"])
    assert "needs a GPU" in capsys.readouterr().err
