"""perf_analyzer profile exports -> the load-test numbers, beside perf_analyzer's own.

    python perf/pa_export.py run/perf/pa_c1.json run/perf/pa_c8.json --md perf_analyzer.md --csv load.csv

What perf_analyzer 2.51 itself reports for this decoupled sequence model (perf/run_perf_analyzer.sh: serial
sequences of text steps, ack_pieces): it prints "using the first response for measuring latency", but each
latency sample is one sequence's END request, from its send to its FINAL response: the synthesis still to do
after the last text piece (a sequence of several requests runs in incremental text mode, so the talker may
start on the first pieces; with ack_pieces, audio made before END waits for it), never the time to first
audio. Its "Throughput" is sequences/s and "Response Throughput" counts every response, acks and empty
FINALs included. It cannot see time to first audio, audio seconds, RTF or playback stalls. Its --profile-export-file keeps every request's send time and every response's time and outputs,
from which this script builds one `loadstats.Record` per sequence (due = its first request's send; chunks =
the responses carrying audio) and reports them like perf/bench_serve.py: rows of mode perf_analyzer, level =
concurrency. perf_analyzer's own latency percentiles and throughput (its -f CSV, pa_cN.csv beside pa_cN.json)
go in the same table.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from loadstats import Record, summarize
from q3tts_client import protocol as P
from report import append_csv

NS = 1e-9


def sequences(requests: list[dict]) -> list[Record]:
    """One Record per sequence_id of an experiment's requests (times in s from the first send)."""
    if not requests:
        return []
    base = min(r["timestamp"] for r in requests)
    by_seq: dict[int, list[dict]] = {}
    for r in sorted(requests, key=lambda r: r["timestamp"]):
        by_seq.setdefault(r["sequence_id"], []).append(r)
    return [_record(reqs, base) for reqs in by_seq.values()]


def _record(reqs: list[dict], base: int) -> Record:
    rec = Record(due=(reqs[0]["timestamp"] - base) * NS, done=(reqs[0]["timestamp"] - base) * NS)
    samples = 0
    for req in reqs:
        for t, out in zip(req.get("response_timestamps", []), req.get("response_outputs", [])):
            rec.done = max(rec.done, (t - base) * NS)
            # outputs a response does not carry hold leftover bytes in the export: trust AUDIO only when
            # SAMPLE_RATE says the response is a data response
            if out.get(P.OUTPUT_SAMPLE_RATE) != P.SAMPLE_RATE:
                continue
            audio = out.get(P.OUTPUT_AUDIO)
            if isinstance(audio, list) and audio:
                samples += len(audio)
                rec.chunks.append(((t - base) * NS, samples))
            rec.finish = out.get(P.OUTPUT_FINISH_REASON) or rec.finish
            rec.error = out.get(P.OUTPUT_ERROR) or rec.error
    if not reqs[-1].get("response_timestamps"):
        rec.error = rec.error or "the END request got no response"
    if rec.error is None and not rec.chunks:
        rec.error = "no audio"
    rec.bad = rec.error
    return rec


def own_numbers(csv_path: Path) -> dict:
    """perf_analyzer's latency percentiles (ms) and throughput (sequences/s) from its -f CSV ({} if absent)."""
    if not csv_path.exists():
        return {}
    with csv_path.open(newline="") as f:
        row = next(csv.DictReader(f), None)
    if row is None:
        return {}
    return {"pa_throughput": float(row["Inferences/Second"]),
            **{f"pa_p{q}_ms": float(row[f"p{q} latency"]) / 1e3 for q in (50, 95, 99)}}


def rows_of(path: Path) -> list[dict]:
    """One row per experiment (concurrency level) of a profile export."""
    try:
        data = json.loads(path.read_text())
        experiments = data["experiments"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{path}: not a perf_analyzer profile export ({type(e).__name__}: {e})")
    rows = []
    for exp in experiments:
        records = sequences(exp["requests"])
        bounds = exp.get("window_boundaries") or []
        wall = (bounds[-1] - bounds[0]) * NS if len(bounds) >= 2 else max((r.done for r in records), default=0.0)
        rows.append({"mode": "perf_analyzer", "level": exp["experiment"]["value"],
                     **summarize(records, wall), **own_numbers(path.with_suffix(".csv"))})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| concurrency | sequences | errors | TTFA p50 / p95 / p99 (ms) | end-to-end p50 / p95 (ms) | RTF p50 "
             "| audio-s/s | underrun streams | perf_analyzer latency p50 / p95 / p99 (ms) | perf_analyzer sequences/s |",
             "|---:|---:|---:|---|---|---:|---:|---:|---|---:|"]
    for r in rows:
        own = (f"{r['pa_p50_ms']:.1f} / {r['pa_p95_ms']:.1f} / {r['pa_p99_ms']:.1f} | {r['pa_throughput']:.3f}"
               if "pa_p50_ms" in r else "- | -")
        lines.append(f"| {r['level']} | {r['streams']} | {r['errors']} | {r['ttfa_p50_ms']:.1f} / {r['ttfa_p95_ms']:.1f} / "
                     f"{r['ttfa_p99_ms']:.1f} | {r['e2e_p50_ms']:.1f} / {r['e2e_p95_ms']:.1f} | {r['rtf_p50']:.3f} | "
                     f"{r['audio_s_per_s']:.2f} | {r['underrun_streams']} | {own} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+", type=Path, help="--profile-export-file JSONs (pa_cN.json)")
    ap.add_argument("--md", type=Path, default=None, help="also write the table here")
    ap.add_argument("--csv", default=None, help="append rows of mode perf_analyzer to this results CSV")
    ap.add_argument("--gpu", default=None, help="the CSV's gpu column (default: LOADTEST_GPU, else this machine's)")
    args = ap.parse_args(argv)
    rows = sorted((r for p in args.exports for r in rows_of(p)), key=lambda r: r["level"])
    text = "perf_analyzer 2.51 (latency = a sequence's END request sent -> its FINAL response)\n\n" + table(rows)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.csv:
        append_csv(args.csv, rows, gpu=args.gpu)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
