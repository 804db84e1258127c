"""`comfy`: the workflow built from ComfyUI's template, the LoRA check, placement, and every bad input.

The fast tests build run folders by hand (a config, a base checkpoint and a LoRA written with the
standard library); the end-to-end test uses the test run's shared tiny run, and the optional test loads
that LoRA with ComfyUI's own code when COMFYUI_DIR names a ComfyUI checkout.
"""

import copy
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, write_png
from test_run import places  # noqa: F401 (fixture)

from launcher.cli import main
from launcher.envs.trainer_python import child_env
from launcher.envs.workdir import venv_python
from launcher.in_trainer.tiny_assets import FLUX2_PARAMS
from launcher.comfy import workflow
from launcher.runs import disk_budget, prompts, validate
from launcher.runs.presets import PRESETS_DIR, read_preset

NAME = "sks_flux2"
HIDDEN, CONTEXT = 64, 192
BASE = {  # a FLUX.2-shaped transformer in miniature: Linears (2-D .weight) and norm scales
    "img_in.weight": [HIDDEN, 128],
    "txt_in.weight": [HIDDEN, CONTEXT],
    "double_blocks.0.img_attn.qkv.weight": [3 * HIDDEN, HIDDEN],
    "double_blocks.0.img_attn.norm.query_norm.scale": [32],
    "double_blocks.0.img_attn.proj.weight": [HIDDEN, HIDDEN],
    "single_blocks.0.linear1.weight": [9 * HIDDEN, HIDDEN],
    "single_blocks.0.linear2.weight": [HIDDEN, 4 * HIDDEN],
}
LORA_MODULES = ["double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj", "single_blocks.0.linear2"]
CAPTION = "a photo of [trigger] on a white background"
COMFYUI_CHECK = REPO_ROOT / "tests" / "comfyui_load_lora.py"
MISSING_MODULE = 3  # the exit code of COMFYUI_CHECK when ComfyUI cannot be imported


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> Path:
    """A valid safetensors file of zero-filled bf16 tensors."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))
    return path


def lora_shapes(rank: int = 4, modules=LORA_MODULES) -> dict[str, list[int]]:
    shapes = {}
    for module in modules:
        out_features, in_features = BASE[f"{module}.weight"]
        shapes[f"diffusion_model.{module}.lora_A.weight"] = [rank, in_features]
        shapes[f"diffusion_model.{module}.lora_B.weight"] = [out_features, rank]
    return shapes


def lokr_shapes() -> dict[str, list[int]]:
    """What the trainer saves for `network: {type: lokr}`: LyCORIS names, Kronecker factors."""
    shapes = {}
    for module in LORA_MODULES:
        stem = "lycoris_" + module.replace(".", "_")
        shapes.update({f"{stem}.lokr_w1": [4, 4], f"{stem}.lokr_w2": [16, 16], f"{stem}.alpha": []})
    return shapes


@pytest.fixture
def fake_run(tmp_path):
    """A workdir with one finished run: config, base checkpoint, captioned dataset, a LoRA."""
    workdir = tmp_path / "wd"
    root = workdir / "runs" / NAME
    data = tmp_path / "data"
    data.mkdir()
    (data / "b.txt").write_text("a second caption", encoding="utf-8")
    (data / "a.txt").write_text(CAPTION, encoding="utf-8")
    for stem in ("a", "b"):  # a caption is the one beside its image, as the trainer pairs them
        write_png(data / f"{stem}.png", 64, 64)
    write_safetensors(tmp_path / "model" / "flux2-dev.safetensors", BASE)
    config = {"job": "extension", "config": {"name": NAME, "process": [{
        "type": "sd_trainer", "trigger_word": "sks", "training_folder": str(root),
        "network": {"type": "lora", "linear": 4}, "model": {"name_or_path": str(tmp_path / "model"), "arch": "flux2"},
        "datasets": [{"folder_path": str(data), "caption_ext": "txt"}]}]}}
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    write_safetensors(root / NAME / f"{NAME}.safetensors", lora_shapes())
    return workdir, root


@pytest.fixture
def comfy_dir(tmp_path):
    folder = tmp_path / "ComfyUI"
    (folder / "models" / "loras").mkdir(parents=True)
    (folder / "main.py").write_text("")
    return folder


def launch(workdir: Path, *args: str) -> int:
    return main(["comfy", "--workdir", str(workdir), *args])


def test_workflow_is_the_template_with_the_lora_prompt_and_seed():
    template = workflow.load_template()
    built = workflow.build(template, "mine.safetensors", "a photo of sks", "flux2-24gb/mine")
    assert workflow.check_against_template(built.ui, built.api, template) == []
    api = built.api
    (guider,) = [node for node in api.values() if node["class_type"] == "BasicGuider"]
    lora = api[guider["inputs"]["model"][0]]
    assert lora["class_type"] == "LoraLoaderModelOnly" and lora["inputs"]["lora_name"] == "mine.safetensors"
    assert api[lora["inputs"]["model"][0]]["class_type"] == "UNETLoader"
    (text,) = [node for node in api.values() if node["class_type"] == "CLIPTextEncode"]
    (noise,) = [node for node in api.values() if node["class_type"] == "RandomNoise"]
    assert text["inputs"]["text"] == "a photo of sks" and noise["inputs"]["noise_seed"] == workflow.SEED
    loras = [node["inputs"]["lora_name"] for node in api.values() if node["class_type"] == "LoraLoaderModelOnly"]
    assert loras == ["mine.safetensors"], "the template's turbo branch is off, so its LoRA must not be required"
    assert {model["directory"] for model in built.models} == {"diffusion_models", "text_encoders", "vae"}
    template_types = {node["type"] for graph in workflow.graphs(template) for node in graph["nodes"]}
    assert {node["type"] for graph in workflow.graphs(built.ui) for node in graph["nodes"]} == template_types


def test_ui_workflow_keeps_the_template_and_routes_the_model_through_the_lora():
    template = workflow.load_template()
    ui = workflow.build(template, "mine.safetensors", "p", "x").ui
    graph, loader = workflow.only_node(ui, "UNETLoader")
    links = workflow.links_of(graph)
    (first,) = loader["outputs"][0]["links"]
    ours = next(node for node in graph["nodes"] if node["id"] == links[first]["target_id"])
    assert ours["type"] == "LoraLoaderModelOnly" and ours["widgets_values"] == ["mine.safetensors", 1.0]
    template_graph, template_loader = workflow.only_node(template, "UNETLoader")
    template_links = workflow.links_of(template_graph)
    assert sorted((links[i]["target_id"], links[i]["target_slot"]) for i in ours["outputs"][0]["links"]) == sorted(
        (template_links[i]["target_id"], template_links[i]["target_slot"]) for i in template_loader["outputs"][0]["links"]
    ), "the LoRA feeds exactly what the template's loader fed"
    assert workflow.only_node(ui, "RandomNoise")[1]["widgets_values"] == [workflow.SEED, "fixed"]
    assert len(ui["nodes"]) == len(template["nodes"]) and ui["links"] and isinstance(ui["links"][0], list)


@pytest.mark.parametrize("damage, expected", [
    (lambda ui, api: api[next(iter(api))]["inputs"].update(bogus=1), "'bogus' is not a widget"),
    (lambda ui, api: api.update(x={"class_type": "KSampler", "inputs": {}}), "not a node type of the template"),
    (lambda ui, api: next(n for n in api.values() if n["class_type"] == "BasicGuider")["inputs"].pop("model"),
     "'model' is connected in the template but not here"),
    (lambda ui, api: workflow.only_node(ui, "UNETLoader")[1]["outputs"][0]["links"].append(99999), "does not start there"),
    (lambda ui, api: workflow.only_node(ui, "VAELoader")[1]["widgets_values"].append(1), "widget values"),
])
def test_the_template_check_catches_a_broken_workflow(damage, expected):
    template = workflow.load_template()
    built = workflow.build(template, "mine.safetensors", "p", "x")
    ui, api = copy.deepcopy(built.ui), copy.deepcopy(built.api)
    damage(ui, api)
    assert any(expected in problem for problem in workflow.check_against_template(ui, api, template))


def test_comfy_writes_workflows_checks_and_places_the_lora(fake_run, comfy_dir, capsys):
    workdir, root = fake_run
    assert launch(workdir, "--comfy-dir", str(comfy_dir)) == 0
    out, err = capsys.readouterr()
    assert "3 Linear modules, 6 tensors, rank 4" in out
    api = json.loads((root / "comfyui" / f"{NAME}.api.json").read_text(encoding="utf-8"))
    ui = json.loads((root / "comfyui" / f"{NAME}.workflow.json").read_text(encoding="utf-8"))
    assert workflow.check_against_template(ui, api, workflow.load_template()) == []
    prompts = [node["inputs"]["text"] for node in api.values() if node["class_type"] == "CLIPTextEncode"]
    assert prompts == ["a photo of sks on a white background"], "first caption, trigger word filled in"
    placed = comfy_dir / "models" / "loras" / f"{NAME}.safetensors"
    assert placed.read_bytes() == (root / NAME / f"{NAME}.safetensors").read_bytes() and not placed.is_symlink()
    assert err.count("lacks models/") == 4 and "Hugging Face Comfy-Org/flux2-dev" in err
    assert launch(workdir, "--comfy-dir", str(comfy_dir)) == 0, "the same file again is fine"


@pytest.mark.parametrize("caption, trigger, prompt", [
    ("a photo of [trigger] on grass", "sks", "a photo of sks on grass"),
    ("a photo of a dog", "sks", "sks a photo of a dog"),
    ("a photo of [trigger] dog", None, "a photo of dog"),
])
def test_caption_prompt_puts_the_trigger_word_in_as_the_trainer_does(caption, trigger, prompt):
    assert prompts.with_trigger(caption, trigger) == prompt


def test_models_found_and_the_prompt_flag(fake_run, comfy_dir, capsys):
    workdir, root = fake_run
    built = workflow.build(workflow.load_template(), "x", "p", "x")
    (comfy_dir / "comfyui_version.py").write_text('__version__ = "0.19.0"\n')
    for model in built.models + built.canvas_models:
        folder = {"diffusion_models": "unet"}.get(model["directory"], model["directory"])  # the older name counts
        (comfy_dir / "models" / folder).mkdir(parents=True, exist_ok=True)
        (comfy_dir / "models" / folder / model["name"]).write_bytes(b"")
    assert launch(workdir, NAME, "--comfy-dir", str(comfy_dir), "--prompt", "my own prompt") == 0
    out, err = capsys.readouterr()
    assert "lacks" not in err and "ComfyUI" not in err and out.count("  found ") == 4
    assert "my own prompt" in (root / "comfyui" / f"{NAME}.api.json").read_text(encoding="utf-8")


def test_link_places_a_link(fake_run, comfy_dir, capsys):
    workdir, root = fake_run
    assert launch(workdir, "--comfy-dir", str(comfy_dir), "--link") == 0
    placed = comfy_dir / "models" / "loras" / f"{NAME}.safetensors"
    lora = root / NAME / f"{NAME}.safetensors"
    if os.name == "nt" and not placed.is_symlink():  # Windows grants links by default to admins only
        assert "copying instead" in capsys.readouterr().err and placed.read_bytes() == lora.read_bytes()
        return
    assert placed.is_symlink() and placed.resolve() == lora.resolve()


def test_checkpoint_by_step(fake_run, capsys):
    workdir, root = fake_run
    write_safetensors(root / NAME / f"{NAME}_000000500.safetensors", lora_shapes(rank=8))
    assert launch(workdir, "--checkpoint", "500") == 0
    assert "rank 8" in capsys.readouterr().out and (root / "comfyui" / f"{NAME}_000000500.api.json").is_file()
    assert launch(workdir, "--checkpoint", "7") == 2
    assert "no LoRA saved at step '7'" in capsys.readouterr().err


def test_no_run_yet(tmp_path, capsys):
    assert launch(tmp_path / "wd") == 2
    assert "no runs in" in capsys.readouterr().err


def test_run_without_a_checkpoint(fake_run, capsys):
    workdir, root = fake_run
    (root / NAME / f"{NAME}.safetensors").unlink()
    assert launch(workdir) == 2
    assert "has no saved LoRA yet" in capsys.readouterr().err and not (root / "comfyui").exists()


@pytest.mark.parametrize("shapes, message", [
    (BASE, "is not a LoRA ComfyUI can load"),
    (lokr_shapes(), "is a LoKr network"),
    ({**lora_shapes(), "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": [HIDDEN, 4]}, "do not fit"),
    ({**lora_shapes(), "diffusion_model.final.lora_A.weight": [4, 8], "diffusion_model.final.lora_B.weight": [8, 4]},
     "final: not a Linear of the transformer"),
])
def test_a_checkpoint_comfyui_cannot_load_is_refused(fake_run, comfy_dir, capsys, shapes, message):
    workdir, root = fake_run
    write_safetensors(root / NAME / f"{NAME}.safetensors", shapes)
    assert launch(workdir, "--comfy-dir", str(comfy_dir)) == 2
    err = capsys.readouterr().err
    assert message in err and f"{NAME}.safetensors" in err
    if "LoKr" in message:
        assert "network: {type: lora}" in err and "load nothing" in err
    assert not (root / "comfyui").exists() and not any((comfy_dir / "models" / "loras").iterdir())


def test_not_a_comfyui_folder(fake_run, tmp_path, capsys):
    workdir, root = fake_run
    portable = tmp_path / "ComfyUI_windows_portable"
    (portable / "ComfyUI" / "models").mkdir(parents=True)
    (portable / "ComfyUI" / "main.py").write_text("")
    assert launch(workdir, "--comfy-dir", str(portable)) == 2
    err = capsys.readouterr().err
    assert "is not a ComfyUI folder" in err and f"Did you mean {portable / 'ComfyUI'}?" in err
    assert not (root / "comfyui").exists()


def test_a_different_file_in_loras_is_replaced_only_with_force(fake_run, comfy_dir, capsys):
    workdir, root = fake_run
    existing = comfy_dir / "models" / "loras" / f"{NAME}.safetensors"
    existing.write_bytes(b"someone else's LoRA")
    assert launch(workdir, "--comfy-dir", str(comfy_dir)) == 2
    assert "already exists with other content; pass --force" in capsys.readouterr().err
    assert existing.read_bytes() == b"someone else's LoRA" and not (root / "comfyui").exists()
    assert launch(workdir, "--comfy-dir", str(comfy_dir), "--force") == 0
    assert existing.read_bytes() == (root / NAME / f"{NAME}.safetensors").read_bytes()


def test_dry_run_warns_about_a_network_comfyui_cannot_load(places, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 100.0)  # whatever this machine has
    preset = read_preset("7900xtx_512").data
    preset["config"]["process"][0]["network"] = {"type": "lokr", "lokr_full_rank": True}
    preset["config"]["process"][0]["model"]["quantize"] = False  # on the 4-bit base `run` refuses LoKr outright
    path = tmp_path / "lokr.yaml"
    path.write_text(yaml.safe_dump(preset))
    assert main(["run", str(path), "--dry-run", "--workdir", str(places["workdir"]), "--model-dir", str(places["model"]),
                 "--text-encoder", str(places["encoder"]), "--dataset", str(places["data"])]) == 0
    err = capsys.readouterr().err
    assert "network.type is 'lokr'" in err and "network: {type: lora}" in err
    assert validate.network_warnings(yaml.safe_load((PRESETS_DIR / "tiny.yaml").read_text())) == []


@pytest.fixture(scope="module")
def tiny_comfy(trained_tiny_run, tmp_path_factory):
    """`comfy` on the shared tiny run, into a fake ComfyUI folder."""
    run, workdir = trained_tiny_run
    folder = tmp_path_factory.mktemp("comfy") / "ComfyUI"
    (folder / "models").mkdir(parents=True)
    (folder / "custom_nodes").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "launcher", "comfy", str(run.root), "--workdir", str(workdir.root),
         "--comfy-dir", str(folder)], cwd=REPO_ROOT, capture_output=True, text=True)
    return run, workdir, folder, result


@pytest.mark.trainer
def test_comfy_on_the_tiny_run(tiny_comfy):
    run, _, folder, result = tiny_comfy
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(run.config.read_text())
    base = Path(config["config"]["process"][0]["model"]["name_or_path"]) / "flux2-dev.safetensors"
    assert base.is_file()
    api = json.loads((run.comfyui / "tiny_flux2.api.json").read_text())
    ui = json.loads((run.comfyui / "tiny_flux2.workflow.json").read_text())
    assert workflow.check_against_template(ui, api, workflow.load_template()) == []
    assert (folder / "models" / "loras" / "tiny_flux2.safetensors").is_file()
    dataset = Path(config["config"]["process"][0]["datasets"][0]["folder_path"])
    first_caption = min(dataset.glob("*.txt")).read_text().strip()
    assert f"prompt: {first_caption}" in result.stdout
    assert "LoRA check: tiny_flux2.safetensors:" in result.stdout and "every tensor" in result.stdout


@pytest.mark.trainer
def test_a_lokr_network_from_the_tiny_run_is_refused(tiny_comfy, tmp_path, capsys):
    run, workdir, folder, _ = tiny_comfy
    copy_root = tmp_path / "runs" / "lokr_copy"
    (copy_root / run.name).mkdir(parents=True)
    (copy_root / "config.yaml").write_bytes(run.config.read_bytes())
    stems = ["lycoris_double_blocks_0_img_attn_qkv", "lycoris_single_blocks_0_linear1"]
    write_safetensors(copy_root / run.name / f"{run.name}.safetensors",
                      {f"{stem}.{part}": [8, 8] for stem in stems for part in ("lokr_w1", "lokr_w2")})
    assert main(["comfy", str(copy_root), "--workdir", str(workdir.root), "--comfy-dir", str(folder), "--force"]) == 2
    err = capsys.readouterr().err
    assert "is a LoKr network (4 of 4 tensors" in err and "network: {type: lora}" in err
    assert not (copy_root / "comfyui").exists()
    assert (folder / "models" / "loras" / "tiny_flux2.safetensors").read_bytes() == (
        run.job_dir / "tiny_flux2.safetensors").read_bytes(), "the LoRA placed before is untouched"


@pytest.fixture(scope="session")
def comfyui_checkout() -> str:
    """Asked for first, so the skip comes before the tiny run is trained."""
    checkout = os.environ.get("COMFYUI_DIR")
    if not checkout:
        pytest.skip("set COMFYUI_DIR to a ComfyUI source checkout to check with ComfyUI's own code")
    return checkout


def in_comfyui(workdir, checkout: str, *args: str) -> dict:
    """tests/comfyui_load_lora.py with the trainer venv's torch and the ComfyUI checkout; its report."""
    check = subprocess.run([str(venv_python(workdir.venv)), str(COMFYUI_CHECK), *args, "--comfyui", checkout],
                           cwd=REPO_ROOT, env=child_env({"CUDA_VISIBLE_DEVICES": ""}), capture_output=True, text=True)
    if check.returncode == MISSING_MODULE:
        pytest.skip(f"ComfyUI's nodes need modules the trainer venv lacks ({check.stdout.strip()}): "
                    "pip install ComfyUI's requirements.txt there")
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
    return json.loads(check.stdout.splitlines()[-1])


@pytest.mark.trainer
def test_comfyui_loads_the_tiny_lora(comfyui_checkout, tiny_comfy):
    """ComfyUI's own loader on the tiny LoRA: every key matched, every weight patched to base + B @ A."""
    run, workdir, _, result = tiny_comfy
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(run.config.read_text())
    base = Path(config["config"]["process"][0]["model"]["name_or_path"]) / "flux2-dev.safetensors"
    assert_comfyui_patches_every_weight(workdir, comfyui_checkout, base, run.job_dir / "tiny_flux2.safetensors")


def assert_comfyui_patches_every_weight(workdir, checkout: str, base: Path, lora: Path) -> None:
    """tests/comfyui_load_lora.py's `lora` check of a tiny run's LoRA on its base checkpoint: every
    key matched, every weight patched to base + B @ A."""
    report = in_comfyui(workdir, checkout, "lora", "--base", str(base), "--lora", str(lora),
                        "--params", json.dumps(FLUX2_PARAMS))
    assert report["unmatched"] == [] and report["tensors"] == 2 * report["patched"] > 0, report
    assert report["max_delta"] > 0, "the LoRA changed no weight: lora_B is still zero?"
    assert report["max_abs_error"] <= 1e-3 * report["max_delta"], report


@pytest.mark.trainer
def test_comfyui_accepts_the_api_workflow(comfyui_checkout, tiny_comfy):
    """What POST /prompt runs (execution.validate_prompt) accepts the API workflow once its files exist."""
    run, workdir, _, result = tiny_comfy
    assert result.returncode == 0, result.stdout + result.stderr
    built = workflow.build(workflow.load_template(), "tiny_flux2.safetensors", "p", "x")
    files = ["loras/tiny_flux2.safetensors", *(f"{m['directory']}/{m['name']}" for m in built.models)]
    api = str(run.comfyui / "tiny_flux2.api.json")
    report = in_comfyui(workdir, comfyui_checkout, "api", "--api", api, *(f"--file={f}" for f in files))
    assert report["valid"] is True and report["outputs"] == ["9"], report
    refused = in_comfyui(workdir, comfyui_checkout, "api", "--api", api, *(f"--file={f}" for f in files[1:]))
    assert refused["valid"] is False and "tiny_flux2.safetensors" in json.dumps(refused["node_errors"])


def test_comfy_replaces_its_own_workflow_and_keeps_one_saved_over_it(fake_run, capsys):
    workdir, root = fake_run
    assert launch(workdir) == 0
    assert launch(workdir, "--prompt", "another prompt") == 0  # its own from before: replaced
    (ui,) = (root / "comfyui").glob("*.workflow.json")
    assert "another prompt" in ui.read_text(encoding="utf-8")
    ui.write_text('{"edited": "in ComfyUI, saved back"}', encoding="utf-8")
    capsys.readouterr()
    assert launch(workdir) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "`comfy` did not write it" in err and "pass --force" in err, err
    assert json.loads(ui.read_text(encoding="utf-8")) == {"edited": "in ComfyUI, saved back"}
    assert launch(workdir, "--force") == 0 and "edited" not in ui.read_text(encoding="utf-8")
