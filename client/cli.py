"""`q3tts-client`: stream text to the Qwen3-TTS Triton server, get the audio back (examples: --help).

Every request parameter of the protocol has a flag (unset: the server's default). The audio goes to a
WAV file, to stdout as raw PCM as it arrives (`--out -`, to pipe into a player) and/or to the speakers
(`--play`). A progress line goes to stderr when it is a terminal, then a summary: time to first audio
(TTFA: first request sent -> first audio response) and RTF (wall time / audio seconds).
No torch: tritonclient, numpy, soundfile (and sounddevice for --play).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from tritonclient.utils import InferenceServerException

from q3tts_client import protocol as P
from q3tts_client.audio_out import PlaybackUnavailable, RawPcm, Speakers, write_wav
from q3tts_client.stream_client import Result, Tls, synthesize

DESCRIPTION = "Stream text to the Qwen3-TTS Triton server (gRPC) and get the audio back."
EXAMPLES = """examples:
  q3tts-client --url HOST:8001 --text "Hello there." --speaker ryan --out hello.wav
  some_llm | q3tts-client --speaker ryan --out reply.wav       # stdin: each line is one text piece
  q3tts-client --text "Hello." --speaker ryan --audio-format int16 --out - | aplay -f S16_LE -r {rate} -c 1
  q3tts-client --text "Hello." --speaker ryan --out - | ffplay -f f32le -ar {rate} -ac 1 -nodisp -autoexit -
  q3tts-client --text "Hello." --speaker ryan --play            # needs pip install './client[play]'
  q3tts-client --url HOST:8001 --ssl --root-certificates ca.pem --text "Hello." --speaker ryan
  q3tts-client --text "Load check." --speaker ryan --concurrency 8
"""


def correlation_id(text: str) -> int | str:
    """'42' -> 42 (an unsigned integer correlation ID), anything else -> that string (a string ID)."""
    if text.isdigit():
        value = int(text)
        if not 0 < value < 2 ** 64:
            raise argparse.ArgumentTypeError(f"an integer correlation ID must be in 1..2^64-1, got {text}")
        return value
    if not text.strip():
        raise argparse.ArgumentTypeError("a correlation ID must not be empty")
    return text


def _chunk_schedule(text: str) -> str:
    try:
        P.parse_chunk_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _pem_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def _add_sampling_flags(ap: argparse.ArgumentParser) -> None:
    """One flag per `protocol.SAMPLING_PARAMS` entry, typed as the protocol declares it."""
    group = ap.add_argument_group("sampling (sent on START; unset: the server's default, from the "
                                  "checkpoint's generation_config.json)")
    for name, kind in P.SAMPLING_PARAMS.items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"request parameter {name}")
        else:
            group.add_argument(flag, dest=name, type=kind, default=None, metavar=kind.__name__.upper(),
                               help=f"request parameter {name} ({kind.__name__})")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="q3tts-client", description=DESCRIPTION,
                                 epilog=EXAMPLES.format(rate=P.SAMPLE_RATE),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    server = ap.add_argument_group("server")
    server.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port of tritonserver")
    server.add_argument("--sequence-id", type=correlation_id, default=None, metavar="ID",
                        help="correlation ID: an unsigned integer, or any other text for a string ID "
                             "(default: a fresh integer); with --concurrency N, stream i uses ID+i or ID-i")
    server.add_argument("--timeout-s", type=float, default=600.0)
    tls = ap.add_argument_group("TLS (tritonclient's gRPC options; a certificate option implies --ssl)")
    tls.add_argument("--ssl", action="store_true", help="connect over TLS")
    tls.add_argument("--root-certificates", type=_pem_file, metavar="PEM",
                     help="CA certificates to verify the server (default: the system's)")
    tls.add_argument("--private-key", type=_pem_file, metavar="PEM", help="client key (mutual TLS)")
    tls.add_argument("--certificate-chain", type=_pem_file, metavar="PEM", help="client certificate chain")
    voice = ap.add_argument_group("text and voice")
    voice.add_argument("--text", default=None, help="the text (default: stdin, one piece per line)")
    voice.add_argument("--speaker", default=None)
    voice.add_argument("--voice", default=None, help="a registered voice (q3tts voice add; Base models)")
    voice.add_argument("--language", default=None)
    voice.add_argument("--instruct", default=None)
    voice.add_argument("--ref-audio", default=None, help="reference recording for voice cloning (Base models)")
    voice.add_argument("--ref-text", default=None, help="transcript of --ref-audio")
    voice.add_argument("--xvector-only", action="store_true", default=None,
                       help="clone from the speaker embedding of --ref-audio only (no --ref-text needed)")
    voice.add_argument("--text-mode", default=None, choices=["whole", "incremental"])
    _add_sampling_flags(ap)
    out = ap.add_argument_group("output")
    out.add_argument("--audio-format", default=None, choices=sorted(P.AUDIO_FORMATS),
                     help="samples on the wire (and in --out -): float32 (default) or int16")
    out.add_argument("--chunk-schedule", type=_chunk_schedule, default=None,
                     help="frames per response, e.g. 1,2,4,8 (the last entry repeats)")
    out.add_argument("--out", default=None, metavar="PATH",
                     help="a WAV file, or - for raw PCM on stdout as it arrives (default: out.wav, "
                          "or nothing with --play)")
    out.add_argument("--play", action="store_true", help="play on the speakers as it arrives")
    out.add_argument("--quiet", action="store_true", help="no progress line and no summary")
    out.add_argument("--concurrency", type=int, default=1,
                     help="N concurrent sequences of the same text: a load check that keeps no audio")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked as a whole (argparse's usage error, exit status 2, on a conflict)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.concurrency < 1:
        ap.error(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.concurrency > 1 and (args.out is not None or args.play):
        ap.error("--concurrency is a load check that keeps no audio: not with --out or --play")
    if (args.private_key is None) != (args.certificate_chain is None):
        ap.error("--private-key and --certificate-chain go together (mutual TLS)")
    if args.out is None and not args.play and args.concurrency == 1:
        args.out = "out.wav"
    return args


def request_params(args: argparse.Namespace) -> dict:
    """The request parameters the flags set (unset ones are left to the server)."""
    params = {name: getattr(args, name) for name in P.SAMPLING_PARAMS}
    params.update({P.PARAM_TEXT_MODE: args.text_mode, P.PARAM_AUDIO_FORMAT: args.audio_format,
                   P.PARAM_CHUNK_SCHEDULE: args.chunk_schedule, P.PARAM_XVECTOR_ONLY: args.xvector_only})
    return {k: v for k, v in params.items() if v is not None}


def tls_options(args: argparse.Namespace) -> Tls | None:
    if not (args.ssl or args.root_certificates or args.private_key):
        return None
    return Tls(args.root_certificates, args.private_key, args.certificate_chain)


def stream_ids(base: int | str | None, n: int) -> list:
    """Correlation IDs of n concurrent streams: fresh ones, base + i, or 'base-i'."""
    if base is None:
        return [None] * n
    if n == 1:
        return [base]
    return [base + i if isinstance(base, int) else f"{base}-{i}" for i in range(n)]


def _voice(args: argparse.Namespace) -> dict:
    voice = {"speaker": args.speaker, "language": args.language, "instruct": args.instruct,
             "ref_text": args.ref_text, "voice": args.voice}
    if args.ref_audio:
        import soundfile as sf

        try:
            audio, sr = sf.read(args.ref_audio, dtype="float32", always_2d=True)
        except (OSError, RuntimeError) as e:  # missing file, unknown format
            raise SystemExit(f"error: --ref-audio {args.ref_audio}: {e}") from None
        voice.update(ref_audio=audio.mean(axis=1), ref_sample_rate=sr)
    return voice


class Progress:
    """One line on `stream`, rewritten at every audio chunk, when `stream` is a terminal."""

    def __init__(self, stream) -> None:
        self.stream, self.live, self.shown = stream, stream.isatty(), False

    def __call__(self, res: Result, samples: int) -> None:
        if not self.live:
            return
        ttfa = f", TTFA {1000 * res.ttfa_s:.0f} ms" if res.ttfa_s is not None else ""
        print(f"\r{res.chunks} chunks, {samples / res.sample_rate:6.2f} s audio{ttfa}", end="",
              file=self.stream, flush=True)
        self.shown = True

    def end(self) -> None:
        if self.shown:
            print(file=self.stream)


def _stdin_pieces():
    for line in sys.stdin:
        line = line.rstrip("\n")
        if line.strip():
            yield line + " "


def _fan_out(sinks: list):
    def on_audio(audio: np.ndarray, sample_rate: int) -> None:
        for sink in sinks:
            sink(audio, sample_rate)
    return on_audio


def run_one(args: argparse.Namespace, voice: dict, params: dict, tls: Tls | None) -> int:
    """One sequence: text from --text or stdin, audio to --out / stdout / the speakers."""
    speakers = Speakers() if args.play else None
    sinks = [RawPcm(sys.stdout.buffer)] if args.out == "-" else []
    sinks += [speakers] if speakers is not None else []
    progress = Progress(sys.stderr) if not args.quiet else None
    pieces = [args.text] if args.text is not None else _stdin_pieces()
    try:
        res = synthesize(args.url, pieces, voice, params, sequence_id=args.sequence_id,
                         timeout_s=args.timeout_s, on_chunk=progress, on_audio=_fan_out(sinks), tls=tls)
    finally:
        if progress is not None:
            progress.end()
        if speakers is not None:
            speakers.close()
    if res.error:
        print(f"error: {res.error}", file=sys.stderr)
        return 1
    if args.out not in (None, "-"):
        write_wav(args.out, res.audio, res.sample_rate)
    if not args.quiet:
        where = {None: "played", "-": "wrote to stdout"}.get(args.out, f"wrote {args.out}")
        print(f"{where}: {res.audio_s:.2f} s at {res.sample_rate} Hz, {res.chunks} chunks, "
              f"finish={res.finish_reason}, sequence {res.sequence_id}, TTFA {1000 * (res.ttfa_s or 0):.1f} ms, "
              f"RTF {res.rtf if res.rtf is not None else float('nan'):.3f}", file=sys.stderr)
    return 0


def run_load_check(args: argparse.Namespace, voice: dict, params: dict, tls: Tls | None) -> int:
    """--concurrency N streams of the same text at once: TTFA and throughput, no audio kept."""
    text = args.text if args.text is not None else sys.stdin.read()
    ids = stream_ids(args.sequence_id, args.concurrency)
    results: list = [None] * args.concurrency
    t0 = time.perf_counter()

    def one(i):
        try:
            results[i] = synthesize(args.url, [text], voice, params, sequence_id=ids[i],
                                    timeout_s=args.timeout_s, tls=tls)
        except Exception as e:  # noqa: BLE001 - one failed stream is counted, not a crash of the check
            results[i] = Result(ids[i] or -1, np.zeros(0, np.float32), error=f"client: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    ttfa = sorted(1000 * r.ttfa_s for r in results if r.ttfa_s is not None)
    audio = sum(r.audio_s for r in results)
    if ttfa:
        print(f"{args.concurrency} streams: TTFA p50 {ttfa[len(ttfa) // 2]:.1f} ms, max {ttfa[-1]:.1f} ms; "
              f"{audio:.2f} audio-s in {wall:.2f} s = {audio / wall:.2f} audio-s/s; errors {len(errors)}")
    for e in errors[:3]:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    voice, params, tls = _voice(args), request_params(args), tls_options(args)
    run = run_load_check if args.concurrency > 1 else run_one
    try:
        return run(args, voice, params, tls)
    except (PlaybackUnavailable, InferenceServerException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the player reading stdout went away: stop quietly, like any pipe writer
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
