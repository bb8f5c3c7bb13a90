"""Triton entry point: the model lives in the installed package (q3tts.serving.model)."""

from q3tts.serving.model import TritonPythonModel  # noqa: F401
