"""A built wheel holds every package of the source tree (an editable install hides a missing one:
`q3tts.voices` and `q3tts.openai_api` were left out once, so `pip install .` gave a server that failed
to import its launcher)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
               for name, folder in tool["package-dir"].items()
               for init in (ROOT / folder).rglob("__init__.py")}
    assert on_disk - set(tool["packages"]) == set(), "packages missing from pyproject.toml"
    assert set(tool["packages"]) - on_disk == set(), "pyproject.toml lists packages that do not exist"
