"""Where the perf scripts put their tables: stdout, and $OUT/<name> when OUT is set (the device tool
brings $OUT back from the GPU machine)."""

from __future__ import annotations

import os
from pathlib import Path


def save(text: str, name: str) -> None:
    """Write `text` to $OUT/name when OUT is set."""
    out = os.environ.get("OUT")
    if out:
        Path(out, name).write_text(text)


def emit(text: str, name: str) -> None:
    """Print `text` and save it (see `save`)."""
    print(text)
    save(text, name)
