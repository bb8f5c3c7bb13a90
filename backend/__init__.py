"""q3tts: a Qwen3-TTS 12 Hz inference engine served from NVIDIA Triton (import name of `backend/`)."""

__version__ = "0.1.0"
