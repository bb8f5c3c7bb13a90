"""Shared by tests/voices and tests/openai (tests/ is on sys.path): a reference recording, and a real
tritonserver serving a tiny Base checkpoint with a voices directory, its log printed when a test failed."""

from __future__ import annotations

import numpy as np

from q3tts.checkpoint.maker import make_checkpoint
from q3tts.serving.launcher import TritonServer

REF_SR = 16000  # not 24 kHz: registration resamples
REF_TEXT = "This is the reference."
IDLE_S = 3.0


def reference_wav(seed: int = 7) -> np.ndarray:
    """0.6 s at REF_SR (8 codec frames): a modulated two-tone signal plus noise."""
    t = np.arange(int(0.6 * REF_SR)) / REF_SR
    rng = np.random.default_rng(seed)
    wav = (0.25 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
           + 0.1 * np.sin(2 * np.pi * 1375 * t) + 0.03 * rng.standard_normal(t.size))
    return wav.astype(np.float32)


def base_checkpoint(tmp_path_factory, seed: int = 41):
    """A tiny random Base 0.6B checkpoint (a session fixture's body)."""
    return make_checkpoint(tmp_path_factory.mktemp("voices_ckpt") / "base-0.6b", "base", "0.6b", "tiny", seed)


def served(request, checkpoint, tmp_path_factory, **kwargs):
    """A module fixture's body: yield a started CPU server of `checkpoint` (`kwargs`: TritonServer settings
    over these defaults); stop it by PID afterwards and, if a test of the module failed, print the tail of its
    log."""
    failed = request.session.testsfailed
    settings = {"gpus": [], "max_slots": 8, "idle_s": IDLE_S, "ready_timeout_s": 180, **kwargs}
    srv = TritonServer(str(checkpoint), run_dir=tmp_path_factory.mktemp("serve"),
                       voices_dir=tmp_path_factory.mktemp("voices"), **settings)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        if request.session.testsfailed > failed:
            capture = request.config.pluginmanager.getplugin("capturemanager")
            with capture.global_and_fixture_disabled():
                print(f"\n---- tritonserver log ({srv.log_path}), last 200 lines ----")
                print("\n".join(srv.log_text().splitlines()[-200:]))
