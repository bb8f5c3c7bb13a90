"""The model repository Triton serves: every `model_repository/<model>/` copied into a run dir, its
`config.pbtxt` rendered from `config.pbtxt.tmpl`.

The input and output tables come from `q3tts_client.protocol` (the one definition of the wire protocol):
templates say `${inputs}` and `${outputs}` (the voices model: `${voices_inputs}`, `${voices_outputs}`).
Rendering is strict: `string.Template.substitute` raises on an unknown name, and no `${` may remain.
"""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path

from q3tts_client import protocol as P

TEMPLATE_DIR = Path(os.environ.get("Q3TTS_MODEL_REPOSITORY") or Path(__file__).resolve().parents[2] / "model_repository")
TEMPLATE_NAME = "config.pbtxt.tmpl"


def pbtxt_string(s: str) -> str:
    """A double-quoted string with C escapes: valid protobuf text format."""
    return json.dumps(s)


def tensor_table(tensors: dict[str, tuple[str, list[int], str]], optional: tuple[str, ...] = ()) -> str:
    """config.pbtxt rows for protocol.INPUTS or protocol.OUTPUTS (name -> (data type, dims, numpy dtype))."""
    rows = []
    for name, (data_type, dims, _) in tensors.items():
        flag = " optional: true" if name in optional else ""
        rows.append(f'  {{ name: {pbtxt_string(name)} data_type: {data_type} dims: [ {", ".join(map(str, dims))} ]{flag} }}')
    return ",\n".join(rows)


def protocol_values() -> dict[str, str]:
    """The template values that are facts of the wire protocol."""
    return {"inputs": tensor_table(P.INPUTS, P.OPTIONAL_INPUTS), "outputs": tensor_table(P.OUTPUTS),
            "sequence_model": pbtxt_string(P.MODEL),
            "voices_inputs": tensor_table(P.VOICES_INPUTS, P.VOICES_OPTIONAL_INPUTS),
            "voices_outputs": tensor_table(P.VOICES_OUTPUTS)}


def render_repository(out_dir: Path, values: dict[str, str], template_dir: Path = TEMPLATE_DIR) -> Path:
    """Copy every model of `template_dir` into `out_dir` (replaced), rendering config.pbtxt with `values`
    plus protocol_values()."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    values = {**values, **protocol_values()}
    for model_dir in sorted(p for p in template_dir.iterdir() if (p / TEMPLATE_NAME).exists()):
        dst = out_dir / model_dir.name
        shutil.copytree(model_dir, dst, ignore=shutil.ignore_patterns(TEMPLATE_NAME, "__pycache__"))
        text = string.Template((model_dir / TEMPLATE_NAME).read_text()).substitute(values)
        if "${" in text:
            raise ValueError(f"unrendered placeholder left in {model_dir.name}/config.pbtxt")
        (dst / "config.pbtxt").write_text(text)
    return out_dir
