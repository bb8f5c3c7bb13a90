"""`q3tts render-repository OUT --model CKPT ...`: a self-contained model repository for a tritonserver the
user runs (a fleet's own ports, model control mode and Python env), and the one place the configs' values
are derived (`q3tts serve` renders through it too).

Derived values are computed here, never typed twice: the batcher's `max_candidate_sequences` is the engine's
`max_slots`, and the idle time is both Triton's `max_sequence_idle_microseconds` and the model's `idle_s`.
EXECUTION_ENV_PATH may be a venv folder (Triton sources its bin/activate) or a packed environment archive
(conda-pack / venv-pack .tar.gz, unpacked by Triton), or `$$TRITON_MODEL_DIRECTORY/...` relative to the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from q3tts_client import protocol
from q3tts.serving.repository import pbtxt_string, render_repository
from q3tts.voices.store import default_voices_dir

ARCHIVES = (".tar.gz", ".tgz")
MODEL_DIR_VAR = "$$TRITON_MODEL_DIRECTORY"


@dataclass(frozen=True)
class RepositorySettings:
    """What the rendered configs say. `gpus` None = one instance on every GPU the server sees; () = CPU, with
    `instances` engine instances (each its own engine process; Triton pins every sequence to one of them)."""

    checkpoint: str
    gpus: tuple[int, ...] | None = None
    dtype: str | None = None  # default: bfloat16 on GPU, float32 on CPU
    max_slots: int | None = None  # default: 64 on GPU, 8 on CPU
    pool: dict = field(default_factory=dict)  # EngineConfig overrides
    idle_s: float = 30.0
    chunk_schedule: str | None = None
    voices_dir: str | None = None  # default: q3tts.voices.store.default_voices_dir()
    voice_cache_size: int | None = None
    execution_env: str | None = None  # EXECUTION_ENV_PATH; None = the server's own python3
    instances: int = 1  # CPU engine instances (on GPUs: one per GPU)
    max_server_memory_gib: float = 16.0  # over it the health probe says not ready (serving/health.py); 0 = none

    def __post_init__(self) -> None:
        if "max_slots" in self.pool:  # it is also the batcher's max_candidate_sequences: one value, one flag
            raise ValueError("set the engine slots with --max-slots, not --pool max_slots=...")
        if self.instances < 1:
            raise ValueError(f"--instances must be >= 1, got {self.instances}")
        if not self.max_server_memory_gib >= 0:
            raise ValueError(f"--max-server-memory-gib must be >= 0 (0 = no budget), got {self.max_server_memory_gib}")
        if self.on_gpu and self.instances != 1:
            raise ValueError(f"--instances {self.instances} is for CPU serving (--gpus none); on GPUs there is "
                             "one instance per GPU (--gpus)")

    @property
    def on_gpu(self) -> bool:
        return self.gpus != ()

    @property
    def slots(self) -> int:
        return self.max_slots or (64 if self.on_gpu else 8)

    @property
    def engine_instances(self) -> int | None:
        """The sequence model's instances (engines); None = one per GPU the server sees, unknown here."""
        if not self.on_gpu:
            return self.instances
        return len(self.gpus) if self.gpus is not None else None

    def instance_group(self, first_only: bool = False) -> str:
        if not self.on_gpu:
            return f"{{ count: {1 if first_only else self.instances}, kind: KIND_CPU }}"
        gpus = (self.gpus or (0,))[:1] if first_only else self.gpus
        where = f", gpus: [ {', '.join(map(str, gpus))} ]" if gpus is not None else ""
        return f"{{ count: 1, kind: KIND_GPU{where} }}"

    def values(self) -> dict[str, str]:
        """The template values of model_repository/*/config.pbtxt.tmpl."""
        engine_cfg = {"max_slots": self.slots, "dtype": self.dtype or ("bfloat16" if self.on_gpu else "float32"),
                      "device": "cuda" if self.on_gpu else "cpu",
                      **({"tune_cache": str(default_tune_cache())} if self.on_gpu else {}), **self.pool}
        env = pbtxt_string(self.execution_env or "")
        env_param = f',\n  {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: {env} }} }}' if self.execution_env else ""
        return {
            "max_candidate_sequences": str(self.slots),
            "max_sequence_idle_microseconds": str(int(self.idle_s * 1e6)),
            "instance_group": self.instance_group(),
            "checkpoint": pbtxt_string(self.checkpoint),
            "engine_config": pbtxt_string(json.dumps(engine_cfg)),
            "chunk_schedule": pbtxt_string(self.chunk_schedule or ",".join(map(str, protocol.DEFAULT_CHUNK_SCHEDULE))),
            "idle_s": pbtxt_string(str(self.idle_s)),
            "max_server_memory_gib": pbtxt_string(str(self.max_server_memory_gib)),
            "execution_env_param": env_param,
            "voices_dir": pbtxt_string(self.voices_dir or str(default_voices_dir())),
            "voice_cache_size": pbtxt_string(str(self.voice_cache_size or "")),
            "voices_instance_group": self.instance_group(first_only=True),  # encodes on one GPU / one CPU instance
        }


def check_execution_env(path: str) -> str:
    """`path` as EXECUTION_ENV_PATH: a venv with bin/activate, a packed .tar.gz, or a path under the model
    directory (checked by Triton at load). Refuses anything else, naming it."""
    if path.startswith(MODEL_DIR_VAR):
        return path
    p = Path(path).resolve()
    if p.is_dir():
        if not (p / "bin" / "activate").exists():
            raise ValueError(f"--execution-env {path}: a folder must be a venv (no bin/activate there)")
    elif not p.is_file() or not p.name.endswith(ARCHIVES):
        raise ValueError(f"--execution-env {path}: neither a venv folder nor a packed env archive (.tar.gz)")
    return str(p)


# --- CLI ----------------------------------------------------------------------------------------------------
def add_settings_arguments(p: argparse.ArgumentParser) -> None:
    """The flags `q3tts serve` and `q3tts render-repository` share (RepositorySettings fields)."""
    p.add_argument("--model", required=True, help="checkpoint folder (as the server will see it) or hub id")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-slots", type=int, default=None,
                   help="engine slots per instance = the batcher's candidate sequences (default 64 GPU / 8 CPU)")
    p.add_argument("--pool", default="", help="EngineConfig overrides, e.g. num_pages=4096,page_size=16,max_queue=256")
    p.add_argument("--idle-s", type=float, default=30.0,
                   help="a sequence with no request for this long is closed (text at LLM pace can pause)")
    p.add_argument("--chunk-schedule", default=None, help="frames per response, e.g. 1,2,4,8,12 (last repeats)")
    p.add_argument("--voices-dir", type=Path, default=None,
                   help=f"registered voices, read by VOICE inputs (default {default_voices_dir()})")
    p.add_argument("--voice-cache-size", type=int, default=None,
                   help="voice files held read per instance (LRU; their device tensors: --pool voice_cache_bytes=N)")
    p.add_argument("--instances", type=int, default=1,
                   help="CPU engine instances (with --gpus none), each its own engine process; a sequence "
                        "stays on the instance that started it (on GPUs: one instance per GPU)")
    p.add_argument("--max-server-memory-gib", type=float, default=RepositorySettings.max_server_memory_gib,
                   help="the health probe says not ready once tritonserver holds more (Triton 2.51 leaks refused "
                        "requests whose clients cancel: a fleet then replaces the server); 0 = no budget")


def default_tune_cache() -> Path:
    """Where GPU engines keep their tuned kernel configs (EngineConfig.tune_cache): $Q3TTS_TUNE_CACHE, else
    $XDG_CACHE_HOME/q3tts/tuning.pkl (~/.cache/q3tts/tuning.pkl). `--pool tune_cache=null` turns it off."""
    if os.environ.get("Q3TTS_TUNE_CACHE"):
        return Path(os.environ["Q3TTS_TUNE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "q3tts" / "tuning.pkl"


def parse_pool(spec: str | None) -> dict:
    """'num_pages=512,page_size=16,kv_policy=reserve' -> dict with ints/floats decoded (EngineConfig fields)."""
    out: dict = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--pool entries are key=value, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def parse_instance_gpus(spec: str) -> tuple[int, ...] | None:
    """--gpus of render-repository: each | all -> None (every GPU the server sees), none -> (), '0,1'."""
    if spec in ("each", "all"):
        return None
    if spec in ("none", "cpu", ""):
        return ()
    try:
        return tuple(int(x) for x in spec.split(",") if x)
    except ValueError:
        raise ValueError(f"--gpus must be each, none or GPU indices like 0,1; got {spec!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="the repository folder to write (replaced if it exists)")
    add_settings_arguments(p)
    p.add_argument("--gpus", default="each",
                   help="each = one instance on every GPU the server sees | none (CPU) | 0,1 (these GPUs)")
    p.add_argument("--execution-env", default=None,
                   help="EXECUTION_ENV_PATH: a venv or packed env archive (.tar.gz) with q3tts and numpy<2 "
                        "(default: the server's own python3)")


def settings_from_args(args: argparse.Namespace, gpus: tuple[int, ...] | None,
                       execution_env: str | None) -> RepositorySettings:
    model = Path(args.model)
    return RepositorySettings(
        checkpoint=str(model.resolve()) if model.exists() else args.model, gpus=gpus, dtype=args.dtype,
        max_slots=args.max_slots, pool=parse_pool(args.pool), idle_s=args.idle_s, chunk_schedule=args.chunk_schedule,
        voices_dir=str(Path(args.voices_dir or default_voices_dir()).resolve()),
        voice_cache_size=args.voice_cache_size, execution_env=execution_env, instances=args.instances,
        max_server_memory_gib=args.max_server_memory_gib)


def run(args: argparse.Namespace) -> int:
    try:
        gpus = parse_instance_gpus(args.gpus)
        env = check_execution_env(args.execution_env) if args.execution_env else None
        if args.chunk_schedule:
            protocol.parse_chunk_schedule(args.chunk_schedule)
        settings = settings_from_args(args, gpus, env)
    except ValueError as e:
        print(f"q3tts render-repository: {e}", file=sys.stderr)
        return 2
    out = render_repository(args.out.resolve(), settings.values())
    models = sorted(p.name for p in out.iterdir() if (p / "config.pbtxt").exists())
    print(f"wrote {out}: {', '.join(models)} (load {protocol.MODEL} before {protocol.ONESHOT_MODEL})")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="q3tts render-repository")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
