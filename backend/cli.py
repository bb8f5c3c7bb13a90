"""`q3tts` console script: each subcommand lives in its own module exposing `add_arguments` and `run`."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module (imported lazily so `q3tts --help` stays fast)
COMMANDS = {
    "make-checkpoint": ("q3tts.checkpoint.maker", "write a random-weight checkpoint in the released layout"),
    "synth": ("q3tts.synth", "offline synthesis without Triton"),
    "serve": ("q3tts.serving.launcher", "start tritonserver on 127.0.0.1 with the model repository"),
    "render-repository": ("q3tts.serving.render", "write the model repository for a tritonserver you run yourself"),
    "voice": ("q3tts.voices.cli", "register, list and remove reusable voices (offline or on a server)"),
    "openai": ("q3tts.openai_api.cli", "the OpenAI /v1/audio/speech endpoint in front of a Triton server"),
}


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, run the chosen subcommand, return its exit code."""
    parser = argparse.ArgumentParser(prog="q3tts", description="Qwen3-TTS on NVIDIA Triton")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
