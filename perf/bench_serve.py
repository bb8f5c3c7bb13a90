"""Client-side serving benchmark: TTFA and audio-s/s at N concurrent streams (closed loop), for the H200.

    python perf/bench_serve.py --url 127.0.0.1:8001 --concurrency 1,8,32,64 --requests 4 --max-frames 120
    python perf/bench_serve.py --url ... --concurrency 1,16 --modes greedy,sampled --check --md serve_bench.md

Each of N streams sends `--requests` utterances back to back (one START|END request each, or
`--pieces K` requests with text at LLM pace via --piece-gap-ms). Reports per mode (greedy | sampled) and
concurrency: TTFA p50/p90/p99 (first request sent -> first audio response), RTF p50 (wall / audio),
audio-s/s over all streams, and underruns of a simulated player that starts at the first chunk (a stall
> 1 ms counts). `--check` validates every stream (no error, non-empty finite audio, a whole number of
1920-sample frames, as many as FINISH_REASON says, chunks in frame order) and exits 1 if one is bad.
`--warmup` streams run first at the largest concurrency and are not counted (first CUDA launches, kernel
JIT). Prints a markdown table (`--md` also writes it); --json writes the raw rows. No torch, no soundfile.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np

from q3tts_client import protocol as P
from q3tts_client.metrics import breakdown, scrape
from q3tts_client.stream_client import synthesize

TEXT = ("Streaming speech synthesis should start talking almost at once and keep up with the listener, "
        "one frame after another, without a single gap.")
MODES = ("greedy", "sampled")


def _pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


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


def run_level(args, n: int, mode: str, requests: int | None = None, max_frames: int | None = None) -> dict:
    rows, lock, audios = [], threading.Lock(), []
    requests = args.requests if requests is None else requests
    max_frames = args.max_frames if max_frames is None else max_frames

    def stream(i: int):
        for k in range(requests):
            arrivals = []
            words = TEXT.split()
            if args.pieces > 1:
                step = max(1, len(words) // args.pieces)

                def pieces():
                    for j in range(0, len(words), step):
                        yield " ".join(words[j:j + step]) + " "
                        time.sleep(args.piece_gap_ms / 1000)
                text = pieces()
            else:
                text = [TEXT]
            t_send = time.perf_counter()
            params = {"seed": i * 1000 + k, "max_frames": max_frames,
                      "greedy": True if mode == "greedy" else None,
                      "text_mode": "incremental" if args.pieces > 1 else None}
            try:
                r = synthesize(args.url, text, {"speaker": args.speaker, "language": args.language}, params,
                               timeout_s=args.timeout_s,
                               on_chunk=lambda res, samples: arrivals.append((time.perf_counter(), samples)))
            except Exception as e:  # a client-side failure is a bad stream, not a crashed benchmark
                with lock:
                    rows.append({"ok": False, "error": f"client: {type(e).__name__}: {e}", "bad": str(e),
                                 "ttfa": None, "audio_s": 0.0, "total_s": 0.0, "underrun": False,
                                 "frames": 0, "finish": None})
                continue
            bad = check_result(r, max_frames)
            with lock:
                if mode == "greedy" and r.error is None:
                    audios.append(r.audio)
                rows.append({"ok": r.error is None, "error": r.error, "bad": bad, "ttfa": r.ttfa_s,
                             "audio_s": r.audio_s, "total_s": r.total_s, "underrun": _underruns(arrivals, t_send),
                             "frames": int(r.audio.size) // P.SAMPLES_PER_FRAME, "finish": r.finish_reason})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in rows if r["ok"]]
    ttfa = [1000 * r["ttfa"] for r in ok if r["ttfa"] is not None]
    rtf = [r["total_s"] / r["audio_s"] for r in ok if r["audio_s"]]
    frames = [r["frames"] for r in ok]
    return {"mode": mode, "concurrency": n, "requests": len(rows), "errors": len(rows) - len(ok),
            "bad": sum(1 for r in rows if r["bad"]), "bad_reasons": sorted({r["bad"] for r in rows if r["bad"]})[:5],
            "eos": sum(1 for r in ok if r["finish"] == "eos"),
            "frames_min": min(frames, default=0), "frames_max": max(frames, default=0),
            "ttfa_p50_ms": _pct(ttfa, 50), "ttfa_p90_ms": _pct(ttfa, 90), "ttfa_p99_ms": _pct(ttfa, 99),
            "rtf_p50": _pct(rtf, 50), "audio_s": sum(r["audio_s"] for r in ok),
            "audio_s_per_s": sum(r["audio_s"] for r in ok) / wall,
            "underrun_streams": sum(1 for r in ok if r["underrun"]), "wall_s": wall,
            **_agreement(audios)}


METRICS_SETTLE_S = 1.0  # the model sends its counters at its housekeeping tick (0.2 s)


def measured_level(args, n: int, mode: str) -> dict:
    """run_level plus, with --metrics-url, the server's step-phase means over that level."""
    if not args.metrics_url:
        return {**run_level(args, n, mode), **breakdown({}, {}), "server": False}
    before = scrape(args.metrics_url)
    row = run_level(args, n, mode)
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


def _underruns(arrivals, t_send) -> bool:
    """A player starts at the first chunk and plays in real time; True if it ever waits > 1 ms."""
    if not arrivals:
        return False
    start = arrivals[0][0]
    played_until = start  # wall time the audio received so far runs out
    prev_samples = 0
    for t, samples in arrivals:
        if t > played_until + 1e-3 and prev_samples:
            return True
        played_until = max(played_until, t) + (samples - prev_samples) / P.SAMPLE_RATE
        prev_samples = samples
    return False


def table(rows) -> str:
    server = any(r.get("server") for r in rows)
    lines = ["| mode | streams | requests | errors | bad | greedy: same as first / max diff / min SNR dB | eos / frames min-max | TTFA p50 / p90 / p99 (ms) "
             "| RTF p50 | audio-s/s | underrun streams | wall (s) |" + (" server: queue wait / prefill (seqs) / decode step ms |" if server else ""),
             "|---|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|" + ("---|" if server else "")]
    for r in rows:
        agree = "-" if r["same"] is None else f"{r['same']} / {_num(r['max_diff'], '.2g')} / {_num(r['min_snr_db'], '.1f')}"
        line = (f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['errors']} | {r['bad']} | "
                f"{agree} | {r['eos']} / {r['frames_min']}-{r['frames_max']} | {r['ttfa_p50_ms']:.1f} / "
                f"{r['ttfa_p90_ms']:.1f} / {r['ttfa_p99_ms']:.1f} | {r['rtf_p50']:.3f} | "
                f"{r['audio_s_per_s']:.2f} | {r['underrun_streams']} | {r['wall_s']:.1f} |")
        if server:
            line += f" {_num(r['queue_wait_ms'], '.1f')} / {_num(r['prefill_ms'], '.1f')} ({_num(r['seqs_per_prefill'], '.1f')}) / {_num(r['decode_ms'], '.1f')} |"
        lines.append(line)
    return "\n".join(lines)


def _num(v: float | None, fmt: str) -> str:
    """`v` formatted, or "-" where there was nothing to measure (e.g. no audio to compare)."""
    return "-" if v is None else format(v, fmt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--modes", default="greedy", help="comma list of greedy, sampled")
    ap.add_argument("--requests", type=int, default=2, help="utterances per stream")
    ap.add_argument("--pieces", type=int, default=1, help=">1: send the text in K requests (incremental mode)")
    ap.add_argument("--piece-gap-ms", type=float, default=50.0)
    ap.add_argument("--max-frames", type=int, default=120)
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--language", default="english")
    ap.add_argument("--warmup", type=int, default=0,
                    help="streams (one short utterance each, at the largest concurrency) run first, not counted")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per utterance")
    ap.add_argument("--check", action="store_true", help="validate every stream; exit 1 if one is bad")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--title", default=None, help="a line written above the table in --md")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--metrics-url", default=None,
                    help="Triton metrics endpoint (http://host:8002/metrics): adds the server-side TTFA breakdown")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}: use {MODES}")
    levels = [int(n) for n in args.concurrency.split(",") if n]
    if args.warmup:
        t0 = time.perf_counter()
        w = run_level(args, args.warmup, modes[0], requests=1, max_frames=min(args.max_frames, 24))
        print(f"warm-up: {w['requests']} streams, {w['errors']} errors, {w['bad']} bad, "
              f"{time.perf_counter() - t0:.1f} s{'; ' + '; '.join(w['bad_reasons']) if w['bad'] else ''}",
              flush=True)
    rows = []
    for mode in modes:
        for n in levels:
            rows.append(measured_level(args, n, mode))
            r = rows[-1]
            print(f"{mode} x{n}: {r['requests']} utterances in {r['wall_s']:.1f} s, TTFA p50 {r['ttfa_p50_ms']:.1f} ms "
                  f"p90 {r['ttfa_p90_ms']:.1f} ms, {r['audio_s_per_s']:.2f} audio-s/s, RTF p50 {r['rtf_p50']:.3f}, "
                  f"bad {r['bad']}", flush=True)
            for reason in r["bad_reasons"]:
                print(f"  bad stream: {reason}", flush=True)
    text = table(rows)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            if args.title:
                f.write(args.title.rstrip() + "\n\n")
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = sum(r["bad"] for r in rows)
    if args.check and bad:
        print(f"CHECK FAILED: {bad} bad streams", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
