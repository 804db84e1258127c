"""The tiny FLUX.2 klein 4B trained end to end through `python -m launcher run tiny_klein` on the
target that has klein (upstream-main): its Qwen3 encoder comes from the run's text_encoder_path
(an empty Hugging Face cache and HF_HUB_OFFLINE, so the class's hub id could not serve it),
streamed layer by layer by the text phase, or loaded whole with `streamed_text_encoder: false`;
the LoRA loads on klein's own checkpoint as ComfyUI maps it (and through ComfyUI's own loader where
COMFYUI_DIR names a ComfyUI checkout), and a relaunch with the encoder
folder moved away finds the quantized transformer and every prompt's embedding cached and trains
the same first step."""

import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import private_workdir
from test_comfy import assert_comfyui_patches_every_weight, comfyui_checkout  # noqa: F401 (fixture)
from tiny_run import run_tiny, tiny_preset

from flux2_contract.families import FAMILIES
from launcher.comfy import lora_check
from launcher.in_trainer import tiny_assets
from launcher.runs.presets import PRESETS_DIR

pytestmark = pytest.mark.trainer

TINY_KLEIN = PRESETS_DIR / "tiny_klein.yaml"
RUN = "tiny_flux2_klein"
ARCH = "flux2_klein_4b"
FIRST_LOSS = re.compile(r"loss: ([0-9.eE+-]+)")


@pytest.fixture(scope="module")
def klein_workdir(installed_workdirs, tmp_path_factory):
    """upstream-main's checkout and venv with assets and caches of this module's own."""
    return private_workdir(installed_workdirs("upstream-main"), tmp_path_factory.mktemp("klein-workdir"))


def cached_embeddings(assets: Path) -> dict[Path, int]:
    """The dataset's per-caption text embeddings and when each was written."""
    return {path: path.stat().st_mtime_ns for path in (assets / tiny_assets.DATASET_DIR).rglob("*.safetensors")
            if "_t_e_cache" in path.parts}


@pytest.fixture(scope="module")
def launches(klein_workdir, tmp_path_factory):
    """Launches in fresh output folders: the first builds the assets and both caches, the second
    runs with the encoder folder moved away, the third loads the encoder whole."""
    root = tmp_path_factory.mktemp("klein-runs")
    env = {key: value for key, value in os.environ.items() if not key.startswith("AITK_")}
    env["HF_HUB_CACHE"] = str(root / "empty-hub")
    first = run_tiny(klein_workdir.root, TINY_KLEIN, root / "first", env=env)
    assert first.returncode == 0, first.stdout[-6000:]
    assets = klein_workdir.assets / FAMILIES[ARCH].tiny.folder
    embeddings = cached_embeddings(assets)
    encoder, away = assets / tiny_assets.KLEIN_TEXT_ENCODER_DIR, root / "qwen3-moved-away"
    shutil.move(encoder, away)
    try:
        second = run_tiny(klein_workdir.root, TINY_KLEIN, root / "second", env=env)
    finally:
        shutil.move(away, encoder)
    assert second.returncode == 0, second.stdout[-6000:]
    embeddings_again = cached_embeddings(assets)
    whole = tiny_preset(root / "whole.yaml", name=RUN, model={"arch": ARCH, "model_kwargs": {"streamed_text_encoder": False}})
    third = run_tiny(klein_workdir.root, whole, root / "whole", env=env)
    assert third.returncode == 0, third.stdout[-6000:]
    return {"first": first.stdout, "second": second.stdout, "whole": third.stdout, "root": root, "assets": assets,
            "embeddings": embeddings, "embeddings_again": embeddings_again, "hub": root / "empty-hub"}


def test_the_text_phase_streams_the_tiny_klein_s_own_qwen3_folder_offline(launches):
    log, assets = launches["first"], launches["assets"]
    assert f"text_encoder_path: {assets / tiny_assets.KLEIN_TEXT_ENCODER_DIR}" in log.replace('"', "").replace(",", "")
    assert re.search(r"text phase: \d+ prompt\(s\), 0 cached", log)
    assert log.index("text phase: done") < log.index("Loading transformer")
    assert "Loading Qwen3" not in log and "Loading Mistral" not in log
    assert not list(launches["hub"].glob("models--*")), "nothing came from the hub"
    assert (launches["root"] / "first" / RUN / RUN / f"{RUN}.safetensors").is_file()


def test_without_the_text_phase_the_whole_qwen3_loads_from_text_encoder_path(launches):
    log = launches["whole"]
    assert "Loading Qwen3" in log and "Quantizing Qwen3" in log and "text phase: done" not in log
    assert not list(launches["hub"].glob("models--*")), "nothing came from the hub"


def test_the_klein_lora_fits_klein_s_checkpoint_as_comfyui_loads_it(launches):
    lora = launches["root"] / "first" / RUN / RUN / f"{RUN}.safetensors"
    base = lora_check.base_checkpoint(str(launches["assets"]), ARCH)
    assert base.name == tiny_assets.KLEIN_TRANSFORMER_FILE
    summary = lora_check.check_lora(lora, base)
    made = re.search(r"create LoRA for U-Net: (\d+) modules", launches["first"])
    assert summary.modules == int(made.group(1)) > 0 and summary.ranks == (4,)


def test_comfyui_s_own_loader_patches_every_weight_of_the_tiny_klein_lora(comfyui_checkout, launches,  # noqa: F811
                                                                         klein_workdir):
    """ComfyUI's FLUX.2 model and LoRA loader, built from klein's own checkpoint (no guidance
    embedding): every key matched, every weight patched to base + B @ A."""
    assert_comfyui_patches_every_weight(klein_workdir, comfyui_checkout,
                                        lora_check.base_checkpoint(str(launches["assets"]), ARCH),
                                        launches["root"] / "first" / RUN / RUN / f"{RUN}.safetensors")


def test_a_relaunch_without_the_encoder_folder_finds_both_caches_and_trains_the_same(launches):
    first, second = launches["first"], launches["second"]
    assert "quantized cache] wrote" in first and "Loaded quantized transformer from cache" in second
    assert "quantizing block by block" not in second
    assert "every prompt is cached; the text encoder is not opened" in second and "Loading Qwen3" not in second
    assert FIRST_LOSS.search(first).group(1) == FIRST_LOSS.search(second).group(1)
    assert launches["embeddings"] and launches["embeddings_again"] == launches["embeddings"], \
        "no per-caption embedding was written again"
