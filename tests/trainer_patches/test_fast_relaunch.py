"""A fast relaunch: an extension job imports only the processes it runs, and a dataset of cached
latents is read without forking dataloader workers from the trainer.

The extension choice is checked against stand-in extensions (each records whether its process
class was asked for), the worker choice against stand-in datasets; test_no_round_trips.py sees
the real dataloader of a tiny run built with no workers, and with the dataset's two when
switched off.
"""

import importlib
from types import SimpleNamespace

import pytest


def stand_in_extensions(asked: list):
    def extension(uid):
        return type(uid, (), {"uid": uid, "get_process": classmethod(lambda cls: asked.append(cls.uid) or cls)})
    return [extension("sd_trainer"), extension("dataset_tools"), extension("concept_slider")]


@pytest.fixture
def extensions_hook(trainer_on_path, monkeypatch):
    module = importlib.import_module("toolkit.extension")
    asked = []
    monkeypatch.setattr(module, "get_all_extensions", lambda: stand_in_extensions(asked))
    monkeypatch.setenv("AITK_ALL_EXTENSIONS", "1")  # the trainer reads no variable
    return importlib.import_module("toolkit.flux2_hooks"), asked


@pytest.mark.patch("extension-jobs-import-only-the-processes")
def test_only_the_named_process_is_imported(extensions_hook):
    hooks, asked = extensions_hook
    processes = hooks.get_extensions_process_dict([{"type": "sd_trainer", "model": {"model_kwargs": {}}}])
    assert list(processes) == ["sd_trainer"] and asked == ["sd_trainer"]


@pytest.mark.patch("extension-jobs-import-only-the-processes")
@pytest.mark.parametrize("processes", [[{"type": "sd_trainer"}, {"type": "no_such_type"}],
                                       [{"type": "sd_trainer", "model": {"model_kwargs": {"all_extensions": True}}}]],
                         ids=["unknown-type-falls-back", "switched-off"])
def test_every_process_is_imported_as_before(extensions_hook, processes):
    hooks, asked = extensions_hook
    processes = hooks.get_extensions_process_dict(processes)
    assert sorted(processes) == sorted(asked) == ["concept_slider", "dataset_tools", "sd_trainer"]


def dataset(*items, **config):
    return SimpleNamespace(file_list=list(items), dataset_config=SimpleNamespace(
        num_frames=config.get("num_frames", 1), load_image_when_caching_latents=False))


def item(cached=True, **images):
    return SimpleNamespace(is_latent_cached=cached, **images)


def model(**model_kwargs):
    return SimpleNamespace(model_config=SimpleNamespace(model_kwargs=model_kwargs))


@pytest.mark.patch("dataloader-no-workers-when-every-item-is-a-cached")
@pytest.mark.parametrize("datasets, sd, expected", [
    ([dataset(item(), item()), dataset(item())], model(), True),
    ([dataset(item(), item(cached=False))], model(), False),
    ([dataset(item(), item(has_mask_image=True))], model(), False),
    ([dataset(item(), item(has_control_image=True))], model(), False),
    ([dataset(item(), num_frames=8)], model(), False),
    ([dataset(item(), item())], model(cached_data_in_process=False), False),
], ids=["all-cached", "one-to-encode", "a-mask-image", "a-control-image", "video", "switched-off"])
def test_workers_only_when_an_item_has_more_than_its_cache_to_read(trainer_on_path, datasets, sd, expected):
    hooks = importlib.import_module("toolkit.flux2_hooks")
    assert hooks.reads_only_caches(datasets, sd) is expected
