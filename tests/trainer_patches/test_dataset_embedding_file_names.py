"""The dataset's per-caption text-embedding files name the text encoder that made them (wall 3-4).

Runs the trainer's own caching loop (TextEmbeddingCachingMixin.cache_text_embeddings) over a real
FileItemDTO (a 16x16 image and its caption) with a stand-in model whose encoder is named the way
the text phase names it (`text_encoder_identity`). Another encoder must get its own file and be
asked to encode again; the same encoder finds its file on a relaunch; a model that names no
encoder keeps the file name of earlier launches. Without the hook, the second encoder silently
reuses the first one's embeddings.
"""

import base64
import hashlib
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


class StandInModel:
    """What the caching loop asks of the model; counts the captions it is asked to encode."""

    has_multiple_control_images = False
    device = device_torch = torch.device("cpu")
    torch_dtype = torch.float32

    def __init__(self, prompt_embeds_class, identity=None):
        self.model_config = SimpleNamespace(arch="flux2")
        self.encoded = []
        self._prompt_embeds = prompt_embeds_class
        if identity is not None:
            self.text_encoder_identity = identity

    def set_device_state_preset(self, *_):
        pass

    def encode_prompt(self, caption, control_images=None):
        self.encoded.append(caption)
        return self._prompt_embeds(torch.full((1, 2, 4), float(len(self.encoded))))


@pytest.fixture
def cache_for(trainer_on_path, tmp_path):
    """cache(model) -> the file the trainer's caching loop keyed the one caption's embedding by."""
    from PIL import Image

    config_modules = importlib.import_module("toolkit.config_modules")
    dto = importlib.import_module("toolkit.data_transfer_object.data_loader")
    mixins = importlib.import_module("toolkit.dataloader_mixins")
    image = tmp_path / "a.png"
    Image.new("RGB", (16, 16), (200, 40, 40)).save(image)
    image.with_suffix(".txt").write_text("a red square", encoding="utf-8")
    config = config_modules.DatasetConfig(folder_path=str(tmp_path), caption_ext="txt", cache_text_embeddings=True)
    item = dto.FileItemDTO(path=str(image), dataset_config=config)

    def cache(model) -> Path:
        dataset = SimpleNamespace(file_list=[item], sd=model, dataset_path=str(tmp_path), dataset_config=config)
        mixins.TextEmbeddingCachingMixin.cache_text_embeddings(dataset)
        assert item.is_text_embedding_cached
        return Path(item.get_text_embedding_path())

    cache.prompt_embeds = importlib.import_module("toolkit.prompt_utils").PromptEmbeds
    cache.item = item
    return cache


@pytest.mark.patch("dataset-the-per-caption-embedding-cache-names-the-te")
def test_another_encoder_gets_its_own_file(cache_for):
    first = StandInModel(cache_for.prompt_embeds, identity="mistral-24b:bf16:layers-10-20-30")
    other = StandInModel(cache_for.prompt_embeds, identity="mistral-24b:uint4:layers-10-20-30")
    first_file = cache_for(first)
    assert first.encoded == ["a red square"] and first_file.is_file()
    other_file = cache_for(other)
    assert other_file != first_file, (
        f"another text encoder reused {first_file.name}: the dataset's embedding file name must name the encoder"
    )
    assert other.encoded == ["a red square"] and other_file.is_file()
    again = StandInModel(cache_for.prompt_embeds, identity="mistral-24b:bf16:layers-10-20-30")
    assert cache_for(again) == first_file and again.encoded == [], "the same encoder must find its own file"


def test_a_model_that_names_no_encoder_keeps_its_file_name(cache_for):
    model = StandInModel(cache_for.prompt_embeds)
    made = cache_for(model)
    item = cache_for.item
    key = {"caption": "a red square", "text_embedding_space_version": item.text_embedding_space_version,
           "text_embedding_version": item.text_embedding_version}
    digest = base64.urlsafe_b64encode(hashlib.md5(json.dumps(key, sort_keys=True).encode()).digest()).decode()
    assert made.name == f"a_{digest.replace('=', '')}.safetensors", "earlier launches' files must still be found"
    assert model.encoded == ["a red square"]
