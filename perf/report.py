"""Where the perf scripts put their results: tables on stdout and in $OUT/<name> when OUT is set (the device
tool brings $OUT back from the GPU machine), and load-test rows in a CSV with the columns of `CSV_COLUMNS`."""

from __future__ import annotations

import csv
import datetime
import math
import os
import subprocess
from pathlib import Path

# One row per measured level of one method (perf/bench_serve.py, perf/pa_export.py, perf/peers/run.py).
# mode: closed | open | perf_analyzer | peer:NAME; level: concurrency (closed, perf_analyzer, peers' batch)
# or requests/s (open). Times in ms; rtf = wall / audio (lower is better); empty = not measured.
CSV_COLUMNS = ("mode", "level", "ttfa_p50_ms", "ttfa_p95_ms", "ttfa_p99_ms", "e2e_p95_ms", "rtf_p50",
               "audio_s_per_s", "underrun_streams", "streams", "errors", "gpu", "commit", "date")
ROOT = Path(__file__).resolve().parent.parent


def save(text: str, name: str) -> None:
    """Write `text` to $OUT/name when OUT is set."""
    out = os.environ.get("OUT")
    if out:
        Path(out, name).write_text(text)


def emit(text: str, name: str) -> None:
    """Print `text` and save it (see `save`)."""
    print(text)
    save(text, name)


def gpu_name() -> str:
    """LOADTEST_GPU if set (a client measuring a remote server names the server's GPU), else the name of
    this machine's first GPU, else "cpu"."""
    if os.environ.get("LOADTEST_GPU"):
        return os.environ["LOADTEST_GPU"]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "cpu"


def commit() -> str:
    """LOADTEST_COMMIT if set (a GPU machine gets the tree without .git: perf/gpu_carry.sh stamps it), else
    this checkout's short HEAD, else "unknown"."""
    if os.environ.get("LOADTEST_COMMIT"):
        return os.environ["LOADTEST_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _cell(value) -> str:
    """CSV text of one value: "" for None/NaN, floats with 3 decimals at most."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


def append_csv(path: str | Path, rows: list[dict], gpu: str | None = None,
               columns: tuple[str, ...] = CSV_COLUMNS) -> None:
    """Append `rows` (dicts holding the measured keys of `columns`; extra keys are ignored) to the CSV at
    `path`, writing the header when the file is new, and stamping gpu (default `gpu_name()`), commit and
    date."""
    path = Path(path)
    stamp = {"gpu": gpu or gpu_name(), "commit": commit(),
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    new = not path.exists() or path.stat().st_size == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell({**row, **stamp}.get(c)) for c in columns])


def read_csv(paths: list[str | Path]) -> list[dict]:
    """The rows of results CSVs, numbers as floats (None where empty); raises ValueError naming a file whose
    header is not CSV_COLUMNS."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) != CSV_COLUMNS:
                raise ValueError(f"{path}: header {reader.fieldnames} is not {','.join(CSV_COLUMNS)}")
            rows += [{k: _value(k, v) for k, v in row.items()} for row in reader]
    return rows


def _value(column: str, text: str):
    if column in ("mode", "gpu", "commit", "date"):
        return text
    return float(text) if text != "" else None
