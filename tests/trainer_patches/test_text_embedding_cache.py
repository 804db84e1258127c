"""The prompt-embedding cache (overlay toolkit/text_embedding_cache.py, walls 3-4).

An entry is found only under its own key (encoder identity, template, dtype, prompt); one
that is truncated, altered or written for another key is set aside and never returned; a
crash mid-write leaves no file under a real name.
"""

import importlib
import json
import os

import pytest
import torch

KEY = {"encoder": "e" * 64, "template": {"max_length": 8}, "dtype": "torch.bfloat16"}


@pytest.fixture(scope="module")
def tec(trainer_on_path):
    return importlib.import_module("toolkit.text_embedding_cache")


@pytest.fixture
def cache(tec, tmp_path):
    return tec.TextEmbeddingCache(tmp_path / "cache", KEY, log=lambda message: None)


def embeds(seed=0):
    return torch.randn(8, 12, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_round_trip_is_exact_and_keyed_by_prompt(cache):
    cache.save("a red square", embeds(0))
    cache.save("", embeds(1))
    assert torch.equal(cache.load("a red square"), embeds(0))
    assert torch.equal(cache.load(""), embeds(1))
    assert cache.load("a blue square") is None and not cache.has("a blue square")


@pytest.mark.parametrize("field,value", [("encoder", "f" * 64), ("template", {"max_length": 9}),
                                         ("dtype", "torch.float16")])
def test_another_encoder_template_or_dtype_never_finds_it(tec, cache, tmp_path, field, value):
    cache.save("a red square", embeds())
    other = tec.TextEmbeddingCache(cache.folder, {**KEY, field: value}, log=lambda message: None)
    assert not other.has("a red square") and other.load("a red square") is None


def test_a_file_under_the_wrong_name_is_set_aside(tec, cache):
    cache.save("a red square", embeds())
    os.replace(cache.path_for("a red square"), cache.path_for("a blue square"))
    assert cache.load("a blue square") is None
    assert not cache.has("a blue square")
    assert cache.path_for("a blue square").with_name(cache.path_for("a blue square").name + ".corrupt").is_file()


@pytest.mark.parametrize("damage", ["truncate", "flip", "metadata"])
def test_a_damaged_entry_is_reported_set_aside_and_not_returned(tec, tmp_path, damage):
    said = []
    cache = tec.TextEmbeddingCache(tmp_path / "cache", KEY, log=said.append)
    cache.save("a red square", embeds())
    path = cache.path_for("a red square")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-10]
    elif damage == "flip":
        data[-5] ^= 0x40
    else:
        start = data.index(b"a red square")  # the prompt in the metadata, same length
        data[start:start + 12] = b"a red squarX"
    path.write_bytes(bytes(data))
    if damage == "flip":  # only the tensor's sha256 can tell, when it is loaded
        assert cache.has("a red square") and cache.load("a red square") is None
    else:  # the header or the metadata already tell
        assert not cache.has("a red square")
    assert not path.exists() and path.with_name(path.name + ".corrupt").is_file()
    assert said and str(path) in said[0]


def test_a_write_interrupted_before_the_rename_leaves_nothing_under_the_real_name(tec, cache, monkeypatch):
    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tec.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        cache.save("a red square", embeds())
    assert not cache.has("a red square")
    assert list(cache.folder.iterdir()) == []


def test_entries_are_safetensors_with_json_metadata(cache):
    cache.save("a red square", embeds())
    raw = cache.path_for("a red square").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    meta = json.loads(header["__metadata__"]["aitk_temb"])
    assert meta["prompt"] == "a red square" and meta["key"]["encoder"] == KEY["encoder"]
    assert list(k for k in header if k != "__metadata__") == ["embeds"]


def test_the_encoder_record_is_recalled_by_folder(tec, tmp_path):
    folder = tmp_path / "cache"
    tec.remember_encoder(folder, tmp_path / "te", {"identity": "x", "hidden_size": 64})
    assert tec.recall_encoder(folder, tmp_path / "te")["hidden_size"] == 64
    assert tec.recall_encoder(folder, tmp_path / "other") is None
