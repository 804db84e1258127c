"""`run --resume`: the new config against the one the run was trained with.

The trainer resumes from whatever LoRA and optimizer state it finds in the job folder, with
whatever config it is given now: a smaller rank makes it shrink the saved LoRA, a larger one
zero-pads it, another optimizer drops the saved state, and then it overwrites the LoRA and
config.yaml, exit 0. So before a resume every difference to the run's config.yaml is listed.
Changes to what shapes the saved LoRA and optimizer state (the network, the model's architecture
and shape, the optimizer, the training precision) are always refused. How the run is carried out
is free: where the model and dataset are, and every setting the settings catalogue
(flux2_contract/settings.py) marks `resume_may_change`: `qtype` to one with the same 4-bit codes,
and model_kwargs such as the text encoder, the caches, the memory plan, streaming and compile
settings (which `auto` may resolve differently after a self-test), and what `run` writes for each
launch (telemetry, profiler, rank state).
Any other change (steps, save cadence, learning rate...) needs `--accept-changes`, and is then
recorded in run.json.
"""

from pathlib import Path

from flux2_contract import qtypes, settings
from launcher.errors import LauncherError
from launcher.progress import say
from launcher.runs.folders import read_run_config
from launcher.runs.schema import short

# (key path inside a process, what a change there does to a resumed run)
LOCKED = (
    (("network",), "the network the saved LoRA was trained as"),
    (("model", "arch"), "the model the saved LoRA was trained on"),
    (("model", "model_kwargs", "flux2_params"), "the transformer's shape, which the saved LoRA has"),
    (("train", "optimizer"), "the optimizer whose state is saved"),
    (("train", "optimizer_params"), "the optimizer whose state is saved"),
    (("train", "dtype"), "the training precision"),
)
FREE = (
    # how the run is carried out, not what it trains: no flag needed, said in one line each (and every
    # catalogue setting marked resume_may_change, flux2_contract/settings.py: see is_free)
    ("model", "name_or_path"),
    ("datasets", "*", "folder_path"),
    ("datasets", "*", "dataset_path"),
    ("training_folder",),
)
ACCEPT_FLAG = "--accept-changes"


def differences(old, new, path: str = "") -> list[tuple[str, object, object]]:
    """(key path, old value, new value) for every leaf that differs; a missing key is None."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in [*old, *(k for k in new if k not in old)]:
            found += differences(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [item for index, (a, b) in enumerate(zip(old, new)) for item in differences(a, b, f"{path}[{index}]")]
    return [] if old == new else [(path, old, new)]


def _inside(path: str) -> tuple[str, ...] | None:
    """The key path inside one trainer process, without list indexes, or None outside the processes."""
    parts = path.replace("[", ".").replace("]", "").split(".")
    if parts[:2] == ["config", "process"] and len(parts) > 3:
        return tuple(parts[3:])
    return None


def locked_reason(path: str) -> str | None:
    """What a change at `path` would break in a resumed run, or None when it is only a setting."""
    inside = _inside(path)
    for prefix, reason in LOCKED if inside else ():
        if inside[: len(prefix)] == prefix:
            return reason
    return None


def is_free(path: str, old, new) -> bool:
    """A change in how the run is carried out, which leaves the saved LoRA and optimizer state valid."""
    inside = _inside(path)
    if inside is None:
        return False
    block = {("model",): settings.MODEL, ("model", "model_kwargs"): settings.MODEL_KWARGS}.get(inside[:-1])
    setting = settings.CATALOGUE.get(inside[-1])
    if setting is not None and setting.block == block:
        if setting.resume_may_change == settings.SAME_CODES:
            return qtypes.same_codes(old, new)
        return setting.resume_may_change is True
    return any(len(inside) == len(free) and all(f in ("*", part) for f, part in zip(free, inside)) for free in FREE)


def check_changes(config_file: Path, config: dict, accept: bool) -> list[dict]:
    """Refuse a resume whose config changes what was trained; return the accepted changes."""
    if not config_file.is_file():
        raise LauncherError(f"{config_file} is missing, so this resume cannot be checked against the config the "
                            "run was trained with; restore it, or start a new run with another --output")
    changes = differences(read_run_config(config_file.parent), config)
    for path, old, new in changes:
        if is_free(path, old, new):
            say(f"resume: {path} was {short(old)}, now {short(new)} (how the run is carried out; the saved LoRA "
                "and optimizer state stay valid)")
    changes = [(path, old, new) for path, old, new in changes if not is_free(path, old, new)]
    if not changes:
        return []
    locked = [(path, old, new, locked_reason(path)) for path, old, new in changes if locked_reason(path)]
    shown = locked or [(path, old, new, None) for path, old, new in changes]
    lines = [f"  {path}: the run has {short(old)}, now {short(new)}" + (f" ({reason})" if reason else "")
             for path, old, new, reason in shown]
    if locked:
        raise LauncherError(
            f"cannot resume {config_file.parent}: the preset changes what the run was trained with:\n"
            + "\n".join(lines) + "\nThe trainer would reshape or drop the saved LoRA and optimizer state. "
            "Put these values back to resume, or start a new run with another --output.")
    if not accept:
        raise LauncherError(
            f"the preset differs from the run's config in {config_file}:\n" + "\n".join(lines)
            + f"\nResume with these changes by adding {ACCEPT_FLAG} (they are recorded in run.json), "
            "put the values back, or start a new run with another --output.")
    return [{"key": path, "was": old, "now": new} for path, old, new in changes]
