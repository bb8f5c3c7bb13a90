"""Prepare and describe the Triton runtime: a tritonserver with its python backend, and the Python
environment the python stub (the process that runs model.py) lives in.

What Triton 2.51's python backend relies on, and how this module provides it:
- The `nvidia-pytriton` wheel ships tritonserver and the python backend, but its `backends/python` has no
  stub. A backend dir is built next to the venv: the wheel's python backend plus the stub for the stub
  env's Python, COPIED (the backend chmods a stub that failed to start; through a symlink that would
  alter the wheel). An install with its own stub (the NGC image, $Q3TTS_TRITON_HOME) is used as it is.
- The stub embeds the Python it finds as `python3` on PATH, and Triton sources
  `<EXECUTION_ENV_PATH>/bin/activate` when the model sets that parameter (a venv only): the server's PATH
  starts with the stub env's bin.
- The stub needs its Python's libpythonX.Y.so.1.0 on LD_LIBRARY_PATH (without it the model load hangs
  forever), and the wheel's `nvidia_pytriton.libs` (the copied stub's $ORIGIN RPATH no longer reaches them).
- The stub ignores PYTHONPATH: q3tts must be importable from the stub env's site-packages.
- numpy >= 2 in the stub env empties every output tensor of the 2.51 stub, and the 3.13 stub needs
  numpy 2: the stub env has numpy < 2 and Python <= 3.12.

The stub env is the running environment unless `prepare(stub_env=...)` names another: an existing venv, or
a `StubEnvSpec` to build, for an image whose Python has numpy 2 (a venv of the same base Python with
numpy < 2 that falls through to the image's site-packages for torch and q3tts).

Hooks (environment variables):
  Q3TTS_TRITON_HOME     a tritonserver install with its own stub (NGC image: /opt/tritonserver)
  Q3TTS_PYTRITON_ROOT   a folder holding `pytriton/tritonserver` and `nvidia_pytriton.libs` (an unpacked slim
                        copy of the wheel, perf/gpu_serve.py) instead of the running Python's site-packages
  Q3TTS_TRITON_RUNTIME  where the backend dir is built (default <sys.prefix>/q3tts-triton-runtime)

`python -m q3tts.serving.runtime --prepare [--stub-env DIR]` builds it (idempotent) and prints the paths.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

STUB = "triton_python_backend_stub"


class RuntimeSetupError(RuntimeError):
    """The Triton runtime cannot be prepared; the text says what is missing and how to fix it."""


@dataclass(frozen=True)
class Runtime:
    tritonserver: Path  # the server binary
    backend_dir: Path  # --backend-directory (holds python/ with the stub)
    ld_library_path: tuple[str, ...]  # prepended to LD_LIBRARY_PATH
    execution_env: Path  # EXECUTION_ENV_PATH: the stub env
    python_version: str
    explicit_env: bool = False  # a stub env other than the running one: always pass EXECUTION_ENV_PATH

    @property
    def use_execution_env(self) -> bool:
        """Whether config.pbtxt gets EXECUTION_ENV_PATH (Triton sources <env>/bin/activate: a venv only)."""
        return self.explicit_env or sys.prefix != sys.base_prefix

    def server_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment tritonserver must run with."""
        env = dict(os.environ if base is None else base)
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = ":".join([*self.ld_library_path, *([old] if old else [])])
        env["PATH"] = f"{self.execution_env / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        env.pop("PYTHONPATH", None)  # ignored by the stub anyway; keep the server env honest
        return env


# --- the stub's Python --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PythonInfo:
    """What the stub needs to know about the Python environment it will run in."""

    prefix: Path  # sys.prefix (the venv)
    version: str  # "3.12"
    libdirs: tuple[str, ...]  # where its base Python's libpython may be, best first
    numpy: str | None  # numpy.__version__, None when absent
    q3tts: str  # the q3tts package folder it imports


def describe() -> PythonInfo:
    """The running interpreter, as the stub would see it."""
    try:
        import numpy

        numpy_version = numpy.__version__
    except ImportError:
        numpy_version = None
    libdirs = (sysconfig.get_config_var("LIBDIR"), os.path.join(sys.base_prefix, "lib"))
    return PythonInfo(Path(sys.prefix), f"{sys.version_info.major}.{sys.version_info.minor}",
                      tuple(d for d in libdirs if d), numpy_version, str(Path(__file__).resolve().parents[1]))


def env_python(env: Path) -> PythonInfo:
    """Ask `<env>/bin/python3` (what the stub's embedded Python resolves) about itself, isolated from
    PYTHONPATH as the stub is."""
    exe = env / "bin" / "python3"
    if not exe.exists():
        raise RuntimeSetupError(f"stub env {env} has no bin/python3: make it with `python3.X -m venv {env}`")
    if not (env / "bin" / "activate").exists():
        raise RuntimeSetupError(f"stub env {env} has no bin/activate (Triton sources it): use a venv")
    run = subprocess.run([str(exe), "-I", "-m", "q3tts.serving.runtime", "--describe"], capture_output=True,
                         text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeSetupError(f"the stub env {env} cannot import q3tts (the stub ignores PYTHONPATH): "
                                f"{run.stderr.strip()[-800:]}")
    d = json.loads(run.stdout)
    return PythonInfo(Path(d["prefix"]), d["version"], tuple(d["libdirs"]), d["numpy"], d["q3tts"])


def check_stub_python(info: PythonInfo) -> None:
    """Refuse a stub env the 2.51 stub cannot serve from, naming the problem."""
    if tuple(map(int, info.version.split("."))) >= (3, 13):
        raise RuntimeSetupError(f"the {info.version} stub needs numpy>=2, which empties every output in Triton "
                                "2.51; use Python<=3.12 (a stub env of an older Python)")
    if info.numpy is None or int(info.numpy.split(".")[0]) >= 2:
        raise RuntimeSetupError(f"the stub env {info.prefix} has numpy {info.numpy}: it needs numpy<2 (numpy 2 "
                                "empties every output of Triton 2.51's stub)")
    ours = describe().q3tts
    if info.q3tts != ours:
        raise RuntimeSetupError(f"the stub env {info.prefix} imports q3tts from {info.q3tts}, not {ours}")


@dataclass(frozen=True)
class StubEnvSpec:
    """A stub env to build: a venv of `python` (a base interpreter of the serving Python's version, whose
    binary modules the site dirs hold) with numpy<2 from `numpy_wheel`, then `site_dirs` through
    site.addsitedir (their .pth files run too: an editable q3tts stays importable)."""

    path: Path
    python: Path
    numpy_wheel: Path
    site_dirs: tuple[str, ...] = ()


def build_stub_env(spec: StubEnvSpec) -> Path:
    """(Re)build the venv of `spec` and return its path."""
    try:
        subprocess.run([str(spec.python), "-m", "venv", "--without-pip", "--clear", str(spec.path)], check=True,
                       capture_output=True, text=True, timeout=120)
        site = subprocess.run([str(spec.path / "bin" / "python3"), "-I", "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        raise RuntimeSetupError(f"cannot make a venv with {spec.python} (Ubuntu: apt install python3.X-venv): "
                                f"{detail}") from e
    with zipfile.ZipFile(spec.numpy_wheel) as wheel:
        wheel.extractall(site)
    lines = [f"import site; site.addsitedir({d!r})\n" for d in spec.site_dirs]
    Path(site, "zz_q3tts_site_dirs.pth").write_text("".join(lines))  # after the env's own numpy
    return spec.path


# --- the server -----------------------------------------------------------------------------------------------
def pytriton_root() -> Path:
    """The folder holding `pytriton/` and `nvidia_pytriton.libs/`: $Q3TTS_PYTRITON_ROOT or site-packages."""
    return Path(os.environ.get("Q3TTS_PYTRITON_ROOT") or sysconfig.get_paths()["purelib"])


def wheel_root() -> Path:
    """`pytriton/tritonserver` inside the installed nvidia-pytriton wheel (or $Q3TTS_PYTRITON_ROOT)."""
    root = pytriton_root() / "pytriton" / "tritonserver"
    if not (root / "bin" / "tritonserver").exists():
        hint = ("unpack the slim tarball there" if os.environ.get("Q3TTS_PYTRITON_ROOT")
                else "pip install nvidia-pytriton==0.7.0")
        raise RuntimeSetupError(f"tritonserver not found under {root}: {hint}")
    return root


def find_libpython(info: PythonInfo) -> Path:
    """libpythonX.Y.so.1.0 of the base Python of `info`, never a same-version system copy first."""
    name = f"libpython{info.version}.so.1.0"
    candidates = [*info.libdirs, "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
    for d in candidates:
        if (Path(d) / name).exists():
            return Path(d) / name
    raise RuntimeSetupError(
        f"{name} not found in {candidates}: the python stub needs it (without it the model load hangs). "
        "Use a Python built with --enable-shared, or install libpython (apt install libpython3.X).")


def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.exists() and not dst.is_symlink() and filecmp.cmp(src, dst, shallow=False):
        if os.access(dst, os.X_OK) or not os.access(src, os.X_OK):
            return
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    shutil.copy2(src, dst)


def _backend_dir(info: PythonInfo) -> Path:
    """The wheel's python backend + the stub for `info`'s Python, under $Q3TTS_TRITON_RUNTIME."""
    root = wheel_root()
    runtime_dir = Path(os.environ.get("Q3TTS_TRITON_RUNTIME") or Path(sys.prefix) / "q3tts-triton-runtime")
    py_dir = runtime_dir / "backends" / "python"
    py_dir.mkdir(parents=True, exist_ok=True)
    for f in (root / "backends" / "python").iterdir():
        if f.is_file():
            _copy_if_changed(f, py_dir / f.name)
    stub = root / "python_backend_stubs" / info.version / STUB
    if not stub.exists():
        raise RuntimeSetupError(f"the wheel has no python stub for Python {info.version} ({stub})")
    _copy_if_changed(stub, py_dir / STUB)
    os.chmod(py_dir / STUB, 0o755)  # the backend chmods a stub that failed once to 0100
    return runtime_dir / "backends"


def check_libraries(rt: Runtime) -> None:
    """Every shared library of the server, backend and stub resolves (an unresolved one hangs the load)."""
    ldd = shutil.which("ldd")
    files = [rt.tritonserver, rt.backend_dir / "python" / "libtriton_python.so", rt.backend_dir / "python" / STUB]
    if ldd is None:
        return
    out = subprocess.run([ldd, *map(str, files)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LD_LIBRARY_PATH": rt.server_env()["LD_LIBRARY_PATH"]}).stdout
    missing = sorted({line.split()[0] for line in out.splitlines() if "not found" in line})
    if missing:
        raise RuntimeSetupError(f"unresolved shared libraries (a model load would hang): {', '.join(missing)}")


def prepare(stub_env: Path | StubEnvSpec | None = None) -> Runtime:
    """Check the stub env (building it from a StubEnvSpec), build the backend dir (idempotent: only missing
    or changed files are copied) and return the Runtime. With $Q3TTS_TRITON_HOME that install is used."""
    if isinstance(stub_env, StubEnvSpec):
        stub_env = build_stub_env(stub_env)
    info = describe() if stub_env is None else env_python(Path(stub_env).resolve())
    check_stub_python(info)
    libpython_dir = str(find_libpython(info).parent)
    home = os.environ.get("Q3TTS_TRITON_HOME")
    if home:
        if not (Path(home) / "bin" / "tritonserver").exists():
            raise RuntimeSetupError(f"Q3TTS_TRITON_HOME={home} has no bin/tritonserver")
        server, backends, libs = Path(home) / "bin" / "tritonserver", Path(home) / "backends", ()
    else:
        server, backends = wheel_root() / "bin" / "tritonserver", _backend_dir(info)
        libs = (str(pytriton_root() / "nvidia_pytriton.libs"),)
        if not Path(libs[0]).is_dir():
            raise RuntimeSetupError(f"{libs[0]} is missing: the copied stub and backend need the wheel's libs")
    rt = Runtime(server, backends, (libpython_dir, *libs), info.prefix, info.version,
                 explicit_env=stub_env is not None)
    check_libraries(rt)
    return rt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="build the backend dir (idempotent)")
    parser.add_argument("--stub-env", type=Path, default=None, help="the venv the stub runs in (default: this one)")
    parser.add_argument("--describe", action="store_true", help="print this Python as the stub would see it")
    args = parser.parse_args(argv)
    if args.describe:
        print(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(describe()).items()}))
        return 0
    if not args.prepare:
        parser.error("nothing to do: pass --prepare or --describe")
    try:
        rt = prepare(args.stub_env)
    except RuntimeSetupError as e:
        print(f"q3tts runtime: {e}", file=sys.stderr)
        return 1
    print(json.dumps({**{k: str(v) if isinstance(v, Path) else v for k, v in asdict(rt).items()},
                      "use_execution_env": rt.use_execution_env}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
