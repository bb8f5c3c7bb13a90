"""docker/Dockerfile without a Docker engine: its requirement set (docker/requirements.txt) is exact, its pins
agree with each other and with the base image the LABELs describe, it resolves (wheels only) for that
Python and platform on the package index, and the image runs as a non-root user with a HEALTHCHECK and a run
dir it owns."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from q3tts.serving import runtime

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
REQUIREMENTS = ROOT / "docker" / "requirements.txt"


def dockerfile() -> str:
    return DOCKERFILE.read_text().replace("\\\n", " ")  # continuation lines joined


def labels() -> dict[str, str]:
    return dict(re.findall(r'q3tts\.base\.(\w+)="([^"]*)"', dockerfile()))


def instructions(name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in dockerfile().splitlines() if line.startswith(name + " ")]


def pins(path: Path = REQUIREMENTS) -> dict[str, Requirement]:
    """Every requirement of `path`, following -r includes."""
    out: dict[str, Requirement] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            out.update(pins((path.parent / line[3:].strip()).resolve()))
        elif line:
            req = Requirement(line)
            out[req.name.lower().replace("_", "-")] = req
    return out


def pinned(name: str) -> str:
    (spec,) = pins()[name].specifier
    return spec.version


def test_every_requirement_is_an_exact_pin():
    reqs = pins()
    assert {"torch", "triton", "numpy", "tritonclient"} <= set(reqs)
    for name, req in reqs.items():
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{name}: {req} is not an exact pin"


def test_pins_agree_with_the_base_image():
    base = labels()
    assert set(base) >= {"tritonserver", "cuda", "python", "glibc", "arch"}
    assert pinned("tritonclient") == base["tritonserver"]  # the client speaks the server's protocol version
    (image,) = instructions("FROM")
    assert image.startswith("nvcr.io/nvidia/tritonserver:") and image.endswith("-py3")
    # the stub's rules (numpy<2 for 2.51, Python <= 3.12) for the image's Python and numpy pin
    runtime.check_stub_python(runtime.PythonInfo(Path("/opt/q3tts/.venv"), base["python"], (), pinned("numpy"),
                                                 runtime.describe().q3tts))


def test_the_image_installs_this_requirement_set_and_runs_as_its_own_user():
    runs = instructions("RUN")
    assert any(f"-r {REQUIREMENTS.relative_to(ROOT)}" in r for r in runs)
    users = instructions("USER")
    assert users and users[-1] not in ("root", "0")
    user = users[-1]
    entry = json.loads(instructions("ENTRYPOINT")[0])
    run_dir = entry[entry.index("--run-dir") + 1]
    voices = re.search(r"Q3TTS_VOICES_DIR=(\S+)", dockerfile()).group(1)
    owned = [r for r in runs if f"chown {user}:{user}" in r]
    assert owned and all(d in owned[0] for d in (run_dir, voices)), "run dir and voices dir owned by the user"
    (health,) = instructions("HEALTHCHECK")
    probe = json.loads(health.split("CMD", 1)[1])
    assert probe[1:3] == ["-m", "q3tts.serving.health"] and "--metrics" in probe


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_requirement_set_resolves_for_the_image_python_and_platform(tmp_path):
    """pip resolves docker/requirements.txt, wheels only, for the image's Python and manylinux platform; the
    resolution keeps every pin, torch's own triton pin is ours, and torch's CUDA is the base image's major."""
    if not pypi_reachable():
        pytest.skip("the package index (pypi.org) is not reachable from here")
    base = labels()
    glibc_minor = int(base["glibc"].split(".")[1])
    platforms = [f"manylinux_2_{m}_{base['arch']}" for m in range(glibc_minor, 16, -1)]
    platforms += [f"manylinux2014_{base['arch']}", f"linux_{base['arch']}"]
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--only-binary=:all:", "--python-version", base["python"], "--report", str(report),
           *(a for p in platforms for a in ("--platform", p)), "-r", str(REQUIREMENTS)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, f"{shlex.join(cmd)}\n{run.stderr[-3000:]}"
    resolved = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]
                for i in json.loads(report.read_text())["install"]}
    for name, req in pins().items():
        assert resolved[name]["version"] == pinned(name), name
    torch_needs = [Requirement(r) for r in resolved["torch"].get("requires_dist", [])]
    (triton,) = [r for r in torch_needs if r.name == "triton"]
    assert list(triton.specifier)[0].version == pinned("triton"), "torch's own triton pin"
    runtimes = r"nvidia-cuda-runtime(-cu\d+)?|cuda-toolkit"  # torch's CUDA (12.x: the first, 13.x: the second)
    cuda = {n: m["version"] for n, m in resolved.items() if re.fullmatch(runtimes, n)}
    assert cuda and all(v.split(".")[0] == base["cuda"].split(".")[0] for v in cuda.values()), cuda
