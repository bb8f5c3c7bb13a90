"""`Startup` (engine/timing.py): where an engine's construction went, per phase, with the kernel tuning inside
it; the engine records its phases (on CPU: no graphs)."""

from __future__ import annotations

import itertools
import logging

from q3tts.engine import Engine, EngineConfig, timing
from q3tts.engine.timing import Startup


def test_each_phase_and_the_tuning_inside_it_add_up(monkeypatch):
    ticks = itertools.count()  # perf_counter: 0, 1, 2, ... one second per call
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(ticks)))
    tuned = iter([0.0, 0.25, 0.25, 0.25, 0.25, 1.0])  # tuning_seconds() at each phase's start and end
    monkeypatch.setattr(timing, "tuning_seconds", lambda: next(tuned))
    startup = Startup()
    for name in ("weights", "graphs", "weights"):
        with startup.phase(name):
            pass
    assert startup.phases == {"weights": 2.0, "graphs": 1.0}
    assert startup.tuning_s == 1.0
    assert str(startup) == "3.0 s (weights 2.0, graphs 1.0; kernel tuning 1.0 of it)"


def test_each_phase_is_logged_as_it_ends(caplog):
    caplog.set_level(logging.INFO, logger=timing.START_LOG.name)
    startup = Startup()
    with startup.phase("weights"):
        assert caplog.messages == []  # not before it ends
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("weights done in ")
    try:
        with startup.phase("graphs"):
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert caplog.messages[1].startswith("graphs done in ")  # a failed phase says how long it ran too


def test_the_engine_records_its_construction(tiny_ckpt):
    engine = Engine(tiny_ckpt, EngineConfig(device="cpu", dtype="float32", max_slots=2, num_pages=64))
    assert list(engine.startup.phases) == ["weights", "codec", "runner"]  # CPU: no graphs to capture
    assert all(s >= 0 for s in engine.startup.phases.values()) and engine.startup.tuning_s == 0.0
    assert str(engine.startup).startswith(f"{sum(engine.startup.phases.values()):.1f} s (weights ")
