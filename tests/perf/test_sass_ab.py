"""perf/sass_ab.py: two trees' sm_90 builds side by side; only the specs whose builds differ unless --all."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")
PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))
import sass_ab  # noqa: E402


def _build(regs: int, bar: int) -> list[dict]:
    return [{"kernel": "k", "regs": regs, "stack": 0, "shared": 0,
             "after_ticket": {"BAR": bar, "STS": 1, "LDS": 1, "LDG": 8}}]


def test_the_table_marks_what_changed_and_keeps_the_rest_on_request():
    a = {"same": _build(128, 3), "more barriers": _build(128, 3), "gone": _build(64, 1)}
    b = {"same": _build(128, 3), "more barriers": _build(128, 40), "new": "TypeError: takes 3 arguments"}
    rows = sass_ab.table("A", "B", "qkv", a, b, changed_only=True)
    assert rows[0] == "### qkv: A -> B"
    body = [r for r in rows if r.startswith("| ") and not r.startswith("| spec")]
    assert body == ["| more barriers | 128 reg, 0 B spill, BAR 3 STS 1 LDS 1 LDG 8 | "
                    "**128 reg, 0 B spill, BAR 40 STS 1 LDS 1 LDG 8** |",
                    "| new | error (absent) | **error (TypeError: takes 3 arguments)** |"]
    every = sass_ab.table("A", "B", "qkv", a, b, changed_only=False)
    assert sum(r.startswith("| same |") for r in every) == 1


def test_the_committed_tree_against_itself_differs_nowhere(capsys):
    """The small step kernels of HEAD (by git archive) and of this working tree: builds equal, so no rows, unless
    the tree's kernels differ from HEAD's."""
    import subprocess

    dirty = subprocess.run(["git", "-C", str(PERF.parent), "status", "--porcelain", "--", "kernels"],
                           capture_output=True, text=True, check=True).stdout
    if dirty:
        pytest.skip("the working tree's kernels differ from HEAD's")
    assert sass_ab.main(["HEAD", "--specs", "small"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "### small: HEAD -> ." and not [r for r in lines[4:] if r.startswith("| ")], lines
    assert sass_ab.main(["HEAD", "--specs", "small", "--all"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines()[4:] if r.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows] == ["| embed_sum", "| uniforms"] and "BAR 0" in rows[0], rows
