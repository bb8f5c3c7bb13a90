"""Phase timing of engine steps without extra host syncs.

On CUDA a stamp is a recorded event and a duration is GPU time between two stamps, read once the later
one has completed (the decode step's own device-to-host copy has already waited for it); on CPU a
stamp is the wall clock. `StepTimes` keeps the running totals that `Engine.stats()` reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field

import torch

from q3tts.kernels.autotune import tuning_seconds

START_LOG = logging.getLogger("q3tts.engine.start")  # a line per finished start phase, as it finishes (INFO)


def log_start_phases(fmt: str) -> None:
    """`START_LOG`'s lines to this process's stderr in `fmt` (a %-style logging format; call once a process)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    START_LOG.addHandler(handler)
    START_LOG.setLevel(logging.INFO)


class PhaseClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stamp(self):
        """A point in the device's stream of work (CUDA event) or in wall time (CPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        """Time from stamp `start` to stamp `end` (waits for `end` on CUDA)."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass
class StepTimes:
    """Running totals: time in prefill forwards (with the step's trailing-text copies) and the sequences
    they started, time in decode steps (the batched step and its device-to-host copies; their count is
    the engine's `decode_steps`), the time sequences waited between having a complete prompt and
    being started (slots, pages, the per-step prefill budget), and the device's idle time between
    consecutive steps while the engine had work (`step_gap_seconds` over `step_gaps`: the host's turn between
    one step's device work and the next one's: landing, scheduling, and the caller's handling of the outputs)."""

    prefill_seconds: float = 0.0
    prefill_steps: int = 0
    prefilled_sequences: int = 0
    decode_seconds: float = 0.0
    queue_wait_seconds: float = 0.0
    step_gap_seconds: float = 0.0
    step_gaps: int = 0

    def add_prefill(self, seconds: float, sequences: int) -> None:
        """One step's prefill forward, which started `sequences` sequences."""
        self.prefill_seconds += seconds
        self.prefill_steps += 1
        self.prefilled_sequences += sequences

    def add_gap(self, seconds: float) -> None:
        """The device's idle time between one step's work and the next step's."""
        self.step_gap_seconds += seconds
        self.step_gaps += 1

    def as_stats(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass
class Startup:
    """Where an engine's construction went: wall seconds per phase (in the order they ran; phases do not
    overlap) and, of all of them, the seconds spent timing kernel launch configs (their compiles included)."""

    phases: dict[str, float] = field(default_factory=dict)
    tuning_s: float = 0.0
    cached_configs: int = 0  # launch configs taken from `EngineConfig.tune_cache` (not timed again)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the phase `name`; `START_LOG` says when it ends (a cold GPU start takes minutes: an operator,
        or a start timeout's log, sees how far it got)."""
        start, tuned = time.perf_counter(), tuning_seconds()
        try:
            yield
        finally:
            took, tuning = time.perf_counter() - start, tuning_seconds() - tuned
            self.phases[name] = self.phases.get(name, 0.0) + took
            self.tuning_s += tuning
            START_LOG.info("%s done in %.1f s (kernel tuning %.1f s of it)", name, took, tuning)

    def __str__(self) -> str:
        """E.g. "12.3 s (weights 4.1, codec 0.3, runner 0.2, decode graphs 7.7; kernel tuning 5.0 of it)", and
        ", 80 configs from the tuning cache" when it took some."""
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.phases.items())
        cached = f", {self.cached_configs} configs from the tuning cache" if self.cached_configs else ""
        return f"{sum(self.phases.values()):.1f} s ({parts}; kernel tuning {self.tuning_s:.1f} of it{cached})"
