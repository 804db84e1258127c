"""Start a run from the page: a preset, the few settings a user changes, the dry run, then `run`.

The edited settings become a preset file of their own that `inherits:` the picked one and holds only
what differs, written to `<workdir>/ui/presets/<run name>.yaml` through the writer: the run is then
an ordinary `run PRESET`, repeatable from a terminal, and `presets FILE` shows it with the file
that set each value. The values are checked by the preset schema, with its messages, before any
file is written; the dry run (`run PRESET --dry-run`, a child process as typed) then shows the plan;
only a preset whose dry run passed can be started.
"""

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import yaml

from flux2_contract.families import DEFAULT_ARCH, FLUX2_DEV
from launcher.envs.workdir import Workdir
from launcher.errors import LauncherError
from launcher.runs.inheritance import INHERITS_KEY, leaves, merge, shipped_names
from launcher.runs.presets import PRESETS_DIR, raise_problems, read_preset
from launcher.runs.schema import PlainName, check_preset
from launcher.runs.vocabulary import read_vocabulary
from launcher.selftest.verdict import load_result
from launcher.step_prediction import PATHS_OF_QTYPES, load_table, rows_for_gpu
from launcher.ui.guard import Refused
from launcher.writer import replace_own

PROCESS = ("config", "process", 0)
FIELDS = {
    # field: (label, key path in the preset, kind)
    "name": ("run name", ("config", "name"), "text"),
    "steps": ("steps", (*PROCESS, "train", "steps"), "int"),
    "rank": ("LoRA rank (alpha follows it)", (*PROCESS, "network", "linear"), "int"),
    "lr": ("learning rate", (*PROCESS, "train", "lr"), "float"),
    "resolution": ("resolution, px (comma-separated for several)", (*PROCESS, "datasets", 0, "resolution"), "ints"),
    "trigger_word": ("trigger word", (*PROCESS, "trigger_word"), "text"),
    "prompts": ("sample prompts, one a line", (*PROCESS, "sample", "prompts"), "lines"),
}
PLACES = {
    # field: (label, `run` flag)
    "dataset": ("dataset folder", "--dataset"),
    "model_dir": (f"model folder ({FLUX2_DEV.transformer_file}, ae.safetensors)", "--model-dir"),
    "text_encoder": ("text encoder folder", "--text-encoder"),
}
CONFIG_START = re.compile(r"(job|config):")
"""The rendered config's first line: a preset's top-level keys (yaml.safe_dump keeps their order)."""
VARIABLE = re.compile(r"[A-Z][A-Z0-9_]*=")
UI_PREFIX = "ui/"
DRY_RUN_TIMEOUT_S = 600


def preset_folder(workdir: Workdir) -> Path:
    return workdir.root / "ui" / "presets"


def presets(workdir: Workdir) -> list[str]:
    """The presets the page offers: the shipped ones, then those the page wrote (`ui/<name>`)."""
    folder = preset_folder(workdir)
    own = [UI_PREFIX + name for name in shipped_names(folder)] if folder.is_dir() else []
    return [*shipped_names(PRESETS_DIR), *own]


def preset_file(workdir: Workdir, preset_id: str) -> Path:
    """The file of a preset the page offers; anything else (a path, `..`) is refused."""
    if preset_id not in presets(workdir):
        raise Refused(404, f"no preset {preset_id!r}: pick one of the list")
    if preset_id.startswith(UI_PREFIX):
        return preset_folder(workdir) / f"{preset_id.removeprefix(UI_PREFIX)}.yaml"
    return PRESETS_DIR / f"{preset_id}.yaml"


def describe(workdir: Workdir, preset_id: str, shown: Callable[[str], list[str]]) -> dict:
    """A preset as `presets NAME` shows it (`shown`: each value with the file that set it) and its
    editable values."""
    path = preset_file(workdir, preset_id)
    try:
        lines = shown(str(path))
    except LauncherError as error:
        return {"preset": preset_id, "error": str(error)}
    data = read_preset(str(path)).data
    values = {name: as_text(lookup(data, key), kind) for name, (_, key, kind) in FIELDS.items()}
    return {"preset": preset_id, "lines": lines, "values": values,
            "fields": {name: label for name, (label, _, _) in FIELDS.items()},
            "places": {name: label for name, (label, _) in PLACES.items()}}


def lookup(data, key: tuple):
    for part in key:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def as_text(value, kind: str) -> str:
    if value is None:
        return ""
    if kind == "lines":
        return "\n".join(map(str, value)) if isinstance(value, list) else str(value)
    if kind == "ints" and isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def parsed(text: str, kind: str):
    """A form's text as the preset value; what does not read as its kind stays text, for the
    schema to refuse with its own message."""
    text = text.strip()
    if kind == "lines":
        return [line.strip() for line in text.splitlines() if line.strip()]
    if kind == "ints":
        return [parsed(part, "int") for part in text.split(",") if part.strip()]
    for number in ((int,) if kind == "int" else (float,) if kind == "float" else ()):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def changes(data: dict, form: dict) -> dict:
    """What the form sets differently from the merged preset `data`, as a preset fragment to lay over it."""
    fragment: dict = {}
    for name, (_, key, kind) in FIELDS.items():
        if name not in form:
            continue
        value = parsed(str(form[name]), kind)
        if value in ("", []) and lookup(data, key) is None:
            continue
        if value != lookup(data, key):
            place(fragment, key, value)
            if name == "rank" and lookup(data, key) == lookup(data, (*PROCESS, "network", "linear_alpha")):
                place(fragment, (*PROCESS, "network", "linear_alpha"), value)
    return fragment


def place(fragment: dict, key: tuple, value) -> None:
    """Set `key` in `fragment`, a list index making a list of mappings (merged item by item)."""
    node = fragment
    for part, following in zip(key, key[1:]):
        if isinstance(part, int):
            while len(node) <= part:
                node.append({})
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(following, int) else {})
    node[key[-1]] = value


def check(workdir: Workdir, preset_id: str, form: dict) -> tuple[Path, dict]:
    """The new preset's file and content, after the schema passed it; a LauncherError with the
    schema's messages (the same `run` prints) otherwise. Nothing is written here."""
    parent = preset_file(workdir, preset_id)
    merged = read_preset(str(parent))
    fragment = changes(merged.data, form)
    data = merge(copy.deepcopy(merged.data), fragment, "", [])
    name = lookup(data, ("config", "name"))
    if next(PlainName().check(name, "config.name", None), None) is not None:
        raise LauncherError(f"run name {name!r}: give a plain folder name ({PlainName.allowed})")
    path = preset_folder(workdir) / f"{name}.yaml"
    set_here = [where for where, _ in leaves(fragment)]
    origins = {key: origin for key, origin in merged.origins.items()
               if not any(key == where or key.startswith((f"{where}.", f"{where}[")) for where in set_here)}
    raise_problems(path, check_preset(data, read_vocabulary(workdir.trainer)), origins)
    if path.resolve() == parent.resolve():
        raise LauncherError(f"{path} is the picked preset itself: give the run another name")
    if (workdir.runs / name).exists():
        raise LauncherError(f"a run named {name!r} exists in {workdir.runs}: give this one another name "
                            f"(`python -m launcher run PRESET --resume` continues that one)")
    return path, {INHERITS_KEY: str(parent.resolve()), **fragment}


def write(workdir: Workdir, path: Path, content: dict, parent: str) -> Path:
    header = f"# written by `python -m launcher ui`: {parent} with the settings changed on the page\n"
    return replace_own(path, header + yaml.safe_dump(content, sort_keys=False, allow_unicode=True), workdir.root)


def place_flags(form: dict) -> list[str]:
    """`run`'s location flags of the folders the form names (blank: the flag's environment variable)."""
    return [part for name, (_, flag) in PLACES.items() if str(form.get(name) or "").strip()
            for part in (flag, str(form[name]).strip())]


def dry_run(workdir: Workdir, path: Path, flags: list[str]) -> dict:
    """`run PRESET --dry-run` as typed: its plan lines, its rendered config, its warnings; and the ETA
    the step prediction gives this config on the self-tested card."""
    command = [sys.executable, "-m", "launcher", "run", str(path), "--workdir", str(workdir.root), "--dry-run", *flags]
    try:
        result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, encoding="utf-8",
                                errors="replace", timeout=DRY_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the dry run took over {DRY_RUN_TIMEOUT_S} s; run it in a terminal: "
                                      f"{' '.join(command[1:])}"}
    if result.returncode != 0:
        return {"ok": False, "error": result.stderr.strip() or result.stdout.strip(), "command": " ".join(command[1:])}
    plan, config = read_dry_run(result.stdout)
    return {"ok": True, "plan": plan, "eta": eta(workdir, config), "warnings": result.stderr.strip(),
            "command": " ".join(command[1:]), "output": result.stdout}


def read_dry_run(output: str) -> tuple[list[str], dict]:
    """The lines a dry run says before its rendered config (its choices and plan, YAML comments there,
    and the disk it counts) and the config itself, which runs up to the variables `run` sets (NAME=value)."""
    lines = output.splitlines()
    start = next((index for index, line in enumerate(lines) if CONFIG_START.match(line)), len(lines))
    end = next((index for index in range(start, len(lines)) if VARIABLE.match(lines[index])), len(lines))
    plan = [line.removeprefix("# ") for line in lines[:start] if line.strip()]
    try:
        config = yaml.safe_load("\n".join(lines[start:end]))
    except yaml.YAMLError:
        config = None
    return plan, config if isinstance(config, dict) else {}


def eta(workdir: Workdir, config: dict) -> str:
    """The time to train the config's steps at the step the prediction table gives the self-tested
    card (bench/RESULTS.md, "Predicted steps"), or why there is none."""
    result = load_result(workdir) or {}
    gpu = ((result.get("environment") or {}).get("gpu") or {}).get("name")
    if not gpu:
        return "no ETA before the run: no self-test names this machine's GPU (`python -m launcher selftest`)"
    try:
        process = config["config"]["process"][0]
        model, steps = process["model"], int(process["train"]["steps"])
        resolution = process["datasets"][0]["resolution"]
        px = max(resolution) if isinstance(resolution, list) else int(resolution)
        compiled = (model.get("model_kwargs") or {}).get("compile_blocks") is True
    except (KeyError, IndexError, TypeError, ValueError):
        return "no ETA before the run: the dry run's config lacks the steps, model or resolution"
    shape = (str(model.get("arch", DEFAULT_ARCH)), PATHS_OF_QTYPES.get(str(model.get("qtype"))), px, compiled)
    row = next((row for row in rows_for_gpu(load_table(), gpu) if (row.model, row.path, row.px, row.compiled) == shape),
               None)
    if row is None:
        return f"no ETA before the run: the step prediction has no row for {gpu} at {shape[1] or model.get('qtype')}, {px} px"
    fast, slow = row.range_s
    return (f"ETA {hours(steps * fast)} to {hours(steps * slow)} for {steps} steps at the predicted {fast:.1f}-{slow:.1f} "
            f"s/it of the {row.card} ({row.path}, {px} px{', compiled' if compiled else ''}; bench/RESULTS.md)")


def hours(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"

