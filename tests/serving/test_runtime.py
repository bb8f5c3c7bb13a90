"""The stub environment: built from a StubEnvSpec, described as the stub sees it, refused when the 2.51 stub
cannot serve from it (numpy 2, no q3tts)."""

from __future__ import annotations

import os
import sys
import sysconfig
import zipfile

import pytest

from q3tts.serving import runtime


def fake_numpy_wheel(path, version: str):
    """A wheel holding only numpy/__init__.py with `version` (the build only unpacks it)."""
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("numpy/__init__.py", f"__version__ = {version!r}\n")
    return path


def spec(tmp_path, numpy_version: str, with_q3tts: bool = True) -> runtime.StubEnvSpec:
    base = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    sites = (sysconfig.get_paths()["purelib"],) if with_q3tts else ()
    return runtime.StubEnvSpec(tmp_path / "stubenv", base, fake_numpy_wheel(tmp_path / "np.whl", numpy_version), sites)


def test_built_stub_env_has_its_own_numpy_and_falls_through_for_q3tts(tmp_path):
    env = runtime.build_stub_env(spec(tmp_path, "1.99.0"))
    info = runtime.env_python(env)
    assert info.numpy == "1.99.0" and info.prefix == env
    assert info.q3tts == runtime.describe().q3tts  # the same package the launcher runs
    runtime.check_stub_python(info)


def test_numpy_2_in_the_stub_env_is_refused(tmp_path):
    with pytest.raises(runtime.RuntimeSetupError, match="numpy 2.0.1: it needs numpy<2"):
        runtime.prepare(spec(tmp_path, "2.0.1"))


def test_a_stub_env_without_q3tts_is_refused(tmp_path):
    with pytest.raises(runtime.RuntimeSetupError, match="cannot import q3tts"):
        runtime.prepare(spec(tmp_path, "1.99.0", with_q3tts=False))
