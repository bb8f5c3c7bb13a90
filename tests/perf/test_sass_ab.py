"""perf/sass_ab.py: two trees' sm_90 builds side by side; only the specs whose builds differ unless --all."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")
PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))
import sass_ab  # noqa: E402

sm90 = sass_ab.sm90


def _build(regs: int, bar: int, code: str = "c0") -> list[dict]:
    return [{"kernel": "k", "regs": regs, "stack": 0, "shared": 0,
             "after_ticket": {"BAR": bar, "STS": 1, "LDS": 1, "LDG": 8}, "code": code}]


def test_the_table_marks_what_changed_and_keeps_the_rest_on_request():
    a = {"same": _build(128, 3), "more barriers": _build(128, 3), "gone": _build(64, 1)}
    b = {"same": _build(128, 3), "more barriers": _build(128, 40), "new": "TypeError: takes 3 arguments"}
    rows = sass_ab.table("A", "B", "qkv", a, b, changed_only=True)
    assert rows[0] == "### qkv: A -> B"
    body = [r for r in rows if r.startswith("| ") and not r.startswith("| spec")]
    assert body == ["| more barriers | 128 reg, 0 B spill, BAR 3 STS 1 LDS 1 LDG 8, code c0 | "
                    "**128 reg, 0 B spill, BAR 40 STS 1 LDS 1 LDG 8, code c0** |",
                    "| new | error (absent) | **error (TypeError: takes 3 arguments)** |"]
    every = sass_ab.table("A", "B", "qkv", a, b, changed_only=False)
    assert sum(r.startswith("| same |") for r in every) == 1


def test_a_build_whose_counts_agree_but_whose_code_differs_is_marked_and_match_picks_the_specs():
    a = {"cp o_proj": _build(48, 3, "aaa"), "talker o_proj": _build(48, 3, "bbb")}
    b = {"cp o_proj": _build(48, 3, "aaa"), "talker o_proj": _build(48, 3, "ccc")}
    changed = [r for r in sass_ab.table("A", "B", "held", a, b, changed_only=True) if r.startswith("| talker")]
    assert changed == ["| talker o_proj | 48 reg, 0 B spill, BAR 3 STS 1 LDS 1 LDG 8, code bbb | "
                       "**48 reg, 0 B spill, BAR 3 STS 1 LDS 1 LDG 8, code ccc** |"]
    rows = sass_ab.table("A", "B", "held", a, b, changed_only=False, match="cp ")
    assert [r.split(" | ")[0] for r in rows if r.startswith("| ") and not r.startswith("| spec")] == ["| cp o_proj"]


def _sass(*instructions: str) -> str:
    """cuobjdump's SASS listing of `instructions`, one per address, each with its encoding words."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {ins} ;      /* 0x{i:016x} */\n"
                     f"                                                  /* 0x000fe20000000a00 */"
                     for i, ins in enumerate(instructions))


def test_the_code_digest_ignores_parameter_offsets_and_nothing_else():
    base = sm90._code(_sass("LDC R70, c[0x0][0x258]", "FADD R0, R9, R5", "STG.E desc[UR8][R2.64], R0"))
    assert sm90._code(_sass("LDC R70, c[0x0][0x260]", "FADD R0, R9, R5", "STG.E desc[UR8][R2.64], R0")) == base
    for other in (("LDC R70, c[0x0][0x258]", "FADD R0, R5, R9", "STG.E desc[UR8][R2.64], R0"),  # operands
                  ("FADD R0, R9, R5", "LDC R70, c[0x0][0x258]", "STG.E desc[UR8][R2.64], R0"),  # order
                  ("LDC R70, c[0x0][0x258]", "FADD R0, R9, R5", "STG.E desc[UR8][R4.64], R0"),  # register
                  ("LDC R70, c[0x0][0x258]", "FADD R0, R9, R5")):  # an instruction fewer
        assert sm90._code(_sass(*other)) != base, other


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
    assert [r.split(" | ")[0] for r in rows] == ["| embed_sum", "| uniforms", "| scatter_rows"] and "BAR 0" in rows[0], \
        rows
