"""What the trainer accepts, read from the trainer itself, so the checks follow the locked commit.

- config keys: the `kwargs.get('key'` of each config class in toolkit/config_modules.py and the
  `get_conf('key'` of the train processes; `model_kwargs` keys: every `model_kwargs.get('key'`
  and `settings.read(model_kwargs, 'key'` in the checkout;
- model arches: the `arch = '...'` of each model class in extensions_built_in (a FLUX.2 klein
  preset on a checkout without klein names the target that has it, flux2_contract/families.py);
- optimizers, network types, dtypes and job types: the names the trainer's dispatch code
  compares against (toolkit/optimizer.py, the NetworkType literal, get_torch_dtype, get_job);
- qtypes: asked from the trainer's own `get_qtype` under its interpreter
  (`launcher.in_trainer.qtypes`), because that table is built by code across several modules;
  the answer is kept in the workdir per checkout HEAD, so only the first run pays for it.

A table that cannot be read (a file moved upstream) is left unknown and its values unchecked,
rather than refusing good presets.
"""

import json
import re
from pathlib import Path

from launcher.envs.trainer_python import run_module
from launcher.runs.schema import Vocabulary
from launcher.user_files import load_json_state
from launcher.writer import replace_own

SECTION_CLASSES = {
    "model": "ModelConfig",
    "train": "TrainConfig",
    "network": "NetworkConfig",
    "save": "SaveConfig",
    "sample": "SampleConfig",
    "logging": "LoggingConfig",
    "datasets": "DatasetConfig",
}
PROCESS_SOURCES = (
    "jobs/process/BaseProcess.py",
    "jobs/process/BaseTrainProcess.py",
    "jobs/process/BaseSDTrainProcess.py",
    "extensions_built_in/sd_trainer/SDTrainer.py",
)
PROCESS_EXTRA = {"type"}  # read by the job to pick the process class


def _read(trainer: Path, relative: str) -> str:
    path = trainer / relative
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def _found(pattern: str, text: str) -> set[str] | None:
    names = set(re.findall(pattern, text))
    return names or None


def known_keys(trainer: Path) -> dict[str, set[str]] | None:
    """{section: keys the trainer reads}; section "process" is the process level."""
    source = _read(trainer, "toolkit/config_modules.py")
    classes = {match.group(1): match.start() for match in re.finditer(r"^class (\w+)", source, re.M)}
    if not all(name in classes for name in SECTION_CLASSES.values()):
        return None
    bounds = sorted(classes.values()) + [len(source)]
    keys: dict[str, set[str]] = {}
    for section, name in SECTION_CLASSES.items():
        start = classes[name]
        body = source[start : bounds[bounds.index(start) + 1]]
        keys[section] = set(re.findall(r"kwargs\.get\(\s*['\"](\w+)['\"]", body))
    keys["process"] = set(PROCESS_EXTRA)
    for relative in PROCESS_SOURCES:
        keys["process"] |= set(re.findall(r"get_conf\(\s*['\"](\w+)", _read(trainer, relative)))
    return keys


def model_kwargs_keys(trainer: Path) -> set[str] | None:
    found: set[str] = set()
    for folder in ("toolkit", "extensions_built_in", "jobs"):
        for path in sorted((trainer / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            if "model_kwargs" in text:
                # model_kwargs.get("key", ...) in the fork; kwargs.get("key", ...) in modules handed them;
                # settings.read(model_kwargs, "key") where the series reads a setting of the catalogue
                found |= set(re.findall(r"\b\w*kwargs\.get\(\s*['\"](\w+)['\"]", text))
                found |= set(re.findall(r"\bsettings\.read\(\s*[\w.]+,\s*['\"](\w+)['\"]", text))
    return found or None


def network_types(trainer: Path) -> set[str] | None:
    literal = re.search(r"NetworkType\s*=\s*Literal\[([^\]]*)\]", _read(trainer, "toolkit/config_modules.py"))
    if not literal:
        return None
    names = set(re.findall(r"['\"](\w+)['\"]", literal.group(1)))
    for relative in ("toolkit/lora_special.py", "toolkit/network_mixins.py"):
        names |= set(re.findall(r"type\.lower\(\)\s*==\s*['\"](\w+)['\"]", _read(trainer, relative)))
    return names


def read_vocabulary(trainer: Path, python: Path | None = None, qtypes_cache: Path | None = None,
                    head: str | None = None) -> Vocabulary:
    """Every table that can be read from `trainer`; qtypes only when its `python` is given."""
    if not (trainer / "toolkit").is_dir():
        return Vocabulary()
    optimizer = _read(trainer, "toolkit/optimizer.py")
    return Vocabulary(
        section_keys=known_keys(trainer),
        model_kwargs=model_kwargs_keys(trainer),
        qtypes=trainer_qtypes(trainer, python, qtypes_cache, head) if python else None,
        optimizers=_found(r"lower_type\s*==\s*['\"](\w+)['\"]", optimizer),
        optimizer_prefixes=set(re.findall(r"lower_type\.startswith\(\s*['\"](\w+)['\"]", optimizer)),
        network_types=network_types(trainer),
        dtypes=_found(r"dtype_str\s*==\s*['\"](\w+)['\"]", _read(trainer, "toolkit/train_tools.py")),
        jobs=_found(r"job\s*==\s*['\"](\w+)['\"]", _read(trainer, "toolkit/job.py")),
        arches=trainer_arches(trainer),
    )


MODEL_CLASS_ARCH = re.compile(r"^\s+arch\s*=\s*['\"]([\w.\-]+)['\"]", re.M)


def trainer_arches(trainer: Path) -> set[str] | None:
    """The `arch` of every model class of the trainer's extensions (None: no extensions folder)."""
    folder = trainer / "extensions_built_in"
    if not folder.is_dir():
        return None
    found: set[str] = set()
    for path in sorted(folder.rglob("*.py")):
        found |= set(MODEL_CLASS_ARCH.findall(path.read_text(encoding="utf-8", errors="replace")))
    return found


def trainer_qtypes(trainer: Path, python: Path, cache: Path | None, head: str | None) -> set[str] | None:
    """The qtypes the trainer's get_qtype accepts; kept in the `cache` file for the checkout `head`."""
    cached = cache if head else None
    if cached is not None:
        data = load_json_state(cached)  # missing or damaged: {}, rewritten below
        if data.get("head") == head and isinstance(data.get("qtypes"), list):
            return set(data["qtypes"])
    result = run_module(python, "qtypes", "--trainer", str(trainer.resolve()), capture=True)
    try:
        names = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else None
    except (ValueError, IndexError):
        names = None
    if not isinstance(names, list) or not names:
        return None
    if cached is not None:
        replace_own(cached, json.dumps({"head": head, "qtypes": names}) + "\n")
    return set(names)
