"""A client box: `pip install ./client` into a fresh venv without torch, as a fleet's client machines do
(dependencies from PyPI), then `q3tts-client --help` and an import of every client module there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from q3tts_client import protocol as P

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

_IMPORT_ALL = """
import importlib, importlib.util, sys
for name in sys.argv[1:]:
    importlib.import_module("q3tts_client." + name)
assert importlib.util.find_spec("torch") is None, "torch is importable in the client venv"
print("imported", len(sys.argv) - 1)
"""


def _run(cmd: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:4]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_client_installs_and_runs_without_torch(tmp_path):
    src = tmp_path / "src"  # a copy: the in-tree build would leave build/ and egg-info in client/
    shutil.copytree(CLIENT_DIR, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-compile", "-q", src], tmp_path)
    help_text = _run([venv / "bin" / "q3tts-client", "--help"], tmp_path).stdout
    for name in P.SAMPLING_PARAMS:
        assert f"--{name.replace('_', '-')}" in help_text
    for flag in ("--sequence-id", "--ssl", "--root-certificates", "--private-key", "--certificate-chain",
                 "--out", "--play"):
        assert flag in help_text
    modules = sorted(p.stem for p in CLIENT_DIR.glob("*.py") if p.stem != "__init__")
    assert {"cli", "protocol", "stream_client"} <= set(modules)
    out = _run([python, "-c", _IMPORT_ALL, *modules], tmp_path).stdout
    assert out.strip() == f"imported {len(modules)}"
