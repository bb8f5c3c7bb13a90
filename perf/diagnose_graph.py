"""Why does tests/engine/test_batch_and_graph.py::test_graph_replay_equals_eager fail on the GPU?

H200: python3 perf/diagnose_graph.py          (tiny checkpoint, bf16, buckets 1 2 4 8, batch 3; < 1 min)
CPU:  python3 perf/diagnose_graph.py --device cpu   (no graphs: every 'graph' run is eager; plumbing only)

1. Runs the test's comparison as four greedy runs on one engine, in this order: G1 (graph), E1 (eager),
   E2 (eager), G2 (graph), and prints per step and per row whether the codes differ and the first
   differing code group, for G1-E1 (the test), E1-E2 (eager determinism), G1-G2 (graph determinism)
   and E2-G2 (reverse order: stale state from the previous run?).
2. Single-step isolation: fills the batch, snapshots every piece of device state, runs one decode step
   eagerly, restores the snapshot, replays the graph for the same rows, and compares codes, c0_next and
   the talker hidden (max |diff|): a difference here is numeric (kernel choice), not state.
3. Per-component graph == eager on the same inputs (perf/profile_step.py's components) at the bucket.
Writes $OUT/diagnose_graph.md when OUT is set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import save  # noqa: E402
from bench_engine import drain, fill  # noqa: E402

from q3tts.engine.config import EngineConfig  # noqa: E402
from q3tts.engine.engine import Engine  # noqa: E402

LINES: list[str] = []


def say(s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)


def run(engine: Engine, batch: int, steps: int, use_graph: bool, tag: str) -> list[dict[str, np.ndarray]]:
    engine.runner.use_graphs(use_graph)
    try:
        ids = fill(engine, batch, tag, greedy=True, frames=steps + 4)
        out = []
        for _ in range(steps):
            out.append({o.seq_id[len(tag):]: o.codes.copy() for o in engine.step()})
        drain(engine, ids)
    finally:
        engine.runner.use_graphs(True)
    return out


def compare(name: str, a: list[dict], b: list[dict]) -> bool:
    same = True
    first = None
    for t, (sa, sb) in enumerate(zip(a, b)):
        cells = []
        for row in sorted(set(sa) | set(sb), key=lambda r: int(r)):
            x, y = sa.get(row), sb.get(row)
            if x is None or y is None or x.shape != y.shape:
                cells.append(f"r{row}:shape {None if x is None else x.shape}/{None if y is None else y.shape}")
                same = False
            elif not np.array_equal(x, y):
                g = int(np.nonzero((x != y).reshape(-1))[0][0]) % 16 if x.size else -1
                cells.append(f"r{row}:g{g} ({int(x.reshape(-1)[g])}!={int(y.reshape(-1)[g])})")
                same = False
                first = t if first is None else first
            else:
                cells.append(f"r{row}:=")
        say(f"  {name} step {t}: " + " ".join(cells))
    say(f"{name}: {'SAME' if same else f'DIFFER (first at step {first})'}")
    return same


def device_state(engine: Engine) -> list[torch.Tensor]:
    runner = engine.runner
    st = runner.state
    ts = [getattr(st, f) for f in st.__dataclass_fields__]
    ts += [runner.kv.k, runner.kv.v]
    cache = runner.talker.code_predictor._cache
    if cache is not None:
        ts += [cache.k, cache.v]
    if runner.codec is not None:
        ts += list(runner.codec.pool)
    b = runner.buf
    ts += [b.meta, b.tables, b.frames, b.c0_next, b.pcm]
    return ts


def single_step(engine: Engine, batch: int) -> None:
    runner = engine.runner
    say("\n## single-step isolation (same state, eager vs graph)")
    ids = fill(engine, batch, "ss_", greedy=True, frames=16)
    engine.step()
    captured = {}
    orig = runner.decode

    def spy(rows):
        captured["rows"] = rows
        return orig(rows)

    runner.decode = spy
    try:
        engine.step()
    finally:
        runner.decode = orig
    rows = captured["rows"]
    state = device_state(engine)
    snap = [t.clone() for t in state]
    slots = torch.tensor([r.slot for r in rows], device=runner.device)
    results = {}
    for mode in ("eager", "graph", "eager2", "graph2"):
        for t, s in zip(state, snap):
            t.copy_(s)
        runner.use_graphs(mode.startswith("graph"))
        try:
            frames, c0n, pcm, _ = (a.copy() for a in runner.decode(rows))  # views until the next decode
        finally:
            runner.use_graphs(True)
        results[mode] = (frames, c0n, runner.state.past_hidden[slots].float().cpu(), pcm)
    for t, s in zip(state, snap):
        t.copy_(s)
    for a, b in (("eager", "graph"), ("eager", "eager2"), ("graph", "graph2")):
        fa, ca, ha, pa = results[a]
        fb, cb, hb, pb = results[b]
        diff_rows = [i for i in range(len(rows)) if not np.array_equal(fa[i], fb[i])]
        say(f"{a} vs {b}: frames equal {np.array_equal(fa, fb)} (rows differing {diff_rows}), c0_next equal "
            f"{np.array_equal(ca, cb)}, hidden max|diff| {float((ha - hb).abs().max()):.3g}, "
            f"pcm max|diff| {float(np.abs(pa - pb).max()) if pa.size else 0.0:.3g}")
    dummy = runner.dummy_slot
    st = runner.state
    say(f"dummy slot {dummy}: past_hidden finite {bool(torch.isfinite(st.past_hidden[dummy]).all())}, "
        f"last_c0 {int(st.last_c0[dummy])}, rep_mask ids set {int(st.rep_mask[dummy].sum())}")
    if runner.codec is not None:
        finite = all(bool(torch.isfinite(p[runner.codec.scratch_slot]).all()) for p in runner.codec.pool
                     if p.is_floating_point())
        say(f"codec scratch slot state finite: {finite}")
    drain(engine, ids)


def components(engine: Engine, batch: int) -> None:
    from profile_step import Timer, profile_components

    say("\n## per-component graph == eager (same inputs)")
    ids = fill(engine, batch, "pc_", greedy=True, frames=16)
    engine.step()
    bucket = engine.config.bucket_for(batch) or batch
    rows = profile_components(engine, bucket, Timer(engine.runner.device, 3, 1))
    for r in rows:
        say(f"  {r['name']}: graph==eager {r['same']}" + (f" diff {r['diff']:.3g}" if "diff" in r else "")
            + (f" ERROR {r['error']}" if "error" in r else ""))
    drain(engine, ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", help="checkpoint folder (default: make a tiny random one)")
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.model:
        model = args.model
    else:
        import tempfile

        from q3tts.checkpoint.maker import make_checkpoint

        model = str(make_checkpoint(Path(tempfile.mkdtemp(prefix="q3tts_diag_")) / "cv_tiny", "custom_voice",
                                    "1.7b", "tiny", seed=0))
    # the test's config (tests/engine/test_batch_and_graph.py::test_graph_replay_equals_eager)
    cfg = EngineConfig(device=args.device, dtype="bfloat16" if cuda else "float32", num_pages=256, max_slots=8,
                       max_frames=64, max_prompt_tokens=256, max_text_tokens=128, graph_batch_sizes=(1, 2, 4, 8),
                       use_cuda_graphs=cuda)
    engine = Engine(model, cfg)
    say(f"# graph vs eager diagnosis: batch {args.batch} (bucket {cfg.bucket_for(args.batch)}), "
        f"graphs {list(engine.runner.graph_buckets) or 'off'}, {cfg.dtype}, "
        f"{torch.cuda.get_device_name() if cuda else 'cpu'}")
    g1 = run(engine, args.batch, args.steps, True, "g1_")
    e1 = run(engine, args.batch, args.steps, False, "e1_")
    e2 = run(engine, args.batch, args.steps, False, "e2_")
    g2 = run(engine, args.batch, args.steps, True, "g2_")
    verdict = dict(test=compare("G1 vs E1 (the test)", g1, e1), eager=compare("E1 vs E2", e1, e2),
                   graph=compare("G1 vs G2", g1, g2), reverse=compare("E2 vs G2", e2, g2))
    full = args.batch if args.batch in cfg.graph_batch_sizes else max(b for b in cfg.graph_batch_sizes
                                                                    if b <= args.batch)
    if full != args.batch:
        g3 = run(engine, full, args.steps, True, "g3_")
        e3 = run(engine, full, args.steps, False, "e3_")
        verdict["no_padding"] = compare(f"graph vs eager at batch {full} (no padding rows)", g3, e3)
    single_step(engine, args.batch)
    components(engine, args.batch)
    say(f"\nverdict: {verdict}")
    save("\n".join(LINES) + "\n", "diagnose_graph.md")
    return 0 if verdict["test"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
