"""`q3tts voice add|list|rm`: manage registered voices, offline (a voices directory) or on a running server
(`--url`: the `qwen3_tts_voices` model encodes and writes, so the change is live at once).

    q3tts voice add alice --model ./Qwen3-TTS-12Hz-0.6B-Base --ref-audio alice.wav --ref-text "Hi, I'm Alice."
    q3tts voice add narrator --model BASE --design "a calm, deep male voice" --design-model VOICEDESIGN \\
        --script "It was a quiet evening in the old town."
    q3tts voice add bob --url 127.0.0.1:8001 --ref-audio bob.wav --xvector-only
    q3tts voice list [--json]          q3tts voice rm alice
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from q3tts.codec.audio import SAMPLE_RATE
from q3tts.core import InvalidRequest
from q3tts.voices.store import VoiceError, VoiceStore, default_voices_dir
from q3tts_client.voices import VoicesClient, VoicesError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    actions = parser.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="register a voice from reference audio or a VoiceDesign description")
    add.add_argument("name", help="1-64 letters, digits, '-' or '_' (stored lower-case)")
    add.add_argument("--model", help="the Base checkpoint the voice is made for (offline)")
    add.add_argument("--ref-audio", type=Path, help="reference recording (any rate 8-192 kHz, <= 60 s)")
    add.add_argument("--ref-text", help="transcript of the reference (ICL voices)")
    add.add_argument("--xvector-only", action="store_true", help="keep only the speaker embedding")
    add.add_argument("--design", help="VoiceDesign description rendered once into the reference (offline)")
    add.add_argument("--design-model", help="VoiceDesign checkpoint that renders --design")
    add.add_argument("--script", help="what the design voice says in its reference (its transcript)")
    add.add_argument("--language", default="auto", help="language of --script")
    add.add_argument("--seed", type=int, default=0, help="sampling seed of the design rendering")
    add.add_argument("--max-frames", type=int, default=None, help="cap of the design rendering, 80 ms frames "
                     "(default: the longest reference, 60 s)")
    add.add_argument("--device", default="cpu", help="where the encoders run offline (cpu | cuda)")
    for name, help_text in (("list", "list registered voices"), ("rm", "remove a voice")):
        p = actions.add_parser(name, help=help_text)
        if name == "rm":
            p.add_argument("name")
        if name == "list":
            p.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    for p in (add, *[actions.choices[n] for n in ("list", "rm")]):
        where = p.add_mutually_exclusive_group()
        where.add_argument("--voices-dir", type=Path, default=None,
                           help=f"offline voices directory (default {default_voices_dir()})")
        where.add_argument("--url", help="gRPC host:port of a running server: manage its voices instead")


class UsageError(VoiceError):
    """The flags do not describe one way to make a voice."""


def _reference(args) -> tuple:
    """(wav [n], sample rate, transcript, source, prompt) from the add flags."""
    if args.design:
        if args.ref_audio or not (args.design_model and args.script):
            raise UsageError("--design needs --design-model and --script (and no --ref-audio)")
        from q3tts.voices.enroll import render_design

        pcm = render_design(args.design_model, args.design, args.script, args.language, args.seed, args.device,
                            **({"max_frames": args.max_frames} if args.max_frames else {}))
        return pcm, SAMPLE_RATE, args.script, "design", args.design
    if not args.ref_audio:
        raise UsageError("voice add needs --ref-audio (with --ref-text or --xvector-only) or --design")
    from q3tts.codec.voice import read_reference

    try:
        wav, sr = read_reference(args.ref_audio)
    except InvalidRequest as e:
        raise UsageError(f"--ref-audio: {e}") from None
    return wav, sr, args.ref_text, "audio", None


def _add(args) -> dict:
    if not (args.model or args.url):
        raise UsageError("voice add needs --model (the Base checkpoint) or --url (a running server)")
    wav, sr, text, source, prompt = _reference(args)
    if args.url:
        with VoicesClient(args.url) as client:
            return client.add(args.name, wav, sr, text, args.xvector_only)
    from q3tts.voices.enroll import Enroller

    voice = Enroller.from_checkpoint(args.model, args.device).enroll(
        args.name, wav, sr, text, args.xvector_only, source, prompt)
    return _store(args).add(voice).info()


def _store(args) -> VoiceStore:
    return VoiceStore(args.voices_dir or default_voices_dir())


def _print_table(voices: list[dict]) -> None:
    for v in voices:
        if "error" in v:
            print(f"{v['name']:<24} unreadable: {v['error']}")
            continue
        fam = v["family"]
        kind = "x-vector only" if v["xvector_only"] else f"ICL, {v['frames']} frames"
        print(f"{v['name']:<24} {fam['variant']}-{fam['size']} x{fam['xvector_dim']:<6} {kind:<20} "
              f"{(v.get('ref_text') or '')[:40]!r}")


def _list(args) -> list[dict]:
    if args.url:
        with VoicesClient(args.url) as client:
            return client.catalogue()["voices"]
    return _store(args).list()


def _remove(args) -> None:
    if args.url:
        with VoicesClient(args.url) as client:
            client.remove(args.name)
    else:
        _store(args).remove(args.name)


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "add":
            info = _add(args)
            print(f"registered voice {info['name']!r} ({info['sha256'][:12]})")
        elif args.action == "rm":
            _remove(args)
            print(f"removed voice {args.name!r}")
        else:
            voices = _list(args)
            print(json.dumps(voices, indent=2)) if args.json else _print_table(voices)
    except (VoiceError, VoicesError) as e:
        print(f"q3tts voice: {e}", file=sys.stderr)
        return 1
    return 0
