"""Prepare and describe the Triton runtime that the `nvidia-pytriton` wheel ships (TRITON_RECIPE §1, §4).

The wheel's `backends/python` has no stub, so a backend dir is built next to the venv: the wheel's python
backend plus the stub for the running Python, COPIED (the backend chmods a stub that cannot start; through a
symlink that would alter the wheel). The server then needs `LD_LIBRARY_PATH` = the base Python's libpython dir
(a missing libpython makes the model load hang) + the wheel's `nvidia_pytriton.libs` (the copied stub's
`$ORIGIN` RPATH no longer reaches them), and `PATH` starting with the venv's bin (the stub's embedded
interpreter finds the venv through `python3` on PATH).

`python -m q3tts.serving.runtime --prepare` builds it (idempotent) and prints the paths.

Hooks (environment variables):
  Q3TTS_TRITON_HOME     a tritonserver install with its own stub (NGC image: /opt/tritonserver), used as is
  Q3TTS_PYTRITON_ROOT   a folder holding `pytriton/tritonserver` and `nvidia_pytriton.libs` (an unpacked slim
                        copy of the wheel, perf/gpu_serve.sh) instead of the running Python's site-packages
  Q3TTS_STUB_ENV        the Python environment the stub runs in (EXECUTION_ENV_PATH), e.g. a venv with numpy<2
                        next to an image whose numpy is 2.x; its Python version picks the stub and libpython
  Q3TTS_TRITON_RUNTIME  where the backend dir is built (default <sys.prefix>/q3tts-triton-runtime)
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
    execution_env: Path  # EXECUTION_ENV_PATH: the venv (sys.prefix) or $Q3TTS_STUB_ENV
    python_version: str
    explicit_env: bool = False  # $Q3TTS_STUB_ENV: always pass EXECUTION_ENV_PATH

    @property
    def use_execution_env(self) -> bool:
        """Whether config.pbtxt gets EXECUTION_ENV_PATH (Triton sources <env>/bin/activate: a venv only)."""
        return self.explicit_env or in_venv()

    def server_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment tritonserver must run with."""
        env = dict(os.environ if base is None else base)
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = ":".join([*self.ld_library_path, *([old] if old else [])])
        env["PATH"] = f"{self.execution_env / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        env.pop("PYTHONPATH", None)  # ignored by the stub anyway; keep the server env honest
        return env


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def pytriton_root() -> Path:
    """The folder holding `pytriton/` and `nvidia_pytriton.libs/`: $Q3TTS_PYTRITON_ROOT or site-packages."""
    return Path(os.environ.get("Q3TTS_PYTRITON_ROOT") or _site_packages())


def wheel_root() -> Path:
    """`pytriton/tritonserver` inside the installed nvidia-pytriton wheel (or $Q3TTS_PYTRITON_ROOT)."""
    root = pytriton_root() / "pytriton" / "tritonserver"
    if not (root / "bin" / "tritonserver").exists():
        hint = ("unpack the slim tarball there" if os.environ.get("Q3TTS_PYTRITON_ROOT")
                else "pip install nvidia-pytriton==0.7.0")
        raise RuntimeSetupError(f"tritonserver not found under {root}: {hint}")
    return root


@dataclass(frozen=True)
class PythonInfo:
    """What the stub needs to know about the Python environment it will run in."""

    prefix: Path  # sys.prefix (the venv)
    version: str  # "3.12"
    libdirs: tuple[str, ...]  # where its base Python's libpython may be, best first


def current_python() -> PythonInfo:
    return PythonInfo(Path(sys.prefix), f"{sys.version_info.major}.{sys.version_info.minor}",
                      tuple(d for d in (sysconfig.get_config_var("LIBDIR"), os.path.join(sys.base_prefix, "lib"))
                            if d))


_PROBE = ("import json, os, sys, sysconfig; print(json.dumps({'prefix': sys.prefix, 'version': '%d.%d' % "
          "sys.version_info[:2], 'libdirs': [d for d in (sysconfig.get_config_var('LIBDIR'), "
          "os.path.join(sys.base_prefix, 'lib')) if d]}))")


def env_python(env: Path) -> PythonInfo:
    """Ask `<env>/bin/python3` (the interpreter the stub's embedded Python resolves) about itself."""
    exe = env / "bin" / "python3"
    if not exe.exists():
        raise RuntimeSetupError(f"Q3TTS_STUB_ENV={env} has no bin/python3: make it with `python3.X -m venv {env}`")
    if not (env / "bin" / "activate").exists():
        raise RuntimeSetupError(f"Q3TTS_STUB_ENV={env} has no bin/activate (Triton sources it): use a venv")
    try:
        out = subprocess.run([str(exe), "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeSetupError(f"cannot run {exe}: {e}") from e
    d = json.loads(out)
    return PythonInfo(Path(env), d["version"], tuple(d["libdirs"]))


def find_libpython(info: PythonInfo | None = None) -> Path:
    """libpythonX.Y.so.1.0 of the base Python of `info` (default: the running interpreter), never a
    same-version system copy first."""
    info = info or current_python()
    name = f"libpython{info.version}.so.1.0"
    candidates = [*info.libdirs, "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
    for d in candidates:
        if d and (Path(d) / name).exists():
            return Path(d) / name
    raise RuntimeSetupError(
        f"{name} not found in {[c for c in candidates if c]}: the python stub needs it (without it the model "
        "load hangs). Use a Python built with --enable-shared, or install libpython (apt install libpython3.X)."
    )


def default_runtime_dir() -> Path:
    return Path(os.environ.get("Q3TTS_TRITON_RUNTIME") or Path(sys.prefix) / "q3tts-triton-runtime")


def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.exists() and not dst.is_symlink() and filecmp.cmp(src, dst, shallow=False):
        if os.access(dst, os.X_OK) or not os.access(src, os.X_OK):
            return
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    shutil.copy2(src, dst)


def in_venv() -> bool:
    return sys.prefix != sys.base_prefix


def stub_python() -> PythonInfo:
    """The environment the stub runs in: $Q3TTS_STUB_ENV, else the running interpreter's."""
    env = os.environ.get("Q3TTS_STUB_ENV")
    return env_python(Path(env).resolve()) if env else current_python()


def system_runtime(home: Path) -> Runtime:
    """A tritonserver install that has its own stub (the NGC image: /opt/tritonserver)."""
    if not (home / "bin" / "tritonserver").exists():
        raise RuntimeSetupError(f"Q3TTS_TRITON_HOME={home} has no bin/tritonserver")
    info = stub_python()
    return Runtime(tritonserver=home / "bin" / "tritonserver", backend_dir=home / "backends",
                   ld_library_path=(str(find_libpython(info).parent),), execution_env=info.prefix,
                   python_version=info.version, explicit_env=bool(os.environ.get("Q3TTS_STUB_ENV")))


def prepare(runtime_dir: Path | None = None) -> Runtime:
    """Build the backend dir (idempotent: only missing or changed files are copied) and return the Runtime.

    With $Q3TTS_TRITON_HOME set (Docker: /opt/tritonserver) that install is used as it is.
    """
    if os.environ.get("Q3TTS_TRITON_HOME"):
        return system_runtime(Path(os.environ["Q3TTS_TRITON_HOME"]))
    info = stub_python()
    if tuple(map(int, info.version.split("."))) >= (3, 13):
        raise RuntimeSetupError(f"the {info.version} stub needs numpy>=2, which empties every output in Triton 2.51; "
                                "use Python<=3.12 (Q3TTS_STUB_ENV: a venv of an older Python)")
    root = wheel_root()
    runtime_dir = runtime_dir or default_runtime_dir()
    py_dir = runtime_dir / "backends" / "python"
    py_dir.mkdir(parents=True, exist_ok=True)
    for f in (root / "backends" / "python").iterdir():
        if f.is_file():
            _copy_if_changed(f, py_dir / f.name)
    version = info.version
    stub = root / "python_backend_stubs" / version / STUB
    if not stub.exists():
        raise RuntimeSetupError(f"the wheel has no python stub for Python {version} ({stub})")
    _copy_if_changed(stub, py_dir / STUB)
    os.chmod(py_dir / STUB, 0o755)  # the backend chmods a stub that failed once to 0100
    libs = pytriton_root() / "nvidia_pytriton.libs"
    if not libs.is_dir():
        raise RuntimeSetupError(f"{libs} is missing: the copied stub and backend need the wheel's bundled libs")
    return Runtime(
        tritonserver=root / "bin" / "tritonserver",
        backend_dir=runtime_dir / "backends",
        ld_library_path=(str(find_libpython(info).parent), str(libs)),
        execution_env=info.prefix,
        python_version=version,
        explicit_env=bool(os.environ.get("Q3TTS_STUB_ENV")),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="build the backend dir (idempotent)")
    parser.add_argument("--runtime-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.prepare:
        parser.error("nothing to do: pass --prepare")
    try:
        rt = prepare(args.runtime_dir)
    except RuntimeSetupError as e:
        print(f"q3tts runtime: {e}", file=sys.stderr)
        return 1
    print(json.dumps({**{k: str(v) if isinstance(v, Path) else v for k, v in asdict(rt).items()},
                      "use_execution_env": rt.use_execution_env}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
