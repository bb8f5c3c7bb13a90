"""Triton entry point: the one-shot relay lives in the installed package (q3tts.serving.model)."""

from q3tts.serving.model import OneShotModel as TritonPythonModel  # noqa: F401
