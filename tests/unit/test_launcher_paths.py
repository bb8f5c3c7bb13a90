"""`q3tts serve --run-dir rel/path`: tritonserver runs with the run dir as its cwd, so every path the
launcher hands it must be absolute (a relative one made the server exit: 'failed to stat file')."""

from __future__ import annotations

from pathlib import Path

from q3tts.serving.launcher import TritonServer


def test_relative_run_dir_and_model_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    server = TritonServer("ckpt", run_dir=Path("run/x"), gpus=[])
    assert server.run_dir == tmp_path / "run" / "x"
    assert server.model == str(tmp_path / "ckpt")
