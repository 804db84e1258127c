"""What `sample` checks before anything loads: prompts, strengths, size, checkpoint, and a run not training.

Everything here reads only small files (the run's config, safetensors headers, the run lock),
so a bad request is refused in a moment, before the model's minutes of loading.
"""

from pathlib import Path

from launcher.errors import LauncherError
from launcher.runs import prompts, run_lock
from launcher.runs.folders import RunFolder

SIZE_STEP = 16  # the FLUX.2 VAE's 8x downsampling and the transformer's 2x2 patches
MIN_SIZE, MAX_SIZE = 64, 2048
DEFAULT_STRENGTHS = (0.0, 1.0)
IN_TRAINING = ("set `sample: {sample_every: N}` and `train: {disable_sampling: false}` in the preset to sample "
               "inside the training process, or `python -m launcher save` and sample once it has stopped")


def default_prompts(config: dict) -> list[str]:
    """The preset's `sample.prompts`, else the dataset's first caption with the trigger word."""
    process = config["config"]["process"][0]
    trigger = process.get("trigger_word")
    listed = (process.get("sample") or {}).get("prompts") or []
    if listed:
        return [prompts.with_trigger(p, trigger) if isinstance(p, str) and p.strip() else p for p in listed]
    caption = prompts.caption_prompt(config)
    return [caption] if caption else []


def check_prompts(prompts: list, source: str) -> list[str]:
    if not prompts:
        raise LauncherError(f"no prompt to sample: {source} lists none and the dataset has no caption; "
                            "pass --prompt \"...\" (once per prompt)")
    bad = [p for p in prompts if not isinstance(p, str) or not p.strip()]
    if bad:
        raise LauncherError(f"{source}: every prompt must be non-empty text; not text: {bad[:3]!r}")
    return prompts


def parse_strengths(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise LauncherError(f"--strength {text!r}: give numbers separated by commas, e.g. 0,1") from None
    if not values or any(v != v or abs(v) == float("inf") for v in values):
        raise LauncherError(f"--strength {text!r}: give finite numbers separated by commas, e.g. 0,1")
    return values


def check_size(size: int) -> int:
    if size % SIZE_STEP or not MIN_SIZE <= size <= MAX_SIZE:
        raise LauncherError(f"--size {size}: FLUX.2 takes a multiple of {SIZE_STEP} from {MIN_SIZE} to "
                            f"{MAX_SIZE} px (e.g. 512, 768, 1024)")
    return size


def check_not_training(run: RunFolder) -> None:
    """A run whose trainer lives holds run.lock; sampling beside it would need a second model copy."""
    if run_lock.is_held(run.root):
        raise LauncherError(f"{run.root} is still training ({run_lock.holder(run.root)}): a second process would "
                            f"load a second copy of the model; {IN_TRAINING}")


def sample_folder(run: RunFolder, lora: Path) -> Path:
    """`<run>/samples/<step>/`: the step from the LoRA's name, `final` for the last save."""
    step = run.saved_step(lora)
    return run.samples / ("final" if step is None else str(step))
