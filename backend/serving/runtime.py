"""Prepare and describe the Triton runtime that the `nvidia-pytriton` wheel ships (TRITON_RECIPE §1, §4).

The wheel's `backends/python` has no stub, so a backend dir is built next to the venv: the wheel's python
backend plus the stub for the running Python, COPIED (the backend chmods a stub that cannot start; through a
symlink that would alter the wheel). The server then needs `LD_LIBRARY_PATH` = the base Python's libpython dir
(a missing libpython makes the model load hang) + the wheel's `nvidia_pytriton.libs` (the copied stub's
`$ORIGIN` RPATH no longer reaches them), and `PATH` starting with the venv's bin (the stub's embedded
interpreter finds the venv through `python3` on PATH).

`python -m q3tts.serving.runtime --prepare` builds it (idempotent) and prints the paths.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
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
    execution_env: Path  # EXECUTION_ENV_PATH: the venv (sys.prefix)
    python_version: str

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


def wheel_root() -> Path:
    """`pytriton/tritonserver` inside the installed nvidia-pytriton wheel."""
    root = _site_packages() / "pytriton" / "tritonserver"
    if not (root / "bin" / "tritonserver").exists():
        raise RuntimeSetupError(f"tritonserver not found under {root}: pip install nvidia-pytriton==0.7.0")
    return root


def find_libpython() -> Path:
    """libpythonX.Y.so.1.0 of the running interpreter's base Python (never a same-version system copy first)."""
    name = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
    candidates = [sysconfig.get_config_var("LIBDIR"), os.path.join(sys.base_prefix, "lib"),
                  "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
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


def system_runtime(home: Path) -> Runtime:
    """A tritonserver install that has its own stub (the NGC image: /opt/tritonserver)."""
    if not (home / "bin" / "tritonserver").exists():
        raise RuntimeSetupError(f"Q3TTS_TRITON_HOME={home} has no bin/tritonserver")
    return Runtime(tritonserver=home / "bin" / "tritonserver", backend_dir=home / "backends",
                   ld_library_path=(str(find_libpython().parent),), execution_env=Path(sys.prefix),
                   python_version=f"{sys.version_info.major}.{sys.version_info.minor}")


def prepare(runtime_dir: Path | None = None) -> Runtime:
    """Build the backend dir (idempotent: only missing or changed files are copied) and return the Runtime.

    With $Q3TTS_TRITON_HOME set (Docker: /opt/tritonserver) that install is used as it is.
    """
    if os.environ.get("Q3TTS_TRITON_HOME"):
        return system_runtime(Path(os.environ["Q3TTS_TRITON_HOME"]))
    if sys.version_info[:2] >= (3, 13):
        raise RuntimeSetupError("the 3.13 stub needs numpy>=2, which empties every output in Triton 2.51; use Python<=3.12")
    root = wheel_root()
    runtime_dir = runtime_dir or default_runtime_dir()
    py_dir = runtime_dir / "backends" / "python"
    py_dir.mkdir(parents=True, exist_ok=True)
    for f in (root / "backends" / "python").iterdir():
        if f.is_file():
            _copy_if_changed(f, py_dir / f.name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB
    if not stub.exists():
        raise RuntimeSetupError(f"the wheel has no python stub for Python {version} ({stub})")
    _copy_if_changed(stub, py_dir / STUB)
    os.chmod(py_dir / STUB, 0o755)  # the backend chmods a stub that failed once to 0100
    libs = _site_packages() / "nvidia_pytriton.libs"
    return Runtime(
        tritonserver=root / "bin" / "tritonserver",
        backend_dir=runtime_dir / "backends",
        ld_library_path=(str(find_libpython().parent), str(libs)),
        execution_env=Path(sys.prefix),
        python_version=version,
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
    print(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(rt).items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
