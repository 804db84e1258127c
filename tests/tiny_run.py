"""The one way tests run the embedded tiny preset: `python -m launcher run presets/tiny.yaml`.

Tests that need a real training run write a variant of `presets/tiny.yaml` (more steps, other
saves, extra environment) with `tiny_preset` and start it with `run_tiny`, or build the command
with `run_command` when they must watch the process themselves. Standard library and PyYAML
only: the in-trainer suite (tests/trainer_patches) imports it under the trainer's interpreter.
"""

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TINY_PRESET = REPO / "presets" / "tiny.yaml"
RUN_NAME = "tiny_flux2"
"""The tiny preset's job name: its run folder is <output>/tiny_flux2, its LoRA tiny_flux2.safetensors."""


def tiny_preset(path: Path, *, name: str | None = None, steps: int | None = None, save: dict | None = None,
                env: dict | None = None, launcher: dict | None = None, train: dict | None = None,
                model: dict | None = None, process: dict | None = None) -> Path:
    """Write presets/tiny.yaml to `path` with these changes; returns `path`.

    `save`, `train`, `model` and `process` update those blocks of the trainer process, `env` the
    `launcher: env:` variables and `launcher` the rest of the launcher block.
    """
    data = yaml.safe_load(TINY_PRESET.read_text(encoding="utf-8"))
    block = data["config"]["process"][0]
    if name is not None:
        data["config"]["name"] = name
    if steps is not None:
        block["train"]["steps"] = steps
    for key, changes in (("save", save), ("train", train), ("model", model)):
        block[key].update(changes or {})
    block.update(process or {})
    data["launcher"].update(launcher or {})
    data["launcher"].setdefault("env", {}).update(env or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def run_command(workdir: Path, preset: Path = TINY_PRESET, output: Path | None = None, *extra: str,
                python: str = sys.executable) -> list[str]:
    """The `launcher run` command line for `preset` in `workdir` (a workdir root)."""
    command = [python, "-m", "launcher", "run", str(preset), "--workdir", str(workdir)]
    if output is not None:
        command += ["--output", str(output)]
    return command + list(extra)


def run_tiny(workdir: Path, preset: Path = TINY_PRESET, output: Path | None = None, *extra: str,
             python: str = sys.executable, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `preset` to the end from the repository root; stdout holds stdout and stderr, in order.

    `python` is the interpreter the launcher runs under (it needs GitPython: the in-trainer
    suite passes the launcher's own); `env` replaces the environment when given.
    """
    return subprocess.run(
        run_command(workdir, preset, output, *extra, python=python), cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
    )
