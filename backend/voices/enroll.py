"""Making a voice: reference audio (or a VoiceDesign description rendered once) -> `Voice`.

`Enroller` loads only what encoding needs from a Base checkpoint (the `speaker_encoder.*` weights and the
codec's `encoder.*` weights), so the serving voices model stays small beside the engine. Encoding itself is
`q3tts.codec.voice.encode_reference`, the one implementation the engine also uses for REF_AUDIO requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from q3tts.checkpoint.loader import MAIN_WEIGHTS, SHARD_INDEX, resolve_path
from q3tts.config import CodecConfig, ModelConfig
from q3tts.core import InvalidRequest, SamplingParams, VoiceSpec
from q3tts.voices.store import Family, Voice, VoiceError, check_name
from q3tts_client import protocol as P


def _weight_files(root: Path) -> list[Path]:
    if (root / MAIN_WEIGHTS).is_file():
        return [root / MAIN_WEIGHTS]
    weight_map = json.loads((root / SHARD_INDEX).read_text())["weight_map"]
    return [root / shard for shard in sorted(set(weight_map.values()))]


def _read_prefixed(files: list[Path], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors whose key starts with `prefix`, prefix removed (other tensors are not read)."""
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    out[key[len(prefix):]] = f.get_tensor(key)
    return out


class Enroller:
    """Reference audio -> `Voice` for one Base checkpoint family."""

    def __init__(self, family: Family, speaker_encoder, codec_encoder):
        self.family, self.speaker_encoder, self.codec_encoder = family, speaker_encoder, codec_encoder

    @classmethod
    def from_checkpoint(cls, path_or_hub_id: str | Path, device: str = "cpu",
                        dtype: torch.dtype = torch.float32) -> Enroller:
        """Load the speaker encoder and the codec encoder of a Base checkpoint (VoiceError otherwise)."""
        from q3tts.codec.encoder import CodecEncoder
        from q3tts.models.speaker_encoder import SpeakerEncoder

        root = resolve_path(path_or_hub_id)
        config = ModelConfig.from_dict(json.loads((root / "config.json").read_text()))
        if config.variant != "base":
            raise VoiceError(f"voices are made with a Base checkpoint; {root} is {config.variant}")
        speaker = SpeakerEncoder(config.speaker_encoder)
        speaker.load_state_dict(_read_prefixed(_weight_files(root), "speaker_encoder."), strict=True)
        codec_dir = root / "speech_tokenizer"
        codec_config = CodecConfig.from_dict(json.loads((codec_dir / "config.json").read_text()))
        codec_weights = _read_prefixed([codec_dir / "model.safetensors"], "encoder.")
        encoder = CodecEncoder.from_weights(codec_config, {f"encoder.{k}": v for k, v in codec_weights.items()},
                                            dtype, device)
        return cls(Family.of(config), speaker.to(device=device, dtype=dtype).eval(), encoder)

    def enroll(self, name: str, wav: np.ndarray, sample_rate: int, ref_text: str | None = None,
               xvector_only: bool = False, source: str = "audio", prompt: str | None = None) -> Voice:
        """Encode one reference recording into an unsaved `Voice` (VoiceError names the voice and what is
        wrong; the recording's limits are `q3tts.codec.voice.check_reference`'s).

        ICL voices (the default) need `ref_text`, the transcript of the recording; `xvector_only` keeps
        only the speaker embedding.
        """
        from q3tts.codec.voice import encode_reference

        name = check_name(name)
        if not xvector_only and not (ref_text or "").strip():
            raise VoiceError(f"voice {name!r}: the transcript of the reference (ref_text) is required, "
                             "or register an x-vector-only voice")
        try:
            codes, xvector = encode_reference(self, self.codec_encoder, wav, int(sample_rate))
        except InvalidRequest as e:
            raise VoiceError(f"voice {name!r}: {e}") from None
        return Voice(name, self.family, xvector, None if xvector_only else codes,
                     None if xvector_only else ref_text.strip(), source, prompt)


MAX_DESIGN_FRAMES = P.MAX_REF_SECONDS * P.SAMPLE_RATE // P.SAMPLES_PER_FRAME


def render_design(design_model: str | Path, description: str, script: str, language: str = "auto",
                  seed: int = 0, device: str = "cpu", max_frames: int = MAX_DESIGN_FRAMES) -> np.ndarray:
    """Speak `script` once with a VoiceDesign checkpoint in the voice `description` -> pcm [n] at 24 kHz
    (at most `max_frames` 80 ms frames), the reference a design voice is enrolled from."""
    from q3tts.engine.batch import BatchRequest, run_requests
    from q3tts.engine.config import EngineConfig
    from q3tts.engine.engine import Engine

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    engine = Engine.from_checkpoint(str(design_model), EngineConfig(device=device, dtype=dtype, max_slots=1,
                                                                    use_cuda_graphs=False))
    if engine.checkpoint.config.variant != "voice_design":
        raise VoiceError(f"--design needs a VoiceDesign checkpoint; {design_model} is "
                         f"{engine.checkpoint.config.variant}")
    sampling = SamplingParams.from_generation_config(engine.checkpoint.generation, seed=seed,
                                                     max_frames=max_frames)
    request = BatchRequest("design", script, VoiceSpec(instruct=description, language=language), sampling)
    result = run_requests(engine, [request], write=False)["design"]
    if result.reason not in ("eos", "max_frames") or result.pcm.size == 0:
        raise VoiceError(f"rendering the design voice failed: {result.error or result.reason}")
    return result.pcm
