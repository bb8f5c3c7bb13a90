"""Generate perf_analyzer --input-data JSON for the sequence model: one sequence = one JSON list of steps.

    python perf/make_inputs.py --out run/perf/inputs.json --sequences 16 --words-per-step 4

Step 1 carries SPEAKER/LANGUAGE (voice inputs are START-only); every step carries a TEXT piece; perf_analyzer
sets START on the first step and END on the last. Texts are generated from a fixed word list and seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from q3tts_client import protocol as P

WORDS = ("the quick brown fox jumps over a lazy dog while streaming speech arrives frame by frame "
         "from the server and every listener hears it almost at once with no gap between the chunks").split()


def make_sequences(n: int, steps: int, words_per_step: int, speaker: str, language: str, seed: int) -> list:
    rng = random.Random(seed)
    data = []
    for _ in range(n):
        seq = []
        for k in range(steps):
            text = " ".join(rng.choice(WORDS) for _ in range(words_per_step)) + (". " if k == steps - 1 else " ")
            step = {P.INPUT_TEXT: [text]}
            if k == 0:
                step[P.INPUT_SPEAKER] = [speaker]
                step[P.INPUT_LANGUAGE] = [language]
            seq.append(step)
        data.append(seq)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="requests per sequence")
    ap.add_argument("--words-per-step", type=int, default=4)
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--language", default="english")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    data = make_sequences(args.sequences, args.steps, args.words_per_step, args.speaker, args.language, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"data": data}, indent=1))
    print(f"wrote {args.out}: {len(data)} sequences x {args.steps} steps")


if __name__ == "__main__":
    main()
