"""The voices directory: round trip, every refusal (one clear error, nothing written), atomicity under
concurrent writers and readers, and the serving side's record of voice files (LRU bound, stale files,
family check)."""

from __future__ import annotations

import errno
import json
import threading

import numpy as np
import pytest

import q3tts.voices.cache as cache_mod
import q3tts.voices.store as store_mod
from q3tts.voices.cache import VoiceFiles
from q3tts.voices.enroll import Enroller
from q3tts.voices.store import Family, UnknownVoice, Voice, VoiceError, VoiceExists, VoiceStorageError

from voice_fixtures import REF_SR, REF_TEXT


def leftovers(store) -> list[str]:
    """Everything in the voices directory except the lock file."""
    return sorted(p.name for p in store.root.iterdir() if p.name != ".lock") if store.root.exists() else []


def synthetic(name: str, family: Family, frames: int = 4, seed: int = 0) -> Voice:
    rng = np.random.default_rng(seed)
    return Voice(name, family, rng.standard_normal(family.xvector_dim).astype(np.float32),
                 rng.integers(0, 2048, (frames, 16)).astype(np.int64), "some words")


def test_round_trip(store, enroller, ref_wav):
    voice = store.add(enroller.enroll("Alice", ref_wav, REF_SR, REF_TEXT))
    assert voice.name == "alice" and len(voice.sha256) == 64
    assert leftovers(store) == ["alice.safetensors"]
    back = store.read("ALICE")
    np.testing.assert_array_equal(back.xvector, voice.xvector)
    np.testing.assert_array_equal(back.ref_codes, voice.ref_codes)
    assert back.ref_codes.shape == (8, 16) and back.xvector.dtype == np.float32
    assert (back.ref_text, back.family, back.sha256) == (REF_TEXT, enroller.family, voice.sha256)
    assert [v["name"] for v in store.list()] == ["alice"]
    spec = back.spec(language="english")
    assert spec.ref_audio is None and spec.ref_text == REF_TEXT and not spec.xvector_only


def test_xvector_only_voice_has_no_codes(store, enroller, ref_wav):
    voice = store.add(enroller.enroll("bob", ref_wav, REF_SR, xvector_only=True))
    back = store.read("bob")
    assert back.ref_codes is None and back.ref_text is None and back.spec().xvector_only
    np.testing.assert_array_equal(back.xvector, voice.xvector)


@pytest.mark.parametrize("case, match", [
    ("empty", "empty"), ("huge", "at most 60 s"), ("nan", "non-finite"), ("rate_low", "REF_SAMPLE_RATE"),
    ("rate_high", "REF_SAMPLE_RATE"), ("stereo", "mono"), ("no_text", "transcript"),
])
def test_bad_reference_is_refused_and_nothing_written(store, enroller, ref_wav, case, match):
    wav, sr, text = ref_wav, REF_SR, REF_TEXT
    if case == "empty":
        wav = np.zeros(0, np.float32)
    elif case == "huge":
        wav, sr = np.zeros(8000 * 61, np.float32), 8000
    elif case == "nan":
        wav = ref_wav.copy()
        wav[100] = np.nan
    elif case == "rate_low":
        sr = 4000
    elif case == "rate_high":
        sr = 400_000
    elif case == "stereo":
        wav = np.stack([ref_wav, ref_wav], axis=1)
    else:
        text = "  "
    with pytest.raises(VoiceError, match=match) as err:
        store.add(enroller.enroll("carol", wav, sr, text))
    assert "'carol'" in str(err.value)
    assert leftovers(store) == []


@pytest.mark.parametrize("name", ["../evil", "a/b", "", ".hidden", "x" * 65, "two words", "é", "a\\b"])
def test_bad_names_are_refused(store, enroller, ref_wav, name):
    with pytest.raises(VoiceError, match="not allowed"):
        store.add(enroller.enroll(name, ref_wav, REF_SR, REF_TEXT))
    with pytest.raises(VoiceError, match="not allowed"):
        store.read(name)
    assert leftovers(store) == []


def test_duplicate_is_refused_and_the_first_kept(store, enroller, ref_wav):
    first = store.add(enroller.enroll("dave", ref_wav, REF_SR, REF_TEXT))
    with pytest.raises(VoiceExists, match="already registered"):
        store.add(enroller.enroll("Dave", ref_wav * 0.5, REF_SR, "Other words."))
    assert store.read("dave").sha256 == first.sha256
    assert leftovers(store) == ["dave.safetensors"]


def test_full_disk_leaves_nothing_behind(store, enroller, ref_wav, monkeypatch):
    def full_disk(path, data):  # writes part of the file, then the disk is full
        with open(path, "xb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod, "_write_durably", full_disk)
    with pytest.raises(VoiceStorageError, match="disk is full") as err:
        store.add(enroller.enroll("erin", ref_wav, REF_SR, REF_TEXT))
    assert "'erin'" in str(err.value)
    assert leftovers(store) == []
    with pytest.raises(UnknownVoice):
        store.read("erin")


def test_corrupt_file_is_refused(store):
    fam = Family("base", "0b6", 48)
    store.add(synthetic("frank", fam))
    path = store.path("frank")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(VoiceError, match="corrupt"):
        store.read("frank")
    assert "corrupt" in store.list()[0]["error"]


def test_remove(store):
    store.add(synthetic("gina", Family("base", "0b6", 48)))
    store.remove("Gina")
    assert leftovers(store) == []
    with pytest.raises(UnknownVoice, match="not registered"):
        store.remove("gina")


def test_non_base_checkpoint_is_refused(base_ckpt, tmp_path):
    config = json.loads((base_ckpt / "config.json").read_text())
    config["tts_model_type"] = "custom_voice"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(VoiceError, match="Base checkpoint"):
        Enroller.from_checkpoint(tmp_path)


def test_concurrent_writers_and_readers(store):
    fam = Family("base", "0b6", 48)
    store.add(synthetic("reader", fam))
    cache = VoiceFiles(store, fam, max_entries=4)
    errors, dup_results, stop = [], [], threading.Event()

    def read_loop():
        while not stop.is_set():
            try:
                cache.resolve("reader")
                for info in store.list():  # a half-written file would show up here as an error
                    assert "error" not in info, info
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

    def add_dup(seed):
        try:
            store.add(synthetic("dup", fam, seed=seed))
            dup_results.append("ok")
        except VoiceExists:
            dup_results.append("exists")

    readers = [threading.Thread(target=read_loop) for _ in range(3)]
    for t in readers:
        t.start()
    writers = [threading.Thread(target=store.add, args=(synthetic(f"v{i}", fam, frames=50, seed=i),))
               for i in range(6)] + [threading.Thread(target=add_dup, args=(s,)) for s in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert errors == []
    assert sorted(dup_results) == ["exists"] * 3 + ["ok"]
    assert store.names() == sorted(["dup", "reader", *(f"v{i}" for i in range(6))])
    assert leftovers(store) == [f"{n}.safetensors" for n in store.names()]


def test_cache_is_lru_bounded(store, monkeypatch):
    fam = Family("base", "0b6", 48)
    for i, name in enumerate("abc"):
        store.add(synthetic(name, fam, seed=i))
    reads = []
    monkeypatch.setattr(cache_mod, "from_file", lambda path: reads.append(path.stem) or store_mod.from_file(path))
    cache = VoiceFiles(store, fam, max_entries=2)
    for name in ["a", "b", "a", "c", "a", "b"]:  # c evicts b (LRU), then b evicts c
        assert cache.resolve(name).name == name
    assert reads == ["a", "b", "c", "b"]


def test_cache_notices_replaced_and_removed_files(store):
    fam = Family("base", "0b6", 48)
    store.add(synthetic("hana", fam, seed=1))
    cache = VoiceFiles(store, fam)
    old = cache.resolve("hana")
    store.remove("hana")
    with pytest.raises(UnknownVoice):
        cache.resolve("hana")
    new = store.add(synthetic("hana", fam, frames=6, seed=2))
    got = cache.resolve("hana")
    assert got.sha256 == new.sha256 != old.sha256 and got.ref_codes.shape == (6, 16)


def test_cache_refuses_another_family(store):
    store.add(synthetic("ivan", Family("base", "1b7", 64)))
    with pytest.raises(VoiceError, match="made for base-1b7"):
        VoiceFiles(store, Family("base", "0b6", 48)).resolve("ivan")
    with pytest.raises(VoiceError, match="need a Base checkpoint"):
        VoiceFiles(store, Family("custom_voice", "1b7", 64)).resolve("ivan")
