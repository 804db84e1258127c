"""Presets: the trainer's own config file plus a top-level `launcher:` block.

A preset stays a config the trainer could read itself (minus the `launcher:` block), so users
can copy the trainer's documentation into it. The launcher only fills in what depends on the
machine: where the run writes, and for `launcher: {tiny: true}` the paths and shapes of the
embedded tiny FLUX.2.

    launcher:
      tiny: true               # build and use the embedded tiny FLUX.2 (tests, CI)
      env: {NAME: value}       # extra environment for the trainer process (allowed: trainer_env.ENV_ALLOWED)
      platform: rocm | cuda | cpu          # what the preset was tuned for (doctor, docs)
      allocator: expandable_segments | default   # wall 7; `default` leaves PyTorch's allocator alone
      telemetry: {interval_s: 10}
      watchdog: {enabled: false, ...}      # the stall watchdog, see launcher/watchdog/policy.py
      skip_bad_images: false   # true: train without the dataset files that fail the checks
      sampling: auto | force   # wall 6: in-training samples only where the self-test sampled (auto)
      card: RTX 4090, RTX 3090 (24 GB)     # the cards the preset is for (`python -m launcher presets`)

A preset may name another in `inherits:` and hold only what differs (launcher/runs/inheritance.py).
"""

import copy
import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from flux2_contract.families import FLUX2_DEV, family_of
from launcher.errors import LauncherError
from launcher.runs import launcher_settings
from launcher.runs.inheritance import MergedPreset, Origins, read_merged, shipped_names
from launcher.runs.schema import Vocabulary, check_preset
from launcher.writer import replace_own

PRESETS_DIR = Path(__file__).resolve().parents[2] / "presets"
LAUNCHER_KEY = "launcher"
LAUNCHER_DEFAULTS = {name: copy.deepcopy(item.default) for name, item in launcher_settings.SETTINGS.items()}
"""The `launcher:` block's defaults (launcher/runs/launcher_settings.py)."""
PLACEHOLDER = "filled-in-by-the-launcher"
REQUIRED_PLACES = {
    "model_dir": "--model-dir (or $FLUX2_MODEL_DIR): the folder holding {transformer} and ae.safetensors",
    "dataset": "--dataset (or $FLUX2_DATASET): the folder of captioned images",
}


@dataclass(frozen=True)
class Preset:
    path: Path
    settings: dict
    """The `launcher:` block."""
    config: dict
    """The trainer config, without the `launcher:` block."""
    files: tuple[Path, ...]
    """`path`, then each preset it inherits (one file when it inherits none)."""
    sha256: str
    """Of the merged preset as read: a change in any file of `files` changes it, comments do not."""

    @property
    def name(self) -> str:
        """The trainer's job name; also the run folder's name."""
        return self.config["config"]["name"]

    @property
    def steps(self) -> int:
        """The steps the run trains to: its last LoRA's name holds this number."""
        return self.config["config"]["process"][0]["train"]["steps"]

    @property
    def tiny(self) -> bool:
        return bool(self.settings["tiny"])

    @property
    def env(self) -> dict[str, str]:
        return {str(key): str(value) for key, value in self.settings["env"].items()}

    @property
    def sampling(self) -> str:
        return self.settings["sampling"]

    @property
    def allocator(self) -> str:
        return self.settings["allocator"]

    @property
    def telemetry(self) -> dict:
        return {**LAUNCHER_DEFAULTS["telemetry"], **self.settings["telemetry"]}

    @property
    def watchdog(self) -> dict:
        return self.settings["watchdog"]

    @property
    def skip_bad_images(self) -> bool:
        return bool(self.settings["skip_bad_images"])

    @property
    def gpus(self) -> int:
        return int(self.settings["gpus"])


def find_preset(spec: str) -> Path:
    """A preset file from a path, or from a bare name in the shipped presets folder."""
    candidates = [Path(spec), PRESETS_DIR / spec, PRESETS_DIR / f"{spec}.yaml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    shipped = ", ".join(shipped_names(PRESETS_DIR)) or "none"
    raise LauncherError(f"no preset {spec!r}: give a YAML file or one of the shipped presets ({shipped})")


def load_preset(spec: str, vocabulary: Vocabulary | None = None) -> Preset:
    """Read and check a preset against the schema, with what the trainer accepts when `vocabulary`
    is given (every problem then in one message), else without it (see `check`)."""
    merged = read_preset(spec)
    path, data = merged.files[0], merged.data
    raise_problems(path, check_preset(data, vocabulary or Vocabulary()), merged.origins)
    sha256 = hashlib.sha256(yaml.safe_dump(data, sort_keys=False, allow_unicode=True).encode("utf-8")).hexdigest()
    settings = {**LAUNCHER_DEFAULTS, **(data.pop(LAUNCHER_KEY, None) or {})}
    if not settings["tiny"]:  # a tiny preset's shapes are its tiny model's (`fill_tiny`)
        fill_family_shapes(data)
    return Preset(path=path, settings=settings, config=data, files=merged.files, sha256=sha256)


def fill_family_shapes(config: dict) -> None:
    """A model block whose family's transformer is not the trainer's default Flux2Params (FLUX.2 [dev]'s)
    gets that shape as `model_kwargs.flux2_params` where the preset gives none: a preset names its family
    by `arch` alone, and the memory plan, `qtype: auto`, the model-folder checks and the trainer all see
    that family's transformer."""
    for process in config["config"]["process"]:
        model = process["model"]
        kwargs = model.get("model_kwargs") or {}
        shape = family_of(model.get("arch")).shape
        if shape != FLUX2_DEV.shape and "flux2_params" not in kwargs:
            model["model_kwargs"] = {**kwargs, "flux2_params": copy.deepcopy(shape)}


def read_preset(spec: str) -> MergedPreset:
    """A preset's file laid over the presets it inherits, not yet checked: the keys as written,
    the `launcher:` block among them, each with the file and line that set it. A merged card
    preset's old name (`old_name` in presets/cards.csv) reads the preset it names now, with the run
    name it always had (`flux2_<old name>`), set by the table's line."""
    from launcher import card_table  # it reads PRESETS_DIR from this module

    cards = card_table.read_cards()
    moved = {card.old_name: PRESETS_DIR / f"{card.preset}.yaml" for card in card_table.old_names(cards).values()}
    card = card_table.renamed(spec, cards)
    if card is None:
        return read_merged(find_preset(spec), PRESETS_DIR, moved)
    merged = read_merged(moved[card.old_name], PRESETS_DIR, moved)
    merged.data["config"]["name"] = f"flux2_{card.old_name}"
    return replace(merged, origins={**merged.origins, "config.name": (card_table.TABLE, card.line)})


def raise_problems(path: Path, problems: list[str], origins: Origins | None = None) -> None:
    """Every problem at once, each after the line that set its key when known (`origins`): `line N`
    in `path` itself, `<file>, line N` in a preset it inherits."""
    if problems:
        count = f"{len(problems)} problems" if len(problems) > 1 else "a problem"
        located = [_located(problem, path, origins or {}) for problem in problems]
        raise LauncherError(f"{path} has {count}; nothing was started:\n  " + "\n  ".join(located))


def _located(problem: str, path: Path, origins: Origins) -> str:
    if (origin := origins.get(_key_of(problem))) is None:
        return problem
    file, line = origin
    return f"line {line}: {problem}" if file == path else f"{file}, line {line}: {problem}"


def _key_of(problem: str) -> str:
    """The key path a schema message starts with (`config.process[0].train.lr = ...`, `... is missing`)."""
    return problem.split(" = ", 1)[0].split(":", 1)[0].split(" ", 1)[0]


def render(preset: Preset, run_dir: Path, tiny_manifest: dict | None = None, places: dict | None = None) -> dict:
    """The trainer config for one run (a new one; the preset's stays as it was): outputs go to
    `run_dir`; tiny assets or `places` fill model and data."""
    config = copy.deepcopy(preset.config)
    processes = []
    for process in config["config"]["process"]:
        process = {**process, "training_folder": str(run_dir.resolve())}
        processes.append(with_tiny(process, tiny_manifest, (places or {}).get("dataset")) if tiny_manifest is not None
                         else with_places(process, places or {}, preset.path))
    return {**config, "config": {**config["config"], "process": processes}}


def with_places(process: dict, places: dict, preset_path: Path) -> dict:
    """One trainer process pointed at the user's model, text encoder and dataset folders."""
    model = process.get("model") or {}
    family = family_of(model.get("arch"))
    for needed, how in REQUIRED_PLACES.items():
        if needed not in places:
            raise LauncherError(f"{preset_path.name} needs {how.format(transformer=family.transformer_file)}")
    model = {**model, "name_or_path": str(places["model_dir"])}
    kwargs = model.get("model_kwargs") or {}
    if "text_encoder" in places:
        model["model_kwargs"] = {**kwargs, "text_encoder_path": str(places["text_encoder"])}
    elif kwargs.get("text_encoder_path") == PLACEHOLDER:
        model["model_kwargs"] = {**kwargs, "text_encoder_path": family.text_encoder.hub_id}
    return with_datasets({**process, "model": model}, folder_path=str(places["dataset"]))


def with_tiny(process: dict, manifest: dict, dataset_dir: Path | None = None) -> dict:
    """One trainer process pointed at the tiny FLUX.2 assets described by `manifest`, and at
    `dataset_dir` instead of the generated one when given."""
    model = process.get("model") or {}
    model = {**model, "name_or_path": manifest["name_or_path"],
             "model_kwargs": {**(model.get("model_kwargs") or {}), **manifest["model_kwargs"]}}
    return with_datasets({**process, "model": model}, folder_path=str(dataset_dir) if dataset_dir else manifest["dataset"],
                         resolution=[manifest["resolution"]])


def with_datasets(process: dict, **values) -> dict:
    """`process` with these values in each of its datasets."""
    if "datasets" not in process:
        return process
    return {**process, "datasets": [{**dataset, **values} for dataset in process["datasets"]]}


def write_config(config: dict, path: Path) -> Path:
    replace_own(path, yaml.safe_dump(config, sort_keys=False))
    return path
