"""The host's cost of one engine decode step: everything `Engine.step()` does around the device work.

CPU (2 cores are enough): python3 perf/host_step.py --scale tiny --device cpu --batches 1 64
H200:                     python3 perf/host_step.py --batches 1 16 64

Builds the engine like perf/bench_engine.py, fills it with B sequences for each B in --batches and runs
--steps steps. `ModelRunner.run_step` (the step body, or its graph replay) is wrapped: on CUDA the device
is synchronized before and after it, so its time is the device step, and the rest of `Engine.step()` is
the host's work (scheduling, row metadata, copies, output rows) plus the waits of its own copies — time
in which, with the engine's synchronous step, the device idles. Per B it prints the median step, the
median host time and, from one step under torch.profiler, the torch ops called outside `run_step` (each
is a dispatch on the host and, on CUDA, a kernel launch or a copy); on CUDA also the synchronizing calls
outside `run_step` that torch.cuda.set_sync_debug_mode reports (blocking copies, .item(), stream syncs;
not waits on an event, e.g. the step's one wait for its outputs). Writes $OUT/host_step.md when OUT is set.
--skip-device-step keeps the device step out (its outputs stay those of the last real step): the host's
work alone, steady enough on a busy 2-core CPU to compare commits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit  # noqa: E402
from bench_engine import add_model_arguments, build_engine, drain, fill, sync  # noqa: E402

from q3tts.engine.engine import Engine  # noqa: E402

DEVICE_STEP = "device_step"  # the profiler range around run_step


class DeviceStep:
    """Wraps `engine.runner.run_step`: times it (device synchronized around it) and marks it for the
    profiler; `seconds` is the time inside it since the last `reset`."""

    def __init__(self, engine: Engine) -> None:
        self.runner, self.run_step = engine.runner, engine.runner.run_step
        self.skip = False  # True: the device step is not run (--skip-device-step)
        self.cuda = self.runner.device.type == "cuda"
        self.seconds = 0.0
        self.runner.run_step = self

    def __call__(self, bucket: int, mode: str) -> None:
        self._sync()
        t0 = time.perf_counter()
        with record_function(DEVICE_STEP):
            if not self.skip:
                self.run_step(bucket, mode)
        self._sync()
        self.seconds += time.perf_counter() - t0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def remove(self) -> None:
        del self.runner.run_step  # the instance attribute: the method shows through again


def ops_outside(prof) -> tuple[int, dict[str, int]]:
    """Top-level torch ops of a profiled step outside the DEVICE_STEP range: (count, count per name)."""
    counts: dict[str, int] = {}
    for e in prof.events():
        if not e.name.startswith("aten::") or _has_ancestor(e, lambda p: p.name.startswith("aten::")):
            continue
        if _has_ancestor(e, lambda p: p.name == DEVICE_STEP):
            continue
        counts[e.name] = counts.get(e.name, 0) + 1
    return sum(counts.values()), counts


def _has_ancestor(event, pred) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if pred(parent):
            return True
        parent = parent.cpu_parent
    return False


def syncs_outside(engine: Engine) -> int | None:
    """Synchronizing CUDA calls of one step outside run_step that the sync debug mode reports (None on CPU)."""
    if engine.runner.device.type != "cuda":
        return None
    wrapped = engine.runner.run_step

    def quiet(bucket: int, mode: str) -> None:
        torch.cuda.set_sync_debug_mode(0)
        try:
            wrapped(bucket, mode)
        finally:
            torch.cuda.set_sync_debug_mode("warn")

    engine.runner.run_step = quiet
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        engine.runner.run_step = wrapped
    return sum("synchroniz" in str(w.message) for w in caught)


def measure(engine: Engine, device_step: DeviceStep, batch: int, steps: int, device: str) -> dict:
    """`steps` timed steps of the `batch` sequences running, then one profiled, one sync-counted."""
    engine.step()  # warm
    totals, hosts = [], []
    for _ in range(steps):
        device_step.seconds = 0.0
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        total = time.perf_counter() - t0
        totals.append(total)
        hosts.append(total - device_step.seconds)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    ops, per_name = ops_outside(prof)
    syncs = syncs_outside(engine)
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:8]
    return dict(batch=batch, step_ms=1e3 * statistics.median(totals), host_us=1e6 * statistics.median(hosts),
                ops=ops, syncs=syncs, top=", ".join(f"{n[6:]} {c}" for n, c in top))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, [1, 16, 64])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--skip-device-step", action="store_true", help="run_step does nothing (see above)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = build_engine(args, args.steps + 8)
    device_step = DeviceStep(engine)
    rows = []
    for b in args.batches:
        ids = fill(engine, b, f"h{b}_", frames=args.steps + 8)  # its prefill and first steps run for real
        device_step.skip = args.skip_device_step
        rows.append(measure(engine, device_step, b, args.steps, args.device))
        device_step.skip = False
        drain(engine, ids)
    device_step.remove()
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    table = ["| batch | step ms (median) | host µs per step (median) | torch ops outside the step body | "
             "synchronizing calls outside it | most called |", "|---:|---:|---:|---:|---:|---|"]
    table += [f"| {r['batch']} | {r['step_ms']:.2f} | {r['host_us']:.0f} | {r['ops']} | "
              f"{'-' if r['syncs'] is None else r['syncs']} | {r['top']} |" for r in rows]
    skipped = ", device step skipped" if args.skip_device_step else ""
    emit(f"# Host cost of a decode step ({args.scale} 1.7B CustomVoice, {args.dtype}, {dev}, "
         f"{args.steps} steps{skipped})\n\n" + "\n".join(table) + "\n", "host_step.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
