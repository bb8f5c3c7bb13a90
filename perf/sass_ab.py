"""The sm_90 builds of two commits' kernels side by side, on this machine (no GPU): registers, spill stack, and,
read from the SASS, the barriers, shared-memory stores / loads and global loads after each kernel's ticket, and a
digest of its instructions with the parameter offsets masked (`code`: equal where both sides run the same
instructions, whatever parameters one side adds; `tests/kernels/sm90.py`). A kernel change that adds layout
conversions or splits vector loads shows here in seconds: the thirty-third session found the 16-row step's 0.8 ms
regression (9 us on each qkv launch of both models on the H200) this way, after a GPU A/B of nine commits had
blamed the wrong one.

    python3 perf/sass_ab.py c084f13            # c084f13 against the working tree, spec set qkv
    python3 perf/sass_ab.py a186da0 b47a5a2 --specs qkv norm_linear
    python3 perf/sass_ab.py f5feaef d343915 --specs qkv norm_linear held --match cp   # the code predictor's only

Each side's kernels come from `git archive <commit>` ("." is the working tree); the launches are this tree's
SPECS, so a spec whose wrapper call an older tree does not take shows as an error on that side. Run without
TRITON_INTERPRET (it compiles; it does not interpret).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SM90_DIR = ROOT / "tests" / "kernels"
sys.path.insert(0, str(SM90_DIR))
import sm90  # noqa: E402  (its SPECS name the spec sets; each side builds them in a fresh interpreter)

# run in a fresh interpreter: q3tts and q3tts.kernels from the tree at argv[1], sm90 from this tree
_RUNNER = """
import importlib.util, json, os, sys
tree, sm90_dir, spec_set = sys.argv[1:4]
for name, sub in (("q3tts", "backend"), ("q3tts.kernels", "kernels")):
    path = os.path.join(tree, sub)
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
sys.path.insert(0, sm90_dir)
import sm90
out = {}
for name, launch in sm90.SPECS[spec_set]():
    try:
        out[name] = sm90.resources(launch)
    except Exception as e:  # an older tree's wrapper may not take this tree's call
        out[name] = f"{type(e).__name__}: {str(e)[:120]}"
print(json.dumps(out))
"""


def builds(tree: Path, spec_set: str) -> dict:
    """{spec: [{kernel, regs, stack, shared, after_ticket, code}] | error text} of the kernels of `tree`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _RUNNER, str(tree), str(SM90_DIR), spec_set],
                          env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"{tree}: {spec_set} did not build:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def checkout(commit: str, into: Path) -> Path:
    """The tree of `commit` ("." : this working tree) under `into`."""
    if commit == ".":
        return ROOT
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(into, filter="data")
    return into


def _cell(kernels) -> str:
    if isinstance(kernels, str):
        return f"error ({kernels})"
    return "; ".join(f"{k['regs']} reg, {k['stack']} B spill, " + " ".join(f"{op} {n}" for op, n in
                                                                     k["after_ticket"].items())
                     + f", code {k['code']}" for k in kernels)


def table(a: str, b: str, spec_set: str, side_a: dict, side_b: dict, changed_only: bool,
          match: str = "") -> list[str]:
    """Markdown rows: each spec (whose name holds `match`) built on both sides, marked where they differ."""
    lines = [f"### {spec_set}: {a} -> {b}", "", f"| spec | {a} | {b} |", "|---|---|---|"]
    for spec in (s for s in side_b if match in s):
        left, right = _cell(side_a.get(spec, "absent")), _cell(side_b[spec])
        if left != right or not changed_only:
            lines.append(f"| {spec} | {left} | {'**' + right + '**' if left != right else right} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="base commit")
    p.add_argument("b", nargs="?", default=".", help="other commit (default: the working tree)")
    p.add_argument("--specs", nargs="+", choices=tuple(sm90.SPECS), default=["qkv"])
    p.add_argument("--all", action="store_true", help="every spec, not only those whose builds differ")
    p.add_argument("--match", default="", help="only the specs whose names hold this text")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {c: checkout(c, Path(tmp) / f"side{i}") for i, c in enumerate((args.a, args.b))}
        for spec_set in args.specs:
            sides = [builds(trees[c], spec_set) for c in (args.a, args.b)]
            print("\n".join(table(args.a, args.b, spec_set, *sides, not args.all, args.match)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
