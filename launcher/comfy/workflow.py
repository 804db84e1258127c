"""A ComfyUI workflow for a trained LoRA, built from ComfyUI's own FLUX.2 template for the run's model.

No node graph is written here: an official template (package `comfyui-workflow-templates-json`,
the template library ComfyUI itself ships; which one a run gets: launcher/comfy/templates.py) is
loaded and edited. Where the template offers several subgraphs (klein 4B: base and distilled),
only the one named is kept. A `LoraLoaderModelOnly` node (a copy of the template's own, or one
built the way ComfyUI saves it where the template has none) goes between the model loader and
everything the loader fed (the guider path, and the [dev] template's optional turbo-LoRA branch);
the prompt, a fixed seed and an output prefix are set, where a subgraph exposes them also on the
node that feeds them from outside. Two forms come out:

- UI format (what ComfyUI saves): drag it onto the canvas; layout and subgraph as in the template.
- API format (`POST /prompt`): the same graph flattened, widget values named, the template's
  turbo switch resolved to its saved state (off), and what no output needs dropped, so the
  turbo LoRA file is not required.

UI widget values are positional; the API names them. The names follow ComfyUI's node
definitions (WIDGETS); the optional ComfyUI test checks them against ComfyUI itself.
"""

import copy
import importlib.resources
import json
from dataclasses import dataclass

from flux2_contract.families import FLUX2_DEV
from launcher.errors import LauncherError

TEMPLATE_PACKAGE = "comfyui_workflow_templates_json"
TEMPLATE = FLUX2_DEV.comfy.name
"""The FLUX.2 [dev] text-to-image template, the default."""
SEED = 42
MODEL_LOADER = "UNETLoader"
LORA_LOADER = "LoraLoaderModelOnly"
CONTROL = "control_after_generate"
"""The frontend-only widget after a seed: what to do with it after each run."""
PROMPT_TITLE = "Positive Prompt"
"""How the templates title the text encoder of the prompt (the klein ones also have a negative one)."""
WIDGETS = {
    # ComfyUI's node definitions, e.g. https://github.com/comfyanonymous/ComfyUI/blob/master/nodes.py,
    # https://github.com/comfyanonymous/ComfyUI/blob/master/comfy_extras/nodes_custom_sampler.py,
    # https://github.com/comfyanonymous/ComfyUI/blob/master/comfy_extras/nodes_primitive.py
    "UNETLoader": ("unet_name", "weight_dtype"),
    "CLIPLoader": ("clip_name", "type", "device"),
    "VAELoader": ("vae_name",),
    "LoraLoaderModelOnly": ("lora_name", "strength_model"),
    "CLIPTextEncode": ("text",),
    "FluxGuidance": ("guidance",),
    "Flux2Scheduler": ("steps", "width", "height"),
    "EmptyFlux2LatentImage": ("width", "height", "batch_size"),
    "RandomNoise": ("noise_seed", CONTROL),
    "KSamplerSelect": ("sampler_name",),
    "SaveImage": ("filename_prefix",),
    "PrimitiveInt": ("value", CONTROL),
    "PrimitiveBoolean": ("value",),
    "PrimitiveStringMultiline": ("value",),
    "ComfySwitchNode": ("switch",),
    "CFGGuider": ("cfg",),
    "ConditioningZeroOut": (),
    "BasicGuider": (),
    "SamplerCustomAdvanced": (),
    "VAEDecode": (),
}
NOTES = {"MarkdownNote", "Note"}
"""Frontend-only node types: shown on the canvas, absent from the API format."""
OUTPUT_NODES = {"SaveImage"}
SUBGRAPH_INPUT, SUBGRAPH_OUTPUT = -10, -20
LINK_FIELDS = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")


@dataclass(frozen=True)
class Workflow:
    ui: dict
    api: dict
    models: list[dict]
    """The template's model entries ({name, url, directory}) that the API graph loads."""
    canvas_models: list[dict]
    """Model entries only the UI workflow names (the turbo LoRA behind its switch): ComfyUI checks
    every loader's file when the canvas queues, both sides of a switch included, so they must exist."""


def load_template(name: str = TEMPLATE) -> dict:
    try:
        path = importlib.resources.files(TEMPLATE_PACKAGE) / "templates" / f"{name}.json"
    except ModuleNotFoundError:
        raise LauncherError(
            "ComfyUI's templates package is not installed: run `pip install -e .` in the project folder"
        ) from None
    if not path.is_file():
        raise LauncherError(f"ComfyUI's templates package has no template {name}: it is not the pinned version; "
                            "run `pip install -e .` in the project folder")
    return json.loads(path.read_text(encoding="utf-8"))


def build(template: dict, lora_name: str, prompt: str, output_prefix: str, subgraph: str | None = None) -> Workflow:
    """The template (only its subgraph named `subgraph`, where given) with this LoRA, prompt and a fixed
    seed, in both formats, checked against the template."""
    ui = copy.deepcopy(template)
    if subgraph is not None:
        keep_subgraph(ui, subgraph)
    insert_lora(ui, lora_name)
    set_widget(ui, "CLIPTextEncode", "text", prompt, titled=PROMPT_TITLE)
    set_widget(ui, "RandomNoise", "noise_seed", SEED)
    set_widget(ui, "RandomNoise", CONTROL, "fixed")
    set_widget(ui, "SaveImage", "filename_prefix", output_prefix)
    api, sources = to_api(ui)
    problems = check_against_template(ui, api, template)
    if problems:
        raise LauncherError("the workflow built from the ComfyUI template is inconsistent (a launcher bug):\n  "
                            + "\n  ".join(problems))
    models = required_models(api, sources)
    return Workflow(ui, api, models, [model for model in canvas_models(ui) if model not in models])


def graphs(ui: dict) -> list[dict]:
    """The top-level graph and every subgraph definition."""
    return [ui, *(ui.get("definitions") or {}).get("subgraphs", [])]


def links_of(graph: dict) -> dict[int, dict]:
    """A graph's links by id, as dicts (the top level stores them as lists); dicts are live."""
    found = {}
    for link in graph["links"]:
        entry = link if isinstance(link, dict) else dict(zip(LINK_FIELDS, link))
        found[entry["id"]] = entry
    return found


def only_node(ui: dict, node_type: str, titled: str = "") -> tuple[dict, dict]:
    """(graph, node) of the one node of a type (whose title holds `titled`); the template must have exactly one."""
    found = [(graph, node) for graph in graphs(ui) for node in graph["nodes"]
             if node["type"] == node_type and titled in node.get("title", "")]
    if len(found) != 1:
        raise LauncherError(
            f"the ComfyUI template has {len(found)} {node_type} nodes{f' titled {titled!r}' if titled else ''} "
            "where one was expected: the templates package is not the pinned version; run `pip install -e .` again"
        )
    return found[0]


def set_widget(ui: dict, node_type: str, name: str, value, titled: str = "") -> None:
    graph, node = only_node(ui, node_type, titled)
    node["widgets_values"][WIDGETS[node_type].index(name)] = value
    _set_from_outside(ui, graph, node, name, value)


def _set_from_outside(ui: dict, graph: dict, node: dict, name: str, value) -> None:
    """Where the widget is a subgraph input, the value the subgraph node gives it wins in ComfyUI: set
    there too, on the node linked to that input (a primitive) or the subgraph node's own widget value."""
    socket = next((s for s in node.get("inputs", []) if s["name"] == name and s.get("link") is not None), None)
    link = links_of(graph)[socket["link"]] if socket and graph is not ui else None
    if link is None or link["origin_id"] != SUBGRAPH_INPUT:
        return
    slot = link["origin_slot"]
    for instance in (n for n in ui["nodes"] if n["type"] == graph["id"]):
        outer = next((s for s in instance.get("inputs", []) if s["name"] == graph["inputs"][slot]["name"]), {})
        if outer.get("link") is not None:
            feeder = next(n for n in ui["nodes"] if n["id"] == links_of(ui)[outer["link"]]["origin_id"])
            if "value" not in WIDGETS.get(feeder["type"], ()):
                raise LauncherError(f"the ComfyUI template feeds {name} from a {feeder['type']} node, where the launcher "
                                    "expects a primitive: the templates package is not the pinned version")
            feeder["widgets_values"][WIDGETS[feeder["type"]].index("value")] = value
        elif len(instance.get("widgets_values") or []) == len(graph["inputs"]):  # one value per subgraph input
            instance["widgets_values"][slot] = value


def keep_subgraph(ui: dict, name: str) -> None:
    """Only the subgraph named `name` (e.g. klein base where the template also has klein distilled): the
    other subgraphs, their nodes on the top level and the nodes only they fed (their SaveImage) go."""
    subgraphs = graphs(ui)[1:]
    kept = [graph for graph in subgraphs if graph.get("name") == name]
    if len(kept) != 1:
        raise LauncherError(f"the ComfyUI template has no subgraph named {name!r} (it has "
                            f"{', '.join(repr(g.get('name')) for g in subgraphs)}): the templates package is not "
                            "the pinned version; run `pip install -e .` again")
    links = links_of(ui)
    dropped = {graph["id"] for graph in subgraphs} - {kept[0]["id"]}
    gone = {node["id"] for node in ui["nodes"] if node["type"] in dropped}
    gone |= {node["id"] for node in ui["nodes"] if _fed_only_by(node, gone, links)}
    cut = {i for i, link in links.items() if link["origin_id"] in gone or link["target_id"] in gone}
    ui["nodes"] = [node for node in ui["nodes"] if node["id"] not in gone]
    for node in ui["nodes"]:
        for output in node.get("outputs", []):
            if output.get("links"):
                output["links"] = [i for i in output["links"] if i not in cut]
    _write_links(ui, {i: link for i, link in links.items() if i not in cut})
    ui["definitions"]["subgraphs"] = kept


def _fed_only_by(node: dict, origins: set[int], links: dict[int, dict]) -> bool:
    fed_by = [links[socket["link"]]["origin_id"] for socket in node.get("inputs", []) if socket.get("link") is not None]
    return bool(fed_by) and set(fed_by) <= origins


def new_lora_node() -> dict:
    """A LoraLoaderModelOnly as ComfyUI's frontend saves one, for a template without one to copy: widgets in
    the order of its definition (lora_name, strength_model; nodes.py in ComfyUI, see WIDGETS), model linked."""
    return {"id": 0, "type": LORA_LOADER, "pos": [0, 0], "size": [300, 82], "flags": {}, "order": 0, "mode": 0,
            "inputs": [{"localized_name": "model", "name": "model", "type": "MODEL", "link": None}],
            "outputs": [{"localized_name": "MODEL", "name": "MODEL", "type": "MODEL", "links": []}],
            "properties": {"Node name for S&R": LORA_LOADER}, "widgets_values": [None, 1.0]}


def insert_lora(ui: dict, lora_name: str) -> None:
    """A LoRA node (a copy of the template's, else a new one), fed by the model loader, feeding what the loader fed."""
    graph, loader = only_node(ui, MODEL_LOADER)
    has_lora = any(node["type"] == LORA_LOADER for g in graphs(ui) for node in g["nodes"])
    node = copy.deepcopy(only_node(ui, LORA_LOADER)[1]) if has_lora else new_lora_node()
    node_id = _next_id(ui, graph, "lastNodeId", "last_node_id", max(n["id"] for g in graphs(ui) for n in g["nodes"]))
    node.update(id=node_id, title="LoRA of this run", widgets_values=[lora_name, 1.0],
                pos=[loader["pos"][0], loader["pos"][1] - node["size"][1] - 120])  # above the loader, clear of it
    node["properties"].pop("models", None)  # a local file: nothing to download
    node["inputs"] = [{**socket, "link": None} for socket in node["inputs"]]
    model_out = next(slot for slot, out in enumerate(loader["outputs"]) if out["type"] == "MODEL")
    model_in = next(slot for slot, socket in enumerate(node["inputs"]) if socket["type"] == "MODEL")
    links = links_of(graph)
    fed = loader["outputs"][model_out]["links"]
    for link_id in fed:
        links[link_id].update(origin_id=node_id, origin_slot=0)
    link_id = _next_id(ui, graph, "lastLinkId", "last_link_id", max(i for g in graphs(ui) for i in links_of(g)))
    links[link_id] = dict(zip(LINK_FIELDS, (link_id, loader["id"], model_out, node_id, model_in, "MODEL")))
    _write_links(graph, links)
    node["outputs"][0]["links"] = list(fed)
    node["inputs"][model_in]["link"] = link_id
    loader["outputs"][model_out]["links"] = [link_id]
    graph["nodes"].append(node)
    _promote(ui, graph, node_id)


def _next_id(ui: dict, graph: dict, state_key: str, top_key: str, highest: int) -> int:
    """A fresh node or link id, recorded as the last one where the format keeps it."""
    new = 1 + max(highest, ui.get(top_key, 0), graph.get("state", {}).get(state_key, 0))
    ui[top_key] = new
    if "state" in graph:
        graph["state"][state_key] = new
    return new


def _write_links(graph: dict, links: dict[int, dict]) -> None:
    as_lists = bool(graph["links"]) and isinstance(graph["links"][0], list)
    graph["links"] = [[link[f] for f in LINK_FIELDS] if as_lists else link for link in links.values()]


def _promote(ui: dict, graph: dict, node_id: int) -> None:
    """Show the new LoRA's widgets on the collapsed subgraph node, as the template does for its own."""
    for node in ui["nodes"]:
        proxies = node.get("properties", {}).get("proxyWidgets")
        if node["type"] == graph.get("id") and proxies is not None:
            proxies += [[str(node_id), "lora_name"], [str(node_id), "strength_model"]]


def to_api(ui: dict) -> tuple[dict, dict]:
    """({api id: node}, {api id: UI node}) for the UI workflow, subgraphs flattened to `outer:inner` ids."""
    subgraphs = {graph["id"]: graph for graph in graphs(ui)[1:]}
    api, sources = {}, {}
    for node in ui["nodes"]:
        if node["type"] in subgraphs:
            for inner in subgraphs[node["type"]]["nodes"]:
                api_id = f"{node['id']}:{inner['id']}"
                api[api_id] = _api_node(inner, ui, subgraphs[node["type"]], node)
                sources[api_id] = inner
        elif node["type"] not in NOTES:
            api[str(node["id"])] = _api_node(node, ui, ui, None)
            sources[str(node["id"])] = node
    _resolve_switches(api)
    kept = _needed_by_outputs(api)
    return {key: api[key] for key in api if key in kept}, {key: sources[key] for key in kept}


def _api_node(node: dict, ui: dict, graph: dict, instance: dict | None) -> dict:
    names = WIDGETS.get(node["type"])
    if names is None:
        raise LauncherError(
            f"the ComfyUI template uses node type {node['type']}, which the launcher cannot write "
            "in the API format: the templates package is not the pinned version; run `pip install -e .` again"
        )
    values = node.get("widgets_values") or []
    inputs = {name: value for name, value in zip(names, values if isinstance(values, list) else []) if name != CONTROL}
    for socket in node.get("inputs", []):
        if socket.get("link") is not None:
            source = _source(ui, graph, instance, socket["link"])
            if source is not None:
                inputs[socket["name"]] = source
    return {"class_type": node["type"], "inputs": inputs, "_meta": {"title": node.get("title", node["type"])}}


def _source(ui: dict, graph: dict, instance: dict | None, link_id: int) -> list | None:
    """[api id, output slot] feeding a link; None for a subgraph input left as a widget value."""
    link = links_of(graph)[link_id]
    prefix = f"{instance['id']}:" if instance else ""
    if link["origin_id"] == SUBGRAPH_INPUT:
        name = graph["inputs"][link["origin_slot"]]["name"]
        outer = next((socket for socket in instance["inputs"] if socket["name"] == name), {})
        return None if outer.get("link") is None else _source(ui, ui, None, outer["link"])
    origin = next(node for node in graph["nodes"] if node["id"] == link["origin_id"])
    subgraph = next((g for g in graphs(ui)[1:] if g["id"] == origin["type"]), None)
    if subgraph is not None:
        inner = links_of(subgraph)[subgraph["outputs"][link["origin_slot"]]["linkIds"][0]]
        return [f"{origin['id']}:{inner['origin_id']}", inner["origin_slot"]]
    return [f"{prefix}{origin['id']}", link["origin_slot"]]


def _resolve_switches(api: dict) -> None:
    """A switch whose state is a constant is replaced, in its consumers, by the branch it selects."""
    for switch_id, node in api.items():
        if node["class_type"] != "ComfySwitchNode":
            continue
        state = node["inputs"]["switch"]
        if isinstance(state, list) and api[state[0]]["class_type"] == "PrimitiveBoolean":
            state = api[state[0]]["inputs"].get("value")
        if isinstance(state, bool):
            chosen = node["inputs"]["on_true" if state else "on_false"]
            for consumer in api.values():
                for name, value in consumer["inputs"].items():
                    if value == [switch_id, 0]:
                        consumer["inputs"][name] = chosen


def _needed_by_outputs(api: dict) -> set[str]:
    needed, todo = set(), [key for key, node in api.items() if node["class_type"] in OUTPUT_NODES]
    while todo:
        key = todo.pop()
        if key not in needed:
            needed.add(key)
            todo += [value[0] for value in api[key]["inputs"].values() if _is_link(value)]
    return needed


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def required_models(api: dict, sources: dict) -> list[dict]:
    """The template's model entries for the files the API graph's loaders name."""
    found = []
    for key, node in api.items():
        for model in sources[key].get("properties", {}).get("models", []):
            if model["name"] in node["inputs"].values() and model not in found:
                found.append(model)
    return found


def canvas_models(ui: dict) -> list[dict]:
    """Every model entry the UI workflow's nodes name, in graph order."""
    found = []
    for graph in graphs(ui):
        for node in graph["nodes"]:
            found += [model for model in node.get("properties", {}).get("models", []) if model not in found]
    return found


def check_against_template(ui: dict, api: dict, template: dict) -> list[str]:
    """What in either format is not as the template's nodes are: types, input names, widget
    counts, link endpoints, connected sockets; empty when the workflow is consistent."""
    known = template_nodes(template)
    problems = []
    for graph in graphs(ui):
        links = links_of(graph)
        for node in graph["nodes"]:
            where = f"UI node {node['id']} ({node['type']})"
            spec = known.get(node["type"])
            if spec is None:
                problems.append(f"{where}: not a node type of the template")
                continue
            names = {socket["name"] for socket in node.get("inputs", [])}
            problems += [f"{where}: input {name!r} is not in the template" for name in sorted(names - spec["inputs"])]
            if _widget_count(node) != spec["widgets"]:
                problems.append(f"{where}: {_widget_count(node)} widget values, the template has {spec['widgets']}")
            problems += _link_problems(where, node, links)
    for key, node in api.items():
        problems += _api_problems(f"API node {key} ({node['class_type']})", node, known.get(node["class_type"]), api)
    return problems


def template_nodes(template: dict) -> dict[str, dict]:
    """{node type: input names, input names that are widgets, sockets always linked, widget count}."""
    nodes = [node for graph in graphs(template) for node in graph["nodes"]]
    if not any(node["type"] == LORA_LOADER for node in nodes):
        lora = new_lora_node()  # what insert_lora adds to this template, linked as it links it
        nodes.append({**lora, "inputs": [{**socket, "link": 0} for socket in lora["inputs"]]})
    known: dict[str, dict] = {}
    for node in nodes:
        spec = known.setdefault(node["type"], {"inputs": set(), "widget_inputs": set(), "linked": None,
                                               "widgets": _widget_count(node)})
        sockets = node.get("inputs", [])
        spec["inputs"] |= {socket["name"] for socket in sockets}
        spec["widget_inputs"] |= {socket["name"] for socket in sockets if "widget" in socket}
        linked = {socket["name"] for socket in sockets if "widget" not in socket and socket.get("link") is not None}
        spec["linked"] = linked if spec["linked"] is None else spec["linked"] & linked
    return known


def _widget_count(node: dict) -> int:
    values = node.get("widgets_values")
    return len(values) if isinstance(values, list) else 0


def _link_problems(where: str, node: dict, links: dict[int, dict]) -> list[str]:
    """Each link a node names must exist and end at that node and slot."""
    problems = []
    for slot, socket in enumerate(node.get("inputs", [])):
        if socket.get("link") is None:
            continue
        link = links.get(socket["link"])
        if link is None or (link["target_id"], link["target_slot"]) != (node["id"], slot):
            problems.append(f"{where}: input {socket['name']!r} names link {socket['link']}, which does not end there")
    for slot, output in enumerate(node.get("outputs", [])):
        for link_id in output.get("links") or []:
            link = links.get(link_id)
            if link is None or (link["origin_id"], link["origin_slot"]) != (node["id"], slot):
                problems.append(f"{where}: output {output['name']!r} names link {link_id}, which does not start there")
    return problems


def _api_problems(where: str, node: dict, spec: dict | None, api: dict) -> list[str]:
    if spec is None or node["class_type"] not in WIDGETS:
        return [f"{where}: not a node type of the template"]
    widgets = WIDGETS[node["class_type"]]
    problems = []
    if len(widgets) != spec["widgets"] or not spec["widget_inputs"] <= set(widgets):
        problems.append(f"{where}: widget names {widgets} do not fit the template's node")
    for name, value in node["inputs"].items():
        if _is_link(value) and (value[0] not in api or name not in spec["inputs"]):
            problems.append(f"{where}: input {name!r} links {value}, not an input of the template's node or no such node")
        if not _is_link(value) and name not in widgets:
            problems.append(f"{where}: {name!r} is not a widget of this node type")
    missing = spec["linked"] - {name for name, value in node["inputs"].items() if _is_link(value)}
    problems += [f"{where}: input {name!r} is connected in the template but not here" for name in sorted(missing)]
    return problems

