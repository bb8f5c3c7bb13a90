"""Client-side serving benchmark: TTFA and audio-s/s at N concurrent streams (closed loop), for the H200.

    python perf/bench_serve.py --url 127.0.0.1:8001 --concurrency 1,8,32,64 --requests 4 --max-frames 120

Each of N streams sends `--requests` utterances back to back (one START|END request each, or
`--pieces K` requests with text at LLM pace via --piece-gap-ms). Reports per concurrency: TTFA
p50/p90/p99 (first request sent -> first audio response), RTF p50 (wall / audio), audio-s/s over all streams,
and underruns of a simulated player that starts at the first chunk (a stall > 1 ms counts). Prints a markdown
table; --json writes the raw rows. No torch.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

from q3tts.client import protocol as P
from q3tts.client.stream_client import synthesize

TEXT = ("Streaming speech synthesis should start talking almost at once and keep up with the listener, "
        "one frame after another, without a single gap.")


def _pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_level(args, n: int) -> dict:
    rows, lock = [], threading.Lock()

    def stream(i: int):
        for k in range(args.requests):
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
            r = synthesize(args.url, text, {"speaker": args.speaker, "language": args.language},
                           {"seed": i * 1000 + k, "max_frames": args.max_frames,
                            "text_mode": "incremental" if args.pieces > 1 else None},
                           on_chunk=lambda res, samples: arrivals.append((time.perf_counter(), samples)))
            with lock:
                rows.append({"ok": r.error is None, "error": r.error, "ttfa": r.ttfa_s, "audio_s": r.audio_s,
                             "total_s": r.total_s, "underrun": _underruns(arrivals, t_send)})

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
    return {"concurrency": n, "requests": len(rows), "errors": len(rows) - len(ok),
            "ttfa_p50_ms": _pct(ttfa, 50), "ttfa_p90_ms": _pct(ttfa, 90), "ttfa_p99_ms": _pct(ttfa, 99),
            "rtf_p50": _pct(rtf, 50), "audio_s_per_s": sum(r["audio_s"] for r in ok) / wall,
            "underrun_streams": sum(1 for r in ok if r["underrun"]), "wall_s": wall}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="utterances per stream")
    ap.add_argument("--pieces", type=int, default=1, help=">1: send the text in K requests (incremental mode)")
    ap.add_argument("--piece-gap-ms", type=float, default=50.0)
    ap.add_argument("--max-frames", type=int, default=120)
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--language", default="english")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    rows = [run_level(args, int(n)) for n in args.concurrency.split(",")]
    print("| streams | requests | errors | TTFA p50 / p90 / p99 (ms) | RTF p50 | audio-s/s | underrun streams |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {r['ttfa_p50_ms']:.1f} / "
              f"{r['ttfa_p90_ms']:.1f} / {r['ttfa_p99_ms']:.1f} | {r['rtf_p50']:.3f} | "
              f"{r['audio_s_per_s']:.2f} | {r['underrun_streams']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
