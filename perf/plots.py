"""Load-test results CSVs -> PNGs and markdown tables (all rows, and ours / theirs against each peer).

    python perf/plots.py perf/results/loadtest_*.csv --out perf/results --md perf/results/loadtest.md

PNGs (each only when its rows exist): ttfa_vs_concurrency.png (closed loop and perf_analyzer, TTFA p50 and
p99), ttfa_vs_rate.png (open loop, p50/p95/p99), audio_s_per_s_vs_concurrency.png, ours_vs_peers.png (TTFA p50,
RTF p50 and audio-s/s of each peer row beside our closed-loop row at the same level: a peer's level is its
batch size, the number of utterances it has in flight, as concurrency is ours).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from report import read_csv  # noqa: E402

RATIO_METRICS = (("ttfa_p50_ms", "TTFA p50 (ms)", ".1f"), ("rtf_p50", "RTF p50", ".3f"),
                 ("audio_s_per_s", "audio-s/s", ".2f"))


def of_mode(rows: list[dict], mode: str) -> list[dict]:
    """The rows of one mode, by level."""
    return sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["level"])


def peer_pairs(rows: list[dict]) -> list[tuple[dict, dict | None]]:
    """(peer row, our closed-loop row at its level or None) for every peer row."""
    ours = {r["level"]: r for r in of_mode(rows, "closed")}
    peers = sorted((r for r in rows if r["mode"].startswith("peer:")), key=lambda r: (r["mode"], r["level"]))
    return [(p, ours.get(p["level"])) for p in peers]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def ratio_table(rows: list[dict]) -> str:
    """Ours / theirs per peer row: TTFA and RTF below 1 and audio-s/s above 1 are ours being better."""
    head = " | ".join(f"{label}: ours / theirs | ratio" for _, label, _ in RATIO_METRICS)
    lines = [f"| peer | level | {head} |", "|---|---:|" + "---|---:|" * len(RATIO_METRICS)]
    for peer, ours in peer_pairs(rows):
        cells = []
        for key, _, spec in RATIO_METRICS:
            mine = ours[key] if ours else None
            cells.append(f"{_fmt(mine, spec)} / {_fmt(peer[key], spec)} | {_fmt(_ratio(mine, peer[key]), '.2f')}")
        lines.append(f"| {peer['mode'][5:]} | {peer['level']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_table(rows: list[dict]) -> str:
    """Every row, as the CSV holds it (mode order: closed, open, perf_analyzer, peers)."""
    order = {"closed": 0, "open": 1, "perf_analyzer": 2}
    lines = ["| mode | level | TTFA p50 / p95 / p99 (ms) | e2e p95 (ms) | RTF p50 | audio-s/s | underrun / streams "
             "| errors | gpu | commit |", "|---|---:|---|---:|---:|---:|---|---:|---|---|"]
    for r in sorted(rows, key=lambda r: (order.get(r["mode"], 3), r["mode"], r["level"])):
        lines.append(f"| {r['mode']} | {r['level']:g} | {_fmt(r['ttfa_p50_ms'], '.1f')} / {_fmt(r['ttfa_p95_ms'], '.1f')} / "
                     f"{_fmt(r['ttfa_p99_ms'], '.1f')} | {_fmt(r['e2e_p95_ms'], '.1f')} | {_fmt(r['rtf_p50'], '.3f')} | "
                     f"{_fmt(r['audio_s_per_s'], '.2f')} | {_fmt(r['underrun_streams'], 'g')} / {_fmt(r['streams'], 'g')} | "
                     f"{_fmt(r['errors'], 'g')} | {r['gpu']} | {r['commit']} |")
    return "\n".join(lines)


def _lines(ax, series: list[tuple[list[dict], str, str]], xlabel: str, ylabel: str, title: str) -> None:
    for rows, key, label in series:
        pts = [(r["level"], r[key]) for r in rows if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", linestyle="--" if " p9" in label else "-", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    levels = sorted({r["level"] for rows, _, _ in series for r in rows})
    if xlabel.startswith("concurrent"):  # 1 .. 128: log scale, ticks at the measured levels
        ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [f"{v:g}" for v in levels])
    ax.grid(True, alpha=0.3)
    ax.legend()


def _save(fig, path: Path, written: list[Path]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)


def plot(rows: list[dict], out: Path, subtitle: str) -> list[Path]:
    """Write the PNGs that `rows` have data for into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    closed, opened, pa = of_mode(rows, "closed"), of_mode(rows, "open"), of_mode(rows, "perf_analyzer")
    written: list[Path] = []
    if closed or pa:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _lines(ax, [(closed, "ttfa_p50_ms", "closed loop p50"), (closed, "ttfa_p99_ms", "closed loop p99"),
                    (pa, "ttfa_p50_ms", "perf_analyzer p50"), (pa, "ttfa_p99_ms", "perf_analyzer p99")],
               "concurrent streams", "time to first audio (ms)", f"TTFA vs concurrency\n{subtitle}")
        _save(fig, out / "ttfa_vs_concurrency.png", written)
    if opened:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _lines(ax, [(opened, "ttfa_p50_ms", "p50"), (opened, "ttfa_p95_ms", "p95"), (opened, "ttfa_p99_ms", "p99")],
               "requests/s (Poisson arrivals)", "time to first audio (ms)", f"TTFA vs request rate\n{subtitle}")
        _save(fig, out / "ttfa_vs_rate.png", written)
    if closed or pa:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _lines(ax, [(closed, "audio_s_per_s", "closed loop"), (pa, "audio_s_per_s", "perf_analyzer")],
               "concurrent streams", "audio seconds per second", f"Throughput vs concurrency\n{subtitle}")
        _save(fig, out / "audio_s_per_s_vs_concurrency.png", written)
    pairs = [(p, o) for p, o in peer_pairs(rows) if o is not None]
    if pairs:
        fig, axes = plt.subplots(1, len(RATIO_METRICS), figsize=(5 * len(RATIO_METRICS), 4.5))
        labels = [f"{p['mode'][5:]}\n@{p['level']:g}" for p, _ in pairs]
        x = range(len(pairs))
        for ax, (key, label, _) in zip(axes, RATIO_METRICS):
            ax.bar([i - 0.2 for i in x], [o[key] or 0 for _, o in pairs], width=0.4, label="ours")
            ax.bar([i + 0.2 for i in x], [p[key] or 0 for p, _ in pairs], width=0.4, label="peer")
            ax.set_xticks(list(x), labels, fontsize=8)
            ax.set(title=label)
            ax.legend()
        fig.suptitle(f"Ours vs peers (same checkpoint, same GPU)\n{subtitle}")
        _save(fig, out / "ours_vs_peers.png", written)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csvs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for the PNGs")
    ap.add_argument("--md", type=Path, default=None, help="also write the tables here")
    args = ap.parse_args(argv)
    try:
        rows = read_csv(args.csvs)
    except (OSError, ValueError) as e:
        raise SystemExit(f"plots: {e}")
    if not rows:
        raise SystemExit(f"plots: no rows in {', '.join(map(str, args.csvs))}")
    subtitle = ", ".join(sorted({f"{r['gpu']} @ {r['commit']}" for r in rows}))
    for path in plot(rows, args.out, subtitle):
        print(f"wrote {path}")
    text = f"Load test ({subtitle})\n\n{rows_table(rows)}\n\nOurs / theirs (ours: closed loop at the peer's level)\n\n{ratio_table(rows)}"
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
