"""A fake `triton_python_backend_utils` (installed before q3tts.serving.model is imported) and a
RecordingSender, so the glue runs without a server (the TRT-LLM test_llmapi_python_backend.py pattern)."""

from __future__ import annotations

import json
import sys
import threading
import types

import numpy as np

FINAL = 1


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=0):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class Tensor:
    def __init__(self, name, data):
        self._name, self._data = name, np.asarray(data)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._data


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self.tensors = {t.name(): t.as_numpy() for t in (output_tensors or [])}
        self.error = error


class _Metric:
    def __init__(self, labels=None, buckets=None):
        self.value, self.observed = 0.0, []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = range(3)

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels=None, buckets=None):
        return _Metric(labels, buckets)


class Logger:
    lines: list = []

    @classmethod
    def _log(cls, msg):
        cls.lines.append(msg)

    log_info = log_warn = log_error = log_verbose = _log


fake = types.ModuleType("triton_python_backend_utils")
fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
fake.TritonError, fake.Tensor, fake.InferenceResponse = TritonError, Tensor, InferenceResponse
fake.MetricFamily, fake.Logger = MetricFamily, Logger
fake.is_model_ready = lambda model_name, model_version="": True  # every model is loaded
sys.modules["triton_python_backend_utils"] = fake


class RecordingSender:
    """Records every send; asserts nothing follows a FINAL."""

    def __init__(self):
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.cancelled = False
        self.lock = threading.Lock()

    def send(self, response=None, flags=0):
        with self.lock:
            assert not self.finals, "send after FINAL"
            self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled

    @property
    def finals(self):
        return [r for r, f in self.sent if f & FINAL]

    @property
    def audio(self):
        return [r.tensors["AUDIO"] for r, _ in self.sent if r is not None and "AUDIO" in r.tensors]

    @property
    def error(self):
        """The TritonError, or the ERROR output of a request that failed after streaming audio."""
        errs = [r.error for r, _ in self.sent if r is not None and r.error is not None]
        errs += [TritonError(r.tensors["ERROR"][0].decode(), {b"cancelled": TritonError.CANCELLED}.get(
            r.tensors["FINISH_REASON"][0], TritonError.INTERNAL)) for r, _ in self.sent
            if r is not None and "ERROR" in r.tensors]
        return errs[0] if errs else None


class FakeRequest:
    def __init__(self, corr_id, text=None, start=False, end=False, params=None, **inputs):
        self.corr_id, self._flags = corr_id, (1 if start else 0) | (2 if end else 0)
        self._inputs = {}
        if text is not None:
            self._inputs["TEXT"] = np.array([text.encode()], dtype=object)
        for name, value in inputs.items():
            self._inputs[name] = np.array([value.encode()], dtype=object) if isinstance(value, str) else value
        self._params = json.dumps(params or {})
        self.sender = RecordingSender()

    def inputs(self):
        return [Tensor(k, v) for k, v in self._inputs.items()]

    def parameters(self):
        return self._params

    def correlation_id(self):
        return self.corr_id

    def flags(self):
        return self._flags

    def get_response_sender(self):
        return self.sender
