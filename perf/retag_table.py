"""Give a saved kernel tuning table this tree's fingerprint, so that another commit's kernels run with the same
launch configs: an A/B of kernel bodies alone, without the second side's tuning (on the H200 the engine's kernel
tuning took 170 s of a 212 s start on a fresh table, chain tuning off). Only for a pair whose config classes and
keys agree; a key the table lacks is tuned as usual. `perf/gpu_round.sh`'s `at` step runs it inside the other
commit's snapshot, so it needs of that tree's q3tts only `autotune.fingerprint` (hence plain pickle here, not
`load_tuned` / `save_tuned`, whose checks and arguments an older tree may not share).

    python3 perf/retag_table.py <table.pkl> <out.pkl> [--device cuda] [--drop-chain-marks] [--drop KIND ...]

--drop-chain-marks leaves out the marks of the engine's chain tuning (keys "*_chain_tuned",
backend/engine/chain_tuning.py), so an engine on the table chain-tunes its parts again from the table's picks: a
kernel change that may want other launch configs, measured with its own. --drop KIND leaves out the picks of one
kind of launch (the first item of its keys, e.g. conv1d), so the engine tunes that kernel again over its candidates
as they now stand (a kept pick would never time a candidate added since).
"""

from __future__ import annotations

import argparse
import pickle

import torch

from q3tts.kernels import autotune


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("table", help="a table saved by autotune.save_tuned")
    p.add_argument("out", help="where the retagged table goes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--drop-chain-marks", action="store_true", help="leave out the chain tuning's marks")
    p.add_argument("--drop", nargs="+", default=[], metavar="KIND", help="leave out these kinds' picks")
    args = p.parse_args(argv)
    with open(args.table, "rb") as f:
        saved = pickle.load(f)
    saved["fingerprint"] = autotune.fingerprint(torch.device(args.device))
    if args.drop_chain_marks:
        saved["best"] = {k: v for k, v in saved["best"].items()
                         if not (isinstance(k, tuple) and str(k[0]).endswith("_chain_tuned"))}
    saved["best"] = {k: v for k, v in saved["best"].items() if not (isinstance(k, tuple) and k[0] in args.drop)}
    with open(args.out, "wb") as f:
        pickle.dump(saved, f, protocol=5)
    print(f"{len(saved['best'])} entries, fingerprint {saved['fingerprint'][:3]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
