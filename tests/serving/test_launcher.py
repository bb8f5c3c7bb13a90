"""What the launcher does without a server: the repository rendered from the protocol, strictly, and the
processes of a run dir found and stopped by PID."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from q3tts_client import protocol as P
from q3tts.serving import runtime
from q3tts.serving.launcher import TritonServer
from q3tts.serving.repository import render_repository

ROW = re.compile(r'\{ name: "(\w+)" data_type: (\w+) dims: \[ ([-\d, ]+) \]( optional: true)? \}')


def values(tmp_path) -> dict[str, str]:
    """What `q3tts serve` renders the templates with, for a CPU server."""
    rt = runtime.Runtime(Path("/x/bin/tritonserver"), Path("/x/backends"), (), Path(sys.prefix), "3.11")
    return TritonServer("ckpt", run_dir=tmp_path / "run", gpus=[]).template_values(rt)


def tables(config: str) -> dict[str, dict]:
    out = {}
    for section in ("input", "output"):
        body = re.search(rf"^{section} \[\n(.*?)\n\]", config, re.S | re.M).group(1)
        out[section] = {m[0]: (m[1], [int(d) for d in m[2].split(",")], bool(m[3])) for m in ROW.findall(body)}
        assert len(out[section]) == len(body.splitlines())  # every row parsed
    return out


@pytest.mark.parametrize("model", [P.MODEL, P.ONESHOT_MODEL])
def test_config_tables_are_the_protocol(tmp_path, model):
    render_repository(tmp_path / "repo", values(tmp_path))
    got = tables((tmp_path / "repo" / model / "config.pbtxt").read_text())
    assert got["input"] == {n: (t, d, n in P.OPTIONAL_INPUTS) for n, (t, d, _) in P.INPUTS.items()}
    assert got["output"] == {n: (t, d, False) for n, (t, d, _) in P.OUTPUTS.items()}
    assert (tmp_path / "repo" / model / "1" / "model.py").exists()


def test_rendering_is_strict(tmp_path):
    good = values(tmp_path)
    with pytest.raises(KeyError, match="idle_s"):
        render_repository(tmp_path / "repo", {k: v for k, v in good.items() if k != "idle_s"})
    with pytest.raises(ValueError, match="unrendered placeholder"):
        render_repository(tmp_path / "repo", {**good, "idle_s": "${later}"})


def test_leftover_server_processes_of_the_run_dir_are_stopped(tmp_path):
    """Only a tritonserver or stub naming this run dir's repository is stopped; other processes are left."""
    server = TritonServer("ckpt", run_dir=tmp_path / "run", gpus=[])
    sleep = "import time; time.sleep(60)"
    repo = str(server.repository)
    leftover = subprocess.Popen(["tritonserver", "-c", sleep, "--model-repository", repo], executable=sys.executable)
    other_dir = subprocess.Popen(["tritonserver", "-c", sleep, repo + "-other"], executable=sys.executable)
    not_a_server = subprocess.Popen(["tail", "-c", sleep, repo], executable=sys.executable)
    try:
        time.sleep(0.2)
        assert server._run_dir_pids() == [leftover.pid]
        server._kill(server._run_dir_pids())
        assert leftover.wait(timeout=10) == -9
        assert other_dir.poll() is None and not_a_server.poll() is None
    finally:
        for p in (leftover, other_dir, not_a_server):
            p.kill()
            p.wait()
