"""Reusable voices: Base voices registered once by name and used by any later request.

`store` (the voices directory: one safetensors file per voice, atomic writes), `cache` (the serving side's
LRU of resolved voices), `enroll` (reference audio or a VoiceDesign description -> a voice) and `cli`
(`q3tts voice add|list|rm`).
"""
