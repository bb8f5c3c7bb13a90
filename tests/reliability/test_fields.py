"""The table of request inputs and parameters (client/protocol.py FIELDS): the README shows it as it is, and
both validators (request parsing, SamplingParams.validate) refuse every value outside it with one error naming
the parameter."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from q3tts.core import InvalidRequest, SamplingParams
from q3tts_client import protocol as P

README = Path(__file__).resolve().parents[2] / "README.md"
NUMERIC = [f for f in P.FIELDS.values() if f.kind != "input" and f.type in (int, float) and f.low is not None]


def outside(f: P.Field) -> list:
    """Values just outside the field's range, plus the non-finite ones for floats."""
    below = f.low if f.low_open else (f.low - 1 if f.type is int else f.low / 2 if f.low > 0 else -1.0)
    values = [below, f.high + 1, f.high * 10 ** 6 if f.type is float else 10 ** 30]
    if f.type is float:
        values += [math.nan, math.inf, -math.inf]
    return values


def test_readme_table_is_the_generated_one():
    text = README.read_text()
    block = re.search(r"<!-- protocol-fields:begin -->\n(.*?)\n<!-- protocol-fields:end -->", text, re.S)
    assert block is not None, "README.md has no protocol-fields block"
    assert block.group(1) == P.markdown_table()


def test_every_sampling_field_is_a_parameter_of_the_table():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(P.SAMPLING_PARAMS) == names
    assert set(P.PARAMS) == {f.name for f in P.FIELDS.values() if f.kind != "input"}


@pytest.mark.parametrize("f", NUMERIC, ids=lambda f: f.name)
def test_out_of_range_parameters_are_refused_by_name(f):
    for value in outside(f):
        if f.unused_when is None or not math.isfinite(value):
            with pytest.raises(ValueError, match=f"parameter '{f.name}' must be"):
                P.coerce_param(f.name, value)
        if f.name in P.SAMPLING_PARAMS:
            with pytest.raises(InvalidRequest, match=f"parameter '{f.name}' must be"):
                SamplingParams(**{f.name: value}).validate()
    for value in (f.low if not f.low_open else f.high, f.high):  # the bounds themselves pass
        P.coerce_param(f.name, value)
        if f.name in P.SAMPLING_PARAMS:
            SamplingParams(**{f.name: value}).validate()


def test_seed_of_30_digits_and_negative_seed_are_refused():
    for seed in (10 ** 30, 2 ** 63, -1):
        with pytest.raises(InvalidRequest, match="parameter 'seed' must be in"):
            SamplingParams(seed=seed).validate()
    SamplingParams(seed=2 ** 63 - 1).validate()


def test_a_greedy_draw_does_not_range_check_its_temperature_but_refuses_nan():
    SamplingParams(greedy=True, temperature=0.0).validate()
    SamplingParams(subtalker_greedy=True, subtalker_temperature=0.0).validate()
    with pytest.raises(InvalidRequest, match="'temperature' must be a finite number"):
        SamplingParams(greedy=True, temperature=math.nan).validate()
    with pytest.raises(InvalidRequest, match="'subtalker_temperature' must be in"):
        SamplingParams(subtalker_temperature=0.0).validate()  # sampled: the range applies


def test_wrong_types_are_refused_by_name():
    with pytest.raises(InvalidRequest, match="'top_k' must be int"):
        SamplingParams(top_k=5.5).validate()
    with pytest.raises(InvalidRequest, match="'greedy' must be bool"):
        SamplingParams(greedy=1).validate()
    with pytest.raises(ValueError, match="'text_mode' must be one of whole \\| incremental"):
        P.coerce_param("text_mode", "streaming")


@pytest.mark.parametrize("variant, size, name, ok", [
    ("custom_voice", "0b6", P.INPUT_SPEAKER, True),
    ("base", "0b6", P.INPUT_SPEAKER, False),
    ("custom_voice", "0b6", P.INPUT_REF_AUDIO, False),
    ("voice_design", "1b7", P.PARAM_XVECTOR_ONLY, False),
    ("custom_voice", "0b6", P.INPUT_INSTRUCT, False),
    ("custom_voice", "1b7", P.INPUT_INSTRUCT, True),
    ("base", "1b7", P.INPUT_INSTRUCT, False),
    ("base", "0b6", P.INPUT_VOICE, True),
    ("base", "0b6", "temperature", True),
])
def test_inputs_the_variant_does_not_use_are_refused_by_name(variant, size, name, ok):
    if ok:
        P.check_variant(variant, size, [name])
    else:
        with pytest.raises(ValueError, match=f"'{name}' is for"):
            P.check_variant(variant, size, [name])
