"""Triton entry point: the voices model lives in the installed package (q3tts.serving.model)."""

from q3tts.serving.model import VoicesModel as TritonPythonModel  # noqa: F401
