"""Triton entry point: the model lives in the installed package (q3tts.serving.triton_model)."""

from q3tts.serving.triton_model import TritonPythonModel  # noqa: F401
