"""Measure a peer (perf/peers/adapters.py) on a checkpoint the way perf/bench_serve.py measures our server.

    PYTHONPATH=<peer site> python perf/peers/run.py --peer qwen-tts-hf --checkpoint CKPT --batches 1,64 --csv load.csv
    PYTHONPATH=<peer site> python perf/peers/run.py --peer faster-qwen3-tts --checkpoint CKPT --stream-chunk 1

Rows (`report.CSV_COLUMNS`, level = batch size):
- mode peer:NAME: `--repeats` calls of `generate` on a batch of the benchmark utterance. The peer hands audio
  back only when the whole batch is done, so every utterance's TTFA is that call's wall time, as is its
  end-to-end time; audio-s/s = audio of the batch / wall.
- mode peer:NAME-stream (peers that stream, batch 1): `--repeats` streamed utterances at `--stream-chunk`
  frames per chunk; TTFA = first chunk, the player simulation counts underruns as for our server.
A warm-up call (a short utterance, every batch size) runs first and is not counted. The peer's packages
(its transformers, tokenizers) must come first on PYTHONPATH: perf/gpu_loadtest.sh sets that up.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadstats import LANGUAGE, SPEAKER, TEXT, Record, summarize  # noqa: E402
from adapters import PEERS  # noqa: E402
from report import append_csv  # noqa: E402

WARMUP_FRAMES = 8


def measure_batch(peer, batch: int, args) -> dict:
    """`args.repeats` generate calls of `batch` utterances -> a row of mode peer:NAME."""
    peer.generate([TEXT] * batch, SPEAKER, LANGUAGE, WARMUP_FRAMES)
    records, wall = [], 0.0
    for k in range(args.repeats):
        torch.manual_seed(args.seed + k)
        t0 = time.perf_counter()
        try:
            audios = peer.generate([TEXT] * batch, SPEAKER, LANGUAGE, args.max_frames)
        except Exception as e:  # noqa: BLE001 - a failed call is `batch` failed utterances, not a lost run
            done, error = time.perf_counter(), f"{type(e).__name__}: {e}"
            records += [Record(due=t0, done=done, error=error) for _ in range(batch)]
            continue
        t1 = time.perf_counter()
        wall += t1 - t0
        records += [Record(due=t0, done=t1, sample_rate=peer.sample_rate, chunks=[(t1, a.size)] if a.size else [],
                           error=None if a.size else "no audio") for a in audios]
    return {"mode": f"peer:{peer.name}", "level": batch, **summarize(records, wall)}


def measure_stream(peer, args) -> dict:
    """`args.repeats` streamed utterances at --stream-chunk frames -> a row of mode peer:NAME-stream."""
    list(peer.stream(TEXT, SPEAKER, LANGUAGE, WARMUP_FRAMES, args.stream_chunk))
    records, wall = [], 0.0
    for k in range(args.repeats):
        torch.manual_seed(args.seed + k)
        rec = Record(due=time.perf_counter())
        samples = 0
        try:
            for audio in peer.stream(TEXT, SPEAKER, LANGUAGE, args.max_frames, args.stream_chunk):
                if audio.size:
                    samples += audio.size
                    rec.chunks.append((time.perf_counter(), samples))
        except Exception as e:  # noqa: BLE001
            rec.error = f"{type(e).__name__}: {e}"
        rec.done, rec.sample_rate = time.perf_counter(), peer.sample_rate
        wall += rec.done - rec.due
        records.append(rec)
    return {"mode": f"peer:{peer.name}-stream", "level": 1, **summarize(records, wall)}


def table(rows: list[dict]) -> str:
    lines = ["| peer | batch | utterances | errors | TTFA p50 / p95 (ms) | end-to-end p50 / p95 (ms) | RTF p50 "
             "| audio-s/s | underrun streams |", "|---|---:|---:|---:|---|---|---:|---:|---:|"]
    lines += [f"| {r['mode'][5:]} | {r['level']} | {r['streams']} | {r['errors']} | {r['ttfa_p50_ms']:.1f} / "
              f"{r['ttfa_p95_ms']:.1f} | {r['e2e_p50_ms']:.1f} / {r['e2e_p95_ms']:.1f} | {r['rtf_p50']:.3f} | "
              f"{r['audio_s_per_s']:.2f} | {r['underrun_streams']} |" for r in rows]
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", required=True, choices=sorted(PEERS))
    ap.add_argument("--checkpoint", required=True, type=Path, help="a checkpoint folder (q3tts make-checkpoint)")
    ap.add_argument("--batches", default="1", help="comma list of batch sizes for generate")
    ap.add_argument("--stream-chunk", type=int, default=0, help=">0: also stream at this many frames per chunk")
    ap.add_argument("--max-frames", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=2, help="measured calls per batch size / streamed utterances")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 | float32 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--csv", default=None, help="append the rows to this results CSV")
    ap.add_argument("--md", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if not (args.checkpoint / "config.json").is_file():
        ap.error(f"--checkpoint {args.checkpoint}: no config.json there (make one with `q3tts make-checkpoint`)")
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        ap.error(f"--batches {args.batches!r}: give a comma list of whole numbers")
    if not args.batches or min(args.batches) < 1 or args.repeats < 1 or args.max_frames < 1 or args.stream_chunk < 0:
        ap.error("--batches, --repeats and --max-frames must be >= 1, --stream-chunk >= 0")
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"), None)
    if not isinstance(args.dtype, torch.dtype):
        ap.error("--dtype: give a torch dtype name such as bfloat16")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cls = PEERS[args.peer]
    if args.stream_chunk and not cls.streams:
        raise SystemExit(f"--stream-chunk: {args.peer} does not stream audio")
    t0 = time.perf_counter()
    peer = cls(str(args.checkpoint), args.device, args.dtype)
    print(f"{args.peer}: loaded {args.checkpoint} on {args.device} ({args.dtype}) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    rows = []
    for batch in args.batches:
        rows.append(measure_batch(peer, batch, args))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    if args.stream_chunk:
        rows.append(measure_stream(peer, args))
    text = table(rows)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.csv:
        append_csv(args.csv, rows)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
