"""The text phase (overlay toolkit/text_phase.py, walls 3-4): every prompt embedded before the
transformer loads, from the cache when it can be, and a relaunch that never opens the encoder.

The prompts are short (max length 16) so that streaming the tiny encoder takes a second.
"""

import importlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import mistral_output_layers

PROMPTS = ["", "a photo of a red square", "a green circle on a black background"]


@pytest.fixture(scope="module")
def mods(trainer_on_path):
    pipeline = importlib.import_module("extensions_built_in.diffusion_models.flux2.src.pipeline")
    return (pipeline, importlib.import_module("toolkit.streamed_text_encoder"),
            importlib.import_module("toolkit.text_phase"))


def template(mods, max_length=16):
    pipeline, ste, _ = mods
    return ste.PromptTemplate(lambda texts: pipeline.Flux2Pipeline.format_input(None, texts), max_length,
                              mistral_output_layers(pipeline))


@pytest.fixture
def encoder(tiny_text_encoder, tmp_path) -> Path:
    """A private copy of the tiny encoder, free to move or edit."""
    return Path(shutil.copytree(tiny_text_encoder, tmp_path / "te"))


class Spy:
    """Counts the prompts the streamed encoder runs; can forbid opening the encoder at all."""

    def __init__(self, ste, monkeypatch, forbid=False):
        self.encoded = []
        real_encode = ste.StreamedTextEncoder.encode

        def encode(encoder, prompts):
            self.encoded += prompts
            return real_encode(encoder, prompts)

        def open_encoder(*args, **kwargs):
            raise AssertionError("the text encoder folder was opened")

        monkeypatch.setattr(ste.StreamedTextEncoder, "encode", encode)
        if forbid:
            monkeypatch.setattr(importlib.import_module("toolkit.text_phase"), "open_encoder", open_encoder)


def run(mods, folder, cache_dir, prompts=PROMPTS, width=3 * 64, max_length=16, log=None):
    _, _, tp = mods
    phase = tp.TextPhase(Path(folder), template(mods, max_length), width, torch.device("cpu"),
                         log=(log if log is not None else (lambda message: None)))
    return tp.run_text_phase(phase, list(prompts), cache_dir)


def test_a_relaunch_with_every_prompt_cached_never_opens_the_encoder(mods, encoder, tmp_path, monkeypatch):
    _, ste, _ = mods
    spy = Spy(ste, monkeypatch)
    first = run(mods, encoder, tmp_path / "cache").get(PROMPTS)
    assert spy.encoded == PROMPTS and first.shape == (3, 16, 3 * 64)
    direct = ste.StreamedTextEncoder(ste.open_encoder(encoder, 30), template(mods), "cpu", log=print).encode(PROMPTS)
    assert torch.equal(first, direct)

    encoder.rename(tmp_path / "moved-away")
    monkeypatch.undo()
    spy = Spy(ste, monkeypatch, forbid=True)
    said = []
    again = run(mods, encoder, tmp_path / "cache", log=said.append)
    assert torch.equal(again.get(PROMPTS), first) and spy.encoded == []
    assert any("not opened" in line for line in said)


def test_encoder_gone_and_a_prompt_not_cached_is_a_clear_error(mods, encoder, tmp_path):
    _, ste, _ = mods
    run(mods, encoder, tmp_path / "cache", prompts=PROMPTS[:2])
    encoder.rename(tmp_path / "moved-away")
    with pytest.raises(ste.TextEncoderFolderError) as caught:
        run(mods, encoder, tmp_path / "cache")
    assert str(encoder) in str(caught.value) and repr(PROMPTS[2]) in str(caught.value)


def test_encoder_gone_with_no_cache_made_from_it_is_a_clear_error(mods, tmp_path):
    _, ste, _ = mods
    with pytest.raises(ste.TextEncoderFolderError, match="not found, and no embedding cache was made from it"):
        run(mods, tmp_path / "nowhere", tmp_path / "cache")


def test_a_width_the_transformer_cannot_take_is_refused_before_any_layer_runs(mods, encoder, tmp_path, monkeypatch):
    _, ste, _ = mods
    spy = Spy(ste, monkeypatch)
    with pytest.raises(ste.TextEncoderFolderError) as caught:
        run(mods, encoder, tmp_path / "cache", width=3 * 80)
    message = str(caught.value)
    assert "config.json" in message and "hidden size 64" in message and "context_in_dim" in message and "240" in message
    assert spy.encoded == []
    # the same check holds from the cache's record when the folder is gone
    run(mods, encoder, tmp_path / "cache")
    encoder.rename(tmp_path / "moved-away")
    with pytest.raises(ste.TextEncoderFolderError, match="hidden size 64"):
        run(mods, encoder, tmp_path / "cache", width=3 * 80)


def edit_chat_template(folder: Path):
    path = folder / "chat_template.jinja"
    path.write_text(path.read_text() + " ")


def edit_norm_eps(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change", ["max_length", "chat_template", "config"])
def test_another_template_or_encoder_rebuilds_and_never_reuses(mods, encoder, tmp_path, monkeypatch, change):
    _, ste, _ = mods
    spy = Spy(ste, monkeypatch)
    first = run(mods, encoder, tmp_path / "cache").get(PROMPTS)
    max_length = 16
    if change == "max_length":
        max_length = 20
    elif change == "chat_template":
        edit_chat_template(encoder)
    else:
        edit_norm_eps(encoder)
    second = run(mods, encoder, tmp_path / "cache", max_length=max_length).get(PROMPTS)
    assert spy.encoded == PROMPTS + PROMPTS and second.shape[1] == max_length
    if change == "config":  # another norm epsilon: other numbers, which the old entries would hide
        assert not torch.equal(first, second)


def test_a_damaged_entry_is_rebuilt(mods, encoder, tmp_path, monkeypatch):
    _, ste, _ = mods
    store = run(mods, encoder, tmp_path / "cache")
    first = store.get(PROMPTS)
    path = store.cache.path_for(PROMPTS[1])
    path.write_bytes(path.read_bytes()[:-7])
    spy = Spy(ste, monkeypatch)
    again = run(mods, encoder, tmp_path / "cache")
    assert spy.encoded == [PROMPTS[1]]
    assert torch.equal(again.get(PROMPTS), first)


def test_a_prompt_unknown_before_loading_is_encoded_on_demand(mods, encoder, tmp_path, monkeypatch):
    _, ste, _ = mods
    store = run(mods, encoder, tmp_path / "cache")
    spy = Spy(ste, monkeypatch)
    late = store.get(["a blue square", PROMPTS[0]])
    assert spy.encoded == ["a blue square"] and late.shape == (2, 16, 3 * 64)
    assert store.cache.has("a blue square")


@pytest.mark.gpu
def test_the_text_phase_leaves_no_tensor_on_the_gpu(mods, encoder, tmp_path):
    """Only the allocator's cache is left once the phase ends, which the memory plan's budget counts
    as free (test_memory_budget.py); a first run sets up the device's one-time workspaces."""
    _, _, tp = mods

    def phase_on_the_gpu(prompts, cache):
        phase = tp.TextPhase(Path(encoder), template(mods), 3 * 64, torch.device("cuda"), log=lambda message: None)
        return tp.run_text_phase(phase, prompts, tmp_path / cache).get(prompts)

    phase_on_the_gpu(["a first prompt"], "warm-up")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    embeddings = phase_on_the_gpu(PROMPTS, "cache")
    assert embeddings.device.type == "cpu"
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, "the text phase left tensors on the GPU"


def test_dataset_captions_come_from_the_trainers_caption_code(mods, tiny_text_encoder, tmp_path):
    _, _, tp = mods
    from toolkit.config_modules import DatasetConfig

    dataset = tiny_text_encoder.parent / "dataset"
    expected = sorted(p.read_text() for p in dataset.glob("*.txt"))
    plain = DatasetConfig(folder_path=str(dataset), caption_ext="txt", cache_text_embeddings=True)
    triggered = DatasetConfig(folder_path=str(dataset), caption_ext="txt", cache_text_embeddings=True,
                              trigger_word="sks", shuffle_tokens=True)
    random.seed(7)
    state = random.getstate()
    assert sorted(tp.dataset_captions([plain], None)) == expected
    captions = tp.dataset_captions([triggered], None)
    assert random.getstate() == state
    assert len(captions) == len(expected) and all("sks" in c for c in captions)


def test_sample_prompts_are_text_even_without_a_negative_prompt(mods):
    """A `sample:` block with no `neg` parses the negative prompt as False: only text is embedded."""
    _, _, tp = mods
    from toolkit.config_modules import SampleConfig

    plain = SampleConfig(prompts=["a red square"], sample_every=1)
    assert tp.sample_prompts(plain) == ["a red square"]
    negative = SampleConfig(prompts=["a red square"], neg="blurry", sample_every=1)
    assert tp.sample_prompts(negative) == ["a red square", "blurry"]
