"""`comfy` for a FLUX.2 klein run: the workflow comes from ComfyUI's klein template of the run's size,
its base-model subgraph only, with the run's LoRA between the model loader and what the loader fed.

Fast: the templates come from the installed package and the runs are written by hand (a config, a
klein-named base checkpoint and a LoRA of matching shapes); the optional test validates the API
workflows with ComfyUI's own code when COMFYUI_DIR names a ComfyUI checkout.
"""

import json
from pathlib import Path

import pytest
import yaml
from conftest import write_png
from test_comfy import comfyui_checkout, in_comfyui  # noqa: F401 (fixture)
from test_klein_lora import linear_shapes, lora, write_safetensors

from flux2_contract.families import FLUX2_DEV, KLEIN_4B, KLEIN_9B
from launcher.cli import main
from launcher.comfy import lora_check, templates, workflow

KLEIN = {family.arch: family for family in (KLEIN_4B, KLEIN_9B)}
PROMPT = "a photo of sks on a white background"
UNET = {"flux2_klein_4b": "flux-2-klein-base-4b.safetensors", "flux2_klein_9b": "flux-2-klein-base-9b-fp8.safetensors"}
"""The base model file each klein template's kept subgraph loads."""
DISTILLED = {"flux-2-klein-4b.safetensors", "flux-2-klein-9b-fp8.safetensors"}
HIDDEN = 64


def klein_build(arch: str, lora_name: str = "mine.safetensors") -> tuple[dict, workflow.Workflow]:
    chosen = templates.template_for(arch)
    template = workflow.load_template(chosen.name)
    return template, workflow.build(template, lora_name, PROMPT, "flux2-24gb/mine", chosen.subgraph)


def api_nodes(api: dict, class_type: str) -> list[tuple[str, dict]]:
    return [(key, node) for key, node in api.items() if node["class_type"] == class_type]


def links(api: dict) -> list[tuple[str, str, list]]:
    return [(key, name, value) for key, node in api.items() for name, value in node["inputs"].items()
            if isinstance(value, list)]


def test_the_arch_picks_the_template():
    for arch in ("flux2", None, 7):
        assert templates.template_for(arch) == FLUX2_DEV.comfy and FLUX2_DEV.comfy.name == workflow.TEMPLATE
        assert FLUX2_DEV.comfy.subgraph is None
    names = {templates.template_for(arch).name for arch in KLEIN}
    assert len(names) == len(KLEIN) and workflow.TEMPLATE not in names


@pytest.mark.parametrize("arch", sorted(KLEIN))
def test_klein_api_workflow_loads_the_base_model_through_the_lora(arch):
    template, built = klein_build(arch)
    assert workflow.check_against_template(built.ui, built.api, template) == []
    api = built.api
    (_, guider), = api_nodes(api, "CFGGuider")
    lora_node = api[guider["inputs"]["model"][0]]
    assert lora_node["class_type"] == "LoraLoaderModelOnly"
    assert lora_node["inputs"]["lora_name"] == "mine.safetensors" and lora_node["inputs"]["strength_model"] == 1.0
    (loader_key, loader), = api_nodes(api, "UNETLoader")
    assert lora_node["inputs"]["model"] == [loader_key, 0] and loader["inputs"]["unet_name"] == UNET[arch]
    assert [key for key, _, value in links(api) if value == [loader_key, 0]] == [guider["inputs"]["model"][0]], \
        "the loader feeds only the LoRA"
    for key, name, value in links(api):
        assert value[0] in api and isinstance(value[1], int), f"{key}.{name} -> {value} is not resolved"
    assert not api_nodes(api, "ConditioningZeroOut"), "a node of the distilled branch"
    assert not DISTILLED & {value for node in api.values() for value in node["inputs"].values() if isinstance(value, str)}
    assert [node["inputs"]["filename_prefix"] for _, node in api_nodes(api, "SaveImage")] == ["flux2-24gb/mine"]
    (_, noise), = api_nodes(api, "RandomNoise")
    assert noise["inputs"] == {"noise_seed": workflow.SEED}
    assert {model["directory"] for model in built.models} == {"diffusion_models", "text_encoders", "vae"}
    assert UNET[arch] in {model["name"] for model in built.models} and built.canvas_models == []


@pytest.mark.parametrize("arch", sorted(KLEIN))
def test_every_api_widget_is_named_as_comfyui_names_it(arch):
    _, built = klein_build(arch)
    for key, node in built.api.items():
        names = [name for name in workflow.WIDGETS[node["class_type"]] if name != workflow.CONTROL]
        widgets = {name for name, value in node["inputs"].items() if not isinstance(value, list)}
        assert widgets <= set(names), f"{key}: {widgets - set(names)} are not widgets of {node['class_type']}"
        assert set(names) <= set(node["inputs"]), f"{key}: {set(names) - set(node['inputs'])} have no value"


@pytest.mark.parametrize("arch", sorted(KLEIN))
def test_the_prompt_reaches_the_positive_encoder(arch):
    _, built = klein_build(arch)
    (_, positive), = [(k, n) for k, n in api_nodes(built.api, "CLIPTextEncode") if "Positive" in n["_meta"]["title"]]
    text = positive["inputs"]["text"]
    assert (built.api[text[0]]["inputs"]["value"] if isinstance(text, list) else text) == PROMPT
    (_, negative), = [(k, n) for k, n in api_nodes(built.api, "CLIPTextEncode") if "Negative" in n["_meta"]["title"]]
    assert negative["inputs"]["text"] == ""


@pytest.mark.parametrize("arch", sorted(KLEIN))
def test_klein_ui_workflow_keeps_the_base_subgraph_with_the_lora(arch):
    template, built = klein_build(arch)
    ui = built.ui
    (subgraph,) = workflow.graphs(ui)[1:]
    assert subgraph["name"] == templates.template_for(arch).subgraph
    graph, loader = workflow.only_node(ui, "UNETLoader")
    assert graph is subgraph and loader["widgets_values"][0] == UNET[arch]
    graph_links = workflow.links_of(graph)
    (first,) = loader["outputs"][0]["links"]
    ours = next(node for node in graph["nodes"] if node["id"] == graph_links[first]["target_id"])
    assert ours["type"] == "LoraLoaderModelOnly" and ours["widgets_values"] == ["mine.safetensors", 1.0]
    template_graph, template_loader = next((g, n) for g in workflow.graphs(template)[1:] for n in g["nodes"]
                                           if g["name"] == subgraph["name"] and n["type"] == "UNETLoader")
    template_links = workflow.links_of(template_graph)
    assert sorted((graph_links[i]["target_id"], graph_links[i]["target_slot"]) for i in ours["outputs"][0]["links"]) == \
        sorted((template_links[i]["target_id"], template_links[i]["target_slot"])
               for i in template_loader["outputs"][0]["links"]), "the LoRA feeds exactly what the loader fed"
    instances = [node for node in ui["nodes"] if node["type"] in {g["id"] for g in workflow.graphs(template)[1:]}]
    assert [node["type"] for node in instances] == [subgraph["id"]], "no instance of the distilled subgraph"
    top_links = workflow.links_of(ui)
    for node in ui["nodes"]:
        for socket in node.get("inputs", []):
            assert socket.get("link") is None or socket["link"] in top_links, f"node {node['id']} names a cut link"
        for output in node.get("outputs", []):
            assert set(output.get("links") or []) <= set(top_links), f"node {node['id']} names a cut link"
    assert workflow.only_node(ui, "RandomNoise")[1]["widgets_values"] == [workflow.SEED, "fixed"]
    assert workflow.only_node(ui, "SaveImage")[1]["widgets_values"] == ["flux2-24gb/mine"]


def test_the_9b_subgraph_node_carries_the_prompt_and_seed_it_gives_its_inputs():
    """The 9B template keeps the values of its subgraph's inputs on the subgraph node, and ComfyUI uses those."""
    _, built = klein_build("flux2_klein_9b")
    (instance,) = [node for node in built.ui["nodes"] if node["type"] == workflow.graphs(built.ui)[1]["id"]]
    values = dict(zip((socket["name"] for socket in workflow.graphs(built.ui)[1]["inputs"]), instance["widgets_values"]))
    assert values["text"] == PROMPT and values["noise_seed"] == workflow.SEED and values["unet_name"] == UNET["flux2_klein_9b"]


def test_the_4b_prompt_node_feeds_only_the_base_subgraph():
    _, built = klein_build("flux2_klein_4b")
    _, primitive = workflow.only_node(built.ui, "PrimitiveStringMultiline")
    assert primitive["widgets_values"] == [PROMPT]
    (link,) = primitive["outputs"][0]["links"]
    target = workflow.links_of(built.ui)[link]["target_id"]
    assert next(node for node in built.ui["nodes"] if node["id"] == target)["type"] == workflow.graphs(built.ui)[1]["id"]


def test_an_unknown_subgraph_name_is_refused():
    with pytest.raises(workflow.LauncherError, match="no subgraph named 'Text to Image'"):
        workflow.build(workflow.load_template(KLEIN_4B.comfy.name), "x", "p", "x",
                       "Text to Image")


def klein_run(tmp_path: Path, arch: str) -> tuple[Path, Path]:
    """A workdir with one finished klein run: config, a klein-named base checkpoint, a captioned image, a LoRA."""
    workdir, data = tmp_path / "wd", tmp_path / "data"
    root = workdir / "runs" / "sks_klein"
    write_png(data / "a.png", 64, 64)
    (data / "a.txt").write_text("a photo of [trigger] on a white background", encoding="utf-8")
    base = lora_check.base_checkpoint(str(tmp_path / "model"), arch)
    write_safetensors(base, {f"{module}.weight": shape for module, shape in linear_shapes(HIDDEN).items()})
    config = {"job": "extension", "config": {"name": "sks_klein", "process": [{
        "type": "sd_trainer", "trigger_word": "sks", "training_folder": str(root),
        "network": {"type": "lora", "linear": 4}, "model": {"name_or_path": str(tmp_path / "model"), "arch": arch},
        "datasets": [{"folder_path": str(data), "caption_ext": "txt"}]}]}}
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    lora(root / "sks_klein" / "sks_klein.safetensors", HIDDEN)
    return workdir, root


@pytest.mark.parametrize("arch", sorted(KLEIN))
def test_comfy_on_a_klein_run_writes_the_klein_workflow(tmp_path, capsys, arch):
    workdir, root = klein_run(tmp_path, arch)
    assert main(["comfy", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    api = json.loads((root / "comfyui" / "sks_klein.api.json").read_text(encoding="utf-8"))
    ui = json.loads((root / "comfyui" / "sks_klein.workflow.json").read_text(encoding="utf-8"))
    assert workflow.check_against_template(ui, api, workflow.load_template(templates.template_for(arch).name)) == []
    assert [node["inputs"]["unet_name"] for node in api.values() if node["class_type"] == "UNETLoader"] == [UNET[arch]]
    assert "mistral" not in json.dumps(api).lower() and "CFGGuider" in json.dumps(api)
    assert f"models/diffusion_models/{UNET[arch]}" in out and "models/text_encoders/qwen_3_" in out
    trained_on = KLEIN[arch].transformer_file
    if trained_on == UNET[arch]:  # 4B: the template names the file the run trained on
        assert f"the file name of this run's base checkpoint {tmp_path / 'model' / trained_on}" in out
    else:  # 9B: the template names an fp8 build
        assert f"an fp8 build of the model), not {trained_on}, the checkpoint this run trained on" in out


def test_a_9b_base_already_in_comfyui_is_named(tmp_path, capsys):
    workdir, _ = klein_run(tmp_path, "flux2_klein_9b")
    comfy_dir = tmp_path / "ComfyUI"
    (comfy_dir / "custom_nodes").mkdir(parents=True)
    placed = write_safetensors(comfy_dir / "models" / "unet" / KLEIN["flux2_klein_9b"].transformer_file, {})
    assert main(["comfy", "--workdir", str(workdir), "--comfy-dir", str(comfy_dir)]) == 0
    out, err = capsys.readouterr()
    assert f"{placed} is there: choose it in the Load Diffusion Model node" in out
    assert f"lacks models/diffusion_models/{UNET['flux2_klein_9b']}" in err


@pytest.mark.trainer
@pytest.mark.parametrize("arch", sorted(KLEIN))
def test_comfyui_accepts_the_klein_api_workflow(comfyui_checkout, trainer_workdir, tmp_path, arch):  # noqa: F811
    """What POST /prompt runs (execution.validate_prompt) accepts the klein API workflow once its files exist."""
    _, built = klein_build(arch)
    api = tmp_path / "klein.api.json"
    api.write_text(json.dumps(built.api), encoding="utf-8")
    files = ["loras/mine.safetensors", *(f"{m['directory']}/{m['name']}" for m in built.models)]
    report = in_comfyui(trainer_workdir, comfyui_checkout, "api", "--api", str(api), *(f"--file={f}" for f in files))
    assert report["valid"] is True and report["outputs"] == ["9"], report
