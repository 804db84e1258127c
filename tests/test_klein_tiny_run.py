"""The tiny FLUX.2 klein 4B trained end to end through `python -m launcher run tiny_klein` on the
target that has klein (upstream-main): its Qwen3 encoder comes from the run's text_encoder_path
(an empty Hugging Face cache and HF_HUB_OFFLINE, so the class's hub id could not serve it), the
LoRA loads on klein's own checkpoint as ComfyUI maps it, and a relaunch finds the quantized
transformer and every prompt's embedding cached and trains the same first step."""

import os
import re
from pathlib import Path

import pytest
from conftest import private_workdir
from tiny_run import run_tiny

from launcher.comfy import lora_check
from launcher.in_trainer import tiny_assets
from launcher.runs import tiny
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
    """Two launches in fresh output folders: the first builds the assets and both caches."""
    root = tmp_path_factory.mktemp("klein-runs")
    env = {key: value for key, value in os.environ.items() if not key.startswith("AITK_")}
    env["HF_HUB_CACHE"] = str(root / "empty-hub")
    first = run_tiny(klein_workdir.root, TINY_KLEIN, root / "first", env=env)
    assert first.returncode == 0, first.stdout[-6000:]
    assets = klein_workdir.assets / tiny.FOLDERS[ARCH]
    embeddings = cached_embeddings(assets)
    second = run_tiny(klein_workdir.root, TINY_KLEIN, root / "second", env=env)
    assert second.returncode == 0, second.stdout[-6000:]
    return {"first": first.stdout, "second": second.stdout, "root": root, "assets": assets,
            "embeddings": embeddings, "hub": root / "empty-hub"}


def test_the_tiny_klein_trains_its_own_qwen3_folder_offline(launches):
    log, assets = launches["first"], launches["assets"]
    assert f"text_encoder_path: {assets / tiny_assets.KLEIN_TEXT_ENCODER_DIR}" in log.replace('"', "").replace(",", "")
    assert "Loading Qwen3" in log and "Loading Mistral" not in log
    assert not list(launches["hub"].glob("models--*")), "nothing came from the hub"
    assert (launches["root"] / "first" / RUN / RUN / f"{RUN}.safetensors").is_file()


def test_the_klein_lora_fits_klein_s_checkpoint_as_comfyui_loads_it(launches):
    lora = launches["root"] / "first" / RUN / RUN / f"{RUN}.safetensors"
    base = lora_check.base_checkpoint(str(launches["assets"]), ARCH)
    assert base.name == tiny_assets.KLEIN_TRANSFORMER_FILE
    summary = lora_check.check_lora(lora, base)
    made = re.search(r"create LoRA for U-Net: (\d+) modules", launches["first"])
    assert summary.modules == int(made.group(1)) > 0 and summary.ranks == (4,)


def test_a_relaunch_finds_the_quantized_transformer_and_the_text_embeddings(launches):
    first, second = launches["first"], launches["second"]
    assert "quantized cache] wrote" in first and "Loaded quantized transformer from cache" in second
    assert "quantizing block by block" not in second
    embeddings = launches["embeddings"]
    assert embeddings and cached_embeddings(launches["assets"]) == embeddings, "no embedding was written again"
    assert FIRST_LOSS.search(first).group(1) == FIRST_LOSS.search(second).group(1)


def test_the_relaunch_still_opens_the_qwen3_encoder(launches):
    """The text phase streams only the Mistral encoder: klein's Qwen3 loads whole at every launch,
    though every embedding is cached (the dataset's per-caption cache serves them)."""
    assert "Loading Qwen3" in launches["second"]
