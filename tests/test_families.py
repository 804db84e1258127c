"""The model-family registry (flux2_contract/families.py): a family is one record. A throwaway family
added at test time, as one record plus a tiny recipe and nothing else, is validated, dry-run, handed
to ComfyUI and gets its tiny model; the shipped families' shapes pass the preset schema, a preset names
its family by `arch` alone, and each family's doc page is its record's."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import write_png
from test_comfy_klein import HIDDEN
from test_klein import fake_trainer
from test_klein_lora import linear_shapes, lora, write_safetensors
from test_klein_run import fake_safetensors
from test_run import rendered_config

from flux2_contract import families
from flux2_contract.families import FAMILIES, FLUX2_DEV, KLEIN_4B, Family, TextEncoder, TinyRecipe, family_of
from launcher import families_doc
from launcher.cli import main
from launcher.comfy import lora_check, workflow
from launcher.errors import LauncherError
from launcher.in_trainer import tiny_assets
from launcher.runs import disk_budget, tiny
from launcher.runs.flux2_shape import FLUX2_PARAMS, flux2_params_problems
from launcher.runs.inheritance import shipped_names
from launcher.runs.presets import PRESETS_DIR, load_preset, read_preset
from launcher.runs.schema_nodes import Vocabulary
from launcher.runs.vocabulary import read_vocabulary

THROWAWAY = Family(
    arch="flux2_throwaway", label="FLUX.2 throwaway", about="A family that exists only in this test.",
    transformer_file="flux2-throwaway.safetensors",
    text_encoder=TextEncoder("Qwen3", "example/throwaway-encoder", processor=False, model_type="qwen3"),
    shape={**KLEIN_4B.shape, "depth": 2, "depth_single_blocks": 3}, target="upstream-main",
    comfy=KLEIN_4B.comfy, tiny=TinyRecipe("tiny_throwaway", "klein_4b", "the tiny FLUX.2 throwaway"))


@pytest.fixture
def throwaway(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, THROWAWAY.arch, THROWAWAY)
    return THROWAWAY


def throwaway_preset(folder: Path) -> Path:
    """A user's preset of the throwaway family: the base preset with its arch, nothing more."""
    path = folder / "mine.yaml"
    path.write_text(yaml.safe_dump({"inherits": "base_512", "config": {"name": "mine", "process": [
        {"model": {"arch": THROWAWAY.arch}}]}}), encoding="utf-8")
    return path


def test_the_throwaway_family_is_validated_against_the_trainer_s_arches(throwaway, tmp_path):
    preset = throwaway_preset(tmp_path)
    with pytest.raises(LauncherError) as caught:
        load_preset(str(preset), read_vocabulary(fake_trainer(tmp_path / "old", with_klein=False)))
    assert "FLUX.2 throwaway needs the trainer target upstream-main" in str(caught.value)
    known = Vocabulary(arches={"flux2", throwaway.arch})
    model = load_preset(str(preset), known).config["config"]["process"][0]["model"]
    assert model["arch"] == throwaway.arch and model["model_kwargs"]["flux2_params"] == throwaway.shape


@pytest.fixture
def throwaway_places(throwaway, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 500.0)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    model, encoder, data = tmp_path / "model", tmp_path / "encoder", tmp_path / "data"
    fake_safetensors(model / throwaway.transformer_file, 1_000_000)
    fake_safetensors(model / "ae.safetensors", 1_000_000)
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (encoder / "tokenizer.json").write_text("{}")
    fake_safetensors(encoder / "model.safetensors", 1_000)
    data.mkdir()
    write_png(data / "a.png", 128, 96)
    (data / "a.txt").write_text("a photo of sks")
    return ["run", str(throwaway_preset(tmp_path)), "--dry-run", "--workdir", str(tmp_path / "wd"),
            "--model-dir", str(model), "--dataset", str(data), "--text-encoder", str(encoder)]


def test_a_dry_run_of_the_throwaway_family_hands_the_trainer_its_arch_and_shape(throwaway_places, capsys):
    assert main(throwaway_places) == 0
    model = rendered_config(capsys.readouterr().out)["config"]["process"][0]["model"]
    assert model["arch"] == THROWAWAY.arch and model["model_kwargs"]["flux2_params"] == THROWAWAY.shape


def test_a_dry_run_of_the_throwaway_family_checks_its_own_files(throwaway_places, tmp_path, capsys):
    transformer = tmp_path / "model" / THROWAWAY.transformer_file
    transformer.rename(tmp_path / "elsewhere.safetensors")
    assert main(throwaway_places) == 2
    err = capsys.readouterr().err
    assert f"{transformer} is missing" in err and "from the root of the FLUX.2 throwaway model repository" in err
    (tmp_path / "elsewhere.safetensors").rename(transformer)
    assert main(throwaway_places[:-2]) == 2  # no --text-encoder: the family's hub id
    assert "a local snapshot of example/throwaway-encoder" in capsys.readouterr().err


def test_comfy_hands_the_throwaway_family_s_lora_to_its_template(throwaway, tmp_path, capsys):
    workdir, data, model = tmp_path / "wd", tmp_path / "data", tmp_path / "model"
    root = workdir / "runs" / "mine"
    write_png(data / "a.png", 64, 64)
    (data / "a.txt").write_text("a photo of [trigger]", encoding="utf-8")
    base = lora_check.base_checkpoint(str(model), throwaway.arch)
    assert base == model / throwaway.transformer_file
    write_safetensors(base, {f"{module}.weight": shape for module, shape in linear_shapes(HIDDEN).items()})
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(yaml.safe_dump({"job": "extension", "config": {"name": "mine", "process": [{
        "type": "sd_trainer", "trigger_word": "sks", "training_folder": str(root),
        "network": {"type": "lora", "linear": 4}, "model": {"name_or_path": str(model), "arch": throwaway.arch},
        "datasets": [{"folder_path": str(data), "caption_ext": "txt"}]}]}}), encoding="utf-8")
    lora(root / "mine" / "mine.safetensors", HIDDEN)
    assert main(["comfy", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    api = json.loads((root / "comfyui" / "mine.api.json").read_text(encoding="utf-8"))
    ui = json.loads((root / "comfyui" / "mine.workflow.json").read_text(encoding="utf-8"))
    assert workflow.check_against_template(ui, api, workflow.load_template(throwaway.comfy.name)) == []
    assert [node["inputs"]["lora_name"] for node in api.values() if node["class_type"] == "LoraLoaderModelOnly"] \
        == ["mine.safetensors"]
    assert f"not {throwaway.transformer_file}, the checkpoint this run trained on" in out


def test_the_throwaway_family_s_tiny_model_is_built_by_its_recipe(throwaway, tmp_path, monkeypatch):
    """The launcher's side of a tiny build: the recipe's folder and builder reach the in-trainer
    module (which needs the trainer's torch, so the child here only writes the manifest it would)."""
    calls = []

    def in_trainer(python, module, *args):
        calls.append((module, *args))
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True)
        manifest = {"format": tiny_assets.ASSETS_FORMAT, "seed": 0, "name_or_path": ".", "dataset": "dataset",
                    "resolution": 128, "model_kwargs": {"text_encoder_path": "qwen3"}}
        (out / tiny_assets.MANIFEST_NAME).write_text(json.dumps(manifest), encoding="utf-8")
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(tiny, "run_module", in_trainer)
    manifest = tiny.ensure_for_arch(tmp_path / "assets", throwaway.arch, tmp_path / "trainer", Path("python"))
    assert manifest["name_or_path"] == str((tmp_path / "assets" / "tiny_throwaway").resolve())
    (call,) = calls
    assert call[0] == "tiny_assets" and call[-2:] == ("--builder", "klein_4b")
    assert throwaway.tiny.builder in tiny_assets.BUILDERS


def test_a_tiny_preset_of_a_family_without_a_tiny_model_is_refused_naming_those_that_have_one(tmp_path):
    with pytest.raises(LauncherError) as caught:
        tiny.ensure_for_arch(tmp_path, "flux2_klein_9b", tmp_path, Path("python"))
    assert "the tiny model exists for flux2 and flux2_klein_4b" in str(caught.value)


def test_an_arch_the_registry_does_not_know_is_flux2_dev_as_the_trainer_s_default():
    assert family_of(None) is family_of("something_else") is family_of(7) is FLUX2_DEV
    assert all(family_of(arch) is family for arch, family in FAMILIES.items())


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_each_family_s_shape_passes_the_preset_schema(arch):
    shape = FAMILIES[arch].shape
    assert list(FLUX2_PARAMS.check(shape, "flux2_params", Vocabulary())) == []
    preset = {"config": {"process": [{"model": {"model_kwargs": {"flux2_params": shape}}}]}}
    assert flux2_params_problems(preset) == []


def test_a_preset_s_own_shape_is_kept_and_a_tiny_preset_gets_none(tmp_path):
    own = {**KLEIN_4B.shape, "depth": 1}
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump({"inherits": "klein4b_512", "config": {"name": "own", "process": [
        {"model": {"model_kwargs": {"flux2_params": own}}}]}}), encoding="utf-8")
    assert load_preset(str(path)).config["config"]["process"][0]["model"]["model_kwargs"]["flux2_params"] == own
    tiny_klein = load_preset("tiny_klein").config["config"]["process"][0]["model"]
    assert "flux2_params" not in tiny_klein["model_kwargs"]
    dev = load_preset("base_512").config["config"]["process"][0]["model"]
    assert "flux2_params" not in (dev.get("model_kwargs") or {})


def test_each_family_has_its_page_as_the_registry_gives_it():
    assert families_doc.main(["--check"]) == 0, f"run {families_doc.COMMAND}"
    assert sorted(path.name for path in families_doc.FOLDER.glob("*.md")) == sorted(f.page for f in FAMILIES.values())


def test_a_page_of_a_family_gone_or_changed_is_stale(throwaway):
    assert families_doc.stale(families_doc.pages()) == [families_doc.FOLDER / throwaway.page]
    assert f"`{throwaway.transformer_file}`" in families_doc.page(throwaway)


def test_the_shipped_presets_name_their_family_by_arch_alone():
    """The shapes live in the registry alone, not in the preset files."""
    for name in shipped_names(PRESETS_DIR):
        for process in read_preset(name).data["config"]["process"]:
            assert "flux2_params" not in (process["model"].get("model_kwargs") or {}), name
