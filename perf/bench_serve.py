"""Client-side serving benchmark over gRPC: a closed-loop concurrency sweep and open-loop Poisson arrivals.

    python perf/bench_serve.py --url 127.0.0.1:8001 --concurrency 1,8,32,64 --requests 4 --max-frames 120
    python perf/bench_serve.py --url ... --concurrency "" --rates 1,4,8,16 --duration-s 30 --csv load.csv
    python perf/bench_serve.py --url ... --concurrency 1,16 --modes greedy,sampled --check --md serve_bench.md

Closed loop (--concurrency N,...): each of N streams sends `--requests` utterances back to back (one START|END
request each, or `--pieces K` requests with text at LLM pace via --piece-gap-ms). Open loop (--rates R,...):
for `--duration-s` seconds utterances arrive as a Poisson process at R requests/s, each on its own stream,
whether or not the earlier ones have finished; its TTFA and end-to-end time count from the arrival, so a
server that falls behind shows it. Each utterance is one `loadstats.Record`; a level reports TTFA
p50/p90/p95/p99, end-to-end p50/p95, RTF p50 (wall / audio), audio-s/s over the level, streams whose
simulated player (starting at the first chunk) stalled > 1 ms, errors and peak in-flight.
`--check` validates every stream (no error, non-empty finite audio, a whole number of 1920-sample frames, as
many as FINISH_REASON says, chunks in frame order) and exits 1 if one is bad. `--warmup` streams run first at
the largest concurrency and are not counted (first CUDA launches, kernel JIT). Prints markdown tables (`--md`
also writes them), then the TTFA anatomy: per level, the median of each part of the first audio's path
(client send, gRPC, execute(), engine thread, queue wait, prefill, first decode step, engine process ->
serving, response built, client receipt: perf/anatomy.py; run the client on the server's host); --json writes
the rows; --csv appends `report.CSV_COLUMNS` rows (mode closed | open).
No torch, no soundfile.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient

from anatomy import MEDIANS, SLOWEST, anatomy, anatomy_table, medians_ms, slowest_ms
from loadstats import LANGUAGE, SPEAKER, TEXT, Record, summarize
from q3tts_client import protocol as P
from q3tts_client.metrics import breakdown, scrape
from q3tts_client.stream_client import synthesize
from report import append_csv

MODES = ("greedy", "sampled")


def check_result(r, max_frames: int) -> str | None:
    """None if the stream is a correct utterance, else what is wrong with it."""
    if r.error is not None:
        return f"error: {r.error}"
    if r.sample_rate != P.SAMPLE_RATE:
        return f"sample rate {r.sample_rate}"
    n = int(r.audio.size)
    if n == 0:
        return f"no audio (finish {r.finish_reason})"
    if not np.isfinite(r.audio).all():
        return f"{int((~np.isfinite(r.audio)).sum())} non-finite samples"
    if n % P.SAMPLES_PER_FRAME:
        return f"{n} samples is not a whole number of {P.SAMPLES_PER_FRAME}-sample frames"
    frames = n // P.SAMPLES_PER_FRAME
    if r.finish_reason not in ("eos", "max_frames"):
        return f"finish reason {r.finish_reason!r}"
    if frames > max_frames or (r.finish_reason == "max_frames" and frames != max_frames):
        return f"{frames} frames with finish {r.finish_reason} and max_frames {max_frames}"
    if r.first_frames != [sum(r.chunk_frames[:i]) for i in range(len(r.chunk_frames))]:
        return f"chunks out of order: FIRST_FRAME {r.first_frames[:8]}..., frames {r.chunk_frames[:8]}..."
    if float(np.abs(r.audio).max()) == 0.0:
        return "audio is all zeros"
    return None


def _text(args):
    """The utterance: one piece, or --pieces pieces produced --piece-gap-ms apart."""
    if args.pieces <= 1:
        return [TEXT]
    words = TEXT.split()
    step = max(1, len(words) // args.pieces)

    def pieces():
        for j in range(0, len(words), step):
            yield " ".join(words[j:j + step]) + " "
            time.sleep(args.piece_gap_ms / 1000)
    return pieces()


def send(args, seed: int, mode: str, max_frames: int, due: float | None = None, client=None):
    """One utterance -> (its Record, its q3tts_client Result or None). `due` defaults to now (closed loop)."""
    rec = Record(due=time.perf_counter() if due is None else due)
    params = {"seed": seed, "max_frames": max_frames, "greedy": True if mode == "greedy" else None,
              "text_mode": "incremental" if args.pieces > 1 else None, "chunk_schedule": args.chunk_schedule}
    try:
        r = synthesize(args.url, _text(args), {"speaker": args.speaker, "language": args.language}, params,
                       timeout_s=args.timeout_s, client=client,
                       on_chunk=lambda res, samples: rec.chunks.append((time.perf_counter(), samples)))
    except Exception as e:  # a client-side failure is a bad stream, not a crashed benchmark
        rec.done, rec.error = time.perf_counter(), f"client: {type(e).__name__}: {e}"
        rec.bad = rec.error
        return rec, None
    rec.done, rec.finish, rec.error = time.perf_counter(), r.finish_reason, r.error
    rec.bad = check_result(r, max_frames)
    return rec, r


def run_level(args, n: int, mode: str, requests: int | None = None, max_frames: int | None = None) -> dict:
    """Closed loop: n streams, each `requests` utterances back to back on its own gRPC client."""
    records, audios, parts, lock = [], [], [], threading.Lock()
    requests = args.requests if requests is None else requests
    max_frames = args.max_frames if max_frames is None else max_frames

    def stream(i: int):
        client = grpcclient.InferenceServerClient(args.url)
        try:
            for k in range(requests):
                rec, r = send(args, i * 1000 + k, mode, max_frames, client=client)
                with lock:
                    records.append(rec)
                    parts.append(anatomy(r) if r is not None else None)
                    if mode == "greedy" and rec.error is None and r is not None:
                        audios.append(r.audio)
        finally:
            client.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    frames = [round(r.audio_s * P.SAMPLE_RATE) // P.SAMPLES_PER_FRAME for r in records if r.error is None]
    return {"loop": "closed", "level": n, "mode": mode, "concurrency": n,
            **summarize(records, time.perf_counter() - t0),
            "eos": sum(1 for r in records if r.finish == "eos"),
            "frames_min": min(frames, default=0), "frames_max": max(frames, default=0), **_agreement(audios),
            **_anatomies(parts)}


def _anatomies(parts: list[dict | None]) -> dict:
    """A level's TTFA anatomy: the medians and the slowest stream's parts (streams with TIMING)."""
    timed = [p for p in parts if p]
    return {MEDIANS: medians_ms(timed), SLOWEST: slowest_ms(timed)}


def run_rate(args, rate: float, mode: str) -> dict:
    """Open loop: Poisson arrivals at `rate`/s for --duration-s, each utterance on its own stream."""
    records, parts, lock = [], [], threading.Lock()
    gaps = np.random.default_rng(args.arrival_seed).exponential(1.0 / rate, size=int(rate * args.duration_s * 3) + 16)

    def one(k: int, due: float):
        rec, r = send(args, k, mode, args.max_frames, due=due)
        with lock:
            records.append(rec)
            parts.append(anatomy(r) if r is not None else None)

    t0 = time.perf_counter()
    threads, due = [], t0
    for k, gap in enumerate(gaps):
        due += gap
        if due - t0 >= args.duration_s:
            break
        time.sleep(max(0.0, due - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(k, due), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    return {"loop": "open", "level": rate, "mode": mode, "rate": rate,
            **summarize(records, time.perf_counter() - t0), **_anatomies(parts)}


METRICS_SETTLE_S = 1.0  # the model sends its counters at its housekeeping tick (0.2 s)


def measured(args, run, *level) -> dict:
    """run(args, *level) plus, with --metrics-url, the server's step-phase means over that level."""
    if not args.metrics_url:
        return {**run(args, *level), **breakdown({}, {}), "server": False}
    before = scrape(args.metrics_url)
    row = run(args, *level)
    time.sleep(METRICS_SETTLE_S)
    return {**row, **breakdown(before, scrape(args.metrics_url)), "server": True}


def _agreement(audios: list) -> dict:
    """Greedy streams all make the same request: how many equal the first bit for bit, the largest sample
    difference from it and the worst SNR against it (batch composition may change bf16 rounding: that keeps
    the SNR tens of dB up; a stream whose codes went another way sits near 0 dB)."""
    if not audios:
        return {"same": None, "max_diff": None, "min_snr_db": None}
    first = audios[0]
    alike = [a for a in audios if a.shape == first.shape and a.size]
    same = sum(1 for a in alike if np.array_equal(a, first))
    diffs = [float(np.abs(a - first).max()) for a in alike]
    return {"same": f"{same}/{len(audios)}", "max_diff": max(diffs, default=None),
            "min_snr_db": min((_snr_db(first, a) for a in alike), default=None)}


def _snr_db(ref: np.ndarray, other: np.ndarray) -> float:
    """10·log10(Σref² / Σ(other−ref)²); inf when they are equal."""
    noise = float(np.sum((other.astype(np.float64) - ref) ** 2))
    return float("inf") if noise == 0.0 else 10.0 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / noise)


SERVER_COLUMN = " server: queue wait / prefill (seqs) / decode step / gap / full GC pass ms |"  # `_server_cells`


def closed_table(rows) -> str:
    server = any(r.get("server") for r in rows)
    lines = ["| mode | streams | requests | errors | bad | greedy: same as first / max diff / min SNR dB | eos / frames min-max | TTFA p50 / p90 / p99 (ms) "
             "| RTF p50 | audio-s/s | underrun streams | wall (s) |" + (SERVER_COLUMN if server else ""),
             "|---|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|" + ("---|" if server else "")]
    for r in rows:
        agree = "-" if r["same"] is None else f"{r['same']} / {_num(r['max_diff'], '.2g')} / {_num(r['min_snr_db'], '.1f')}"
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['streams']} | {r['errors']} | {r['bad']} | "
                     f"{agree} | {r['eos']} / {r['frames_min']}-{r['frames_max']} | {r['ttfa_p50_ms']:.1f} / "
                     f"{r['ttfa_p90_ms']:.1f} / {r['ttfa_p99_ms']:.1f} | {r['rtf_p50']:.3f} | "
                     f"{r['audio_s_per_s']:.2f} | {r['underrun_streams']} | {r['wall_s']:.1f} |" + _server_cells(r, server))
    return "\n".join(lines)


def open_table(rows) -> str:
    server = any(r.get("server") for r in rows)
    lines = ["| mode | requests/s | requests | errors | bad | TTFA p50 / p95 / p99 (ms) | end-to-end p50 / p95 (ms) "
             "| RTF p50 | audio-s/s | peak in-flight | underrun streams | wall (s) |"
             + (SERVER_COLUMN if server else ""),
             "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|" + ("---|" if server else "")]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['rate']:g} | {r['streams']} | {r['errors']} | {r['bad']} | "
                     f"{r['ttfa_p50_ms']:.1f} / {r['ttfa_p95_ms']:.1f} / {r['ttfa_p99_ms']:.1f} | "
                     f"{r['e2e_p50_ms']:.1f} / {r['e2e_p95_ms']:.1f} | {r['rtf_p50']:.3f} | {r['audio_s_per_s']:.2f} | "
                     f"{r['peak_in_flight']} | {r['underrun_streams']} | {r['wall_s']:.1f} |" + _server_cells(r, server))
    return "\n".join(lines)


def _server_cells(r: dict, server: bool) -> str:
    if not server:
        return ""
    return (f" {_num(r['queue_wait_ms'], '.1f')} / {_num(r['prefill_ms'], '.1f')} "
            f"({_num(r['seqs_per_prefill'], '.1f')}) / {_num(r['decode_ms'], '.1f')} / {_num(r['gap_ms'], '.2f')} / "
            f"{_num(r['gc_full_ms'], '.1f')} |")


def _num(v: float | None, fmt: str) -> str:
    """`v` formatted, or "-" where there was nothing to measure (e.g. no audio to compare)."""
    return "-" if v is None else format(v, fmt)


def _levels(text: str, kind, name: str, ap) -> list:
    try:
        levels = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{name} {text!r}: give a comma list of numbers")
    if any(v <= 0 for v in levels):
        ap.error(f"{name} {text!r}: every level must be > 0")
    return levels


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--concurrency", default="1,4,16", help='closed-loop levels ("" = none)')
    ap.add_argument("--rates", default="", help="open-loop levels in requests/s, e.g. 1,4,8 (default none)")
    ap.add_argument("--duration-s", type=float, default=30.0, help="open loop: arrivals per level for this long")
    ap.add_argument("--arrival-seed", type=int, default=0, help="open loop: seed of the Poisson arrival times")
    ap.add_argument("--modes", default="greedy", help="comma list of greedy, sampled")
    ap.add_argument("--requests", type=int, default=2, help="closed loop: utterances per stream")
    ap.add_argument("--pieces", type=int, default=1, help=">1: send the text in K requests (incremental mode)")
    ap.add_argument("--piece-gap-ms", type=float, default=50.0)
    ap.add_argument("--max-frames", type=int, default=120)
    ap.add_argument("--chunk-schedule", default=None, help="frames per response, e.g. 1,1,2,4,8 (default: the server's)")
    ap.add_argument("--speaker", default=SPEAKER)
    ap.add_argument("--language", default=LANGUAGE)
    ap.add_argument("--warmup", type=int, default=0,
                    help="streams (one short utterance each, at the largest concurrency) run first, not counted")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per utterance")
    ap.add_argument("--check", action="store_true", help="validate every stream; exit 1 if one is bad")
    ap.add_argument("--md", default=None, help="also write the markdown tables here")
    ap.add_argument("--title", default=None, help="a line written above the tables in --md")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--csv", default=None, help="append the rows to this results CSV (one --modes entry)")
    ap.add_argument("--gpu", default=None, help="the CSV's gpu column (default: LOADTEST_GPU, else this machine's)")
    ap.add_argument("--metrics-url", default=None,
                    help="Triton metrics endpoint (http://host:8002/metrics): adds the server-side TTFA breakdown")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        ap.error(f"--modes {unknown or 'empty'}: use {MODES}")
    args.concurrency = _levels(args.concurrency, int, "--concurrency", ap)
    args.rates = _levels(args.rates, float, "--rates", ap)
    if not args.concurrency and not args.rates:
        ap.error("nothing to run: give --concurrency and/or --rates")
    if args.csv and len(args.modes) > 1:
        ap.error(f"--csv takes one --modes entry (the CSV has no sampling column), got {args.modes}")
    if args.rates and args.duration_s <= 0:
        ap.error(f"--duration-s {args.duration_s}: must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.warmup:
        t0 = time.perf_counter()
        w = run_level(args, args.warmup, args.modes[0], requests=1, max_frames=min(args.max_frames, 24))
        print(f"warm-up: {w['streams']} streams, {w['errors']} errors, {w['bad']} bad, "
              f"{time.perf_counter() - t0:.1f} s{'; ' + '; '.join(w['bad_reasons']) if w['bad'] else ''}",
              flush=True)
    rows = []
    for mode in args.modes:
        for run, levels in ((run_level, args.concurrency), (run_rate, args.rates)):
            for level in levels:
                rows.append(measured(args, run, level, mode))
                _progress(rows[-1])
                if args.csv:  # row by row: a run cut short keeps what it measured
                    append_csv(args.csv, [{**rows[-1], "mode": rows[-1]["loop"]}], gpu=args.gpu)
    text = "\n\n".join(table([r for r in rows if r["loop"] == loop]) for loop, table
                       in (("closed", closed_table), ("open", open_table)) if any(r["loop"] == loop for r in rows))
    text += "".join("\n\n" + anatomy_table(rows, key) for key in (MEDIANS, SLOWEST) if any(r[key] for r in rows))
    if args.metrics_url:
        text += "\n\n" + server_memory(scrape(args.metrics_url))
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write((args.title.rstrip() + "\n\n" if args.title else "") + text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = sum(r["bad"] for r in rows)
    if args.check and bad:
        print(f"CHECK FAILED: {bad} bad streams", file=sys.stderr)
        return 1
    return 0


def server_memory(metrics: dict[str, float]) -> str:
    """The tritonserver process's resident memory after the run, against its budget (serving/health.py)."""
    n = metrics.get("q3tts_instance_ready") or 1.0  # scrape sums over instances: each reports the same server
    held, budget = (metrics.get(k, 0.0) / n for k in ("q3tts_server_resident_bytes",
                                                      "q3tts_server_memory_budget_bytes"))
    return (f"tritonserver resident memory after the run: {held / 2 ** 20:.0f} MiB (budget {budget / 2 ** 30:g} "
            "GiB; 0 = none)")


def _progress(r: dict) -> None:
    where = f"x{r['level']}" if r["loop"] == "closed" else f"@{r['level']:g}/s"
    print(f"{r['loop']} {r['mode']} {where}: {r['streams']} utterances in {r['wall_s']:.1f} s, TTFA p50 "
          f"{r['ttfa_p50_ms']:.1f} ms p95 {r['ttfa_p95_ms']:.1f} ms, {r['audio_s_per_s']:.2f} audio-s/s, "
          f"RTF p50 {r['rtf_p50']:.3f}, peak in-flight {r['peak_in_flight']}, errors {r['errors']}, bad {r['bad']}",
          flush=True)
    for reason in r["bad_reasons"]:
        print(f"  bad stream: {reason}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
