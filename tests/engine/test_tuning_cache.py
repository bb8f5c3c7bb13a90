"""The kernel tuning table between processes (kernels/autotune.py `save_tuned` / `load_tuned`, EngineConfig
.tune_cache): what is saved comes back equal; a table saved for another device, torch, triton or kernel source is
not taken; an unreadable or foreign file is skipped with a warning; an engine takes the table and writes it
back."""

from __future__ import annotations

import pickle

import pytest
import torch

from q3tts.engine import Engine, EngineConfig
from q3tts.kernels import autotune
from q3tts.kernels.code_predictor_gemm import GemmConfig

CPU = torch.device("cpu")
# keys no kernel of these tests looks up (a real key would change what the CPU runs)
ENTRIES = {("test_gemm", torch.Size([3, 4]), torch.bfloat16, 16): GemmConfig(32, 128, 2, 4, 4, 16),
           ("test_conv1d", (1, 2, 3), 1, torch.float32, True): "cudnn"}


@pytest.fixture
def table():
    """The process's table with ENTRIES in it, as it was afterwards."""
    before = dict(autotune._BEST)
    autotune._BEST.update(ENTRIES)
    yield autotune._BEST
    autotune._BEST.clear()
    autotune._BEST.update(before)


def test_a_saved_table_comes_back_equal(table, tmp_path):
    path = tmp_path / "sub" / "tuning.pkl"
    autotune.save_tuned(path, CPU)
    for key in ENTRIES:
        del table[key]
    assert autotune.load_tuned(path, CPU) == len(table) and all(table[k] == v for k, v in ENTRIES.items())
    assert not list(path.parent.glob("*.tmp"))


def test_a_table_for_something_else_is_not_taken(table, tmp_path, monkeypatch):
    path = tmp_path / "tuning.pkl"
    autotune.save_tuned(path, CPU)
    for key in ENTRIES:
        del table[key]
    name, torch_v, triton_v, sources = autotune.fingerprint(CPU)
    for other in ((name + "x", torch_v, triton_v, sources), (name, torch_v, triton_v, sources + "0")):
        monkeypatch.setattr(autotune, "fingerprint", lambda device, other=other: other)
        assert autotune.load_tuned(path, CPU) == 0 and not set(ENTRIES) & set(table)
    assert autotune.load_tuned(tmp_path / "none.pkl", CPU) == 0


def test_an_unreadable_or_foreign_file_is_skipped_with_a_warning(tmp_path):
    bad = tmp_path / "bad.pkl"
    bad.write_bytes(b"not a pickle")
    foreign = tmp_path / "foreign.pkl"
    foreign.write_bytes(pickle.dumps({"fingerprint": autotune.fingerprint(CPU), "best": {"k": ValueError("x")}}))
    for path, why in ((bad, "was not read"), (foreign, "has no place in a tuning table")):
        with pytest.warns(UserWarning, match=why):
            assert autotune.load_tuned(path, CPU) == 0


def test_an_engine_takes_the_table_and_writes_it_back(table, tiny_ckpt, tmp_path):
    path = tmp_path / "tuning.pkl"
    autotune.save_tuned(path, CPU)
    for key in ENTRIES:
        del table[key]
    engine = Engine(tiny_ckpt, EngineConfig(device="cpu", dtype="float32", max_slots=2, num_pages=64,
                                            tune_cache=str(path)))
    assert engine.startup.cached_configs == len(table) >= len(ENTRIES)
    assert str(engine.startup).endswith(f", {engine.startup.cached_configs} configs from the tuning cache)")
    path.unlink()
    Engine(tiny_ckpt, EngineConfig(device="cpu", dtype="float32", max_slots=2, num_pages=64, tune_cache=str(path)))
    assert path.exists()  # written back after the graphs (none on the CPU)
