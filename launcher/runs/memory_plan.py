"""The memory plan of a preset before launching: asked from the trainer's own planner
(`launcher.in_trainer.memory_plan` under the trainer's interpreter) for every process whose
`model_kwargs` say `memory_plan: auto` and give `vram_budget_gib`. A budget below the resident
minimum is refused here, with the numbers, before anything loads; `run --dry-run` prints the plan.
Without `vram_budget_gib` the trainer plans from the VRAM free on the device at launch.
"""

import json
from collections.abc import Callable
from pathlib import Path

from launcher.envs.trainer_python import run_module
from launcher.errors import LauncherError


def plan_arguments(process: dict) -> list[str]:
    """The planner's command-line arguments for one trainer process of a rendered config."""
    model = process.get("model") or {}
    kwargs = model.get("model_kwargs") or {}
    resolutions = []
    for dataset in process.get("datasets") or []:
        value = dataset.get("resolution", 512)
        resolutions += value if isinstance(value, list) else [value]
    args = ["--budget-gib", str(kwargs["vram_budget_gib"]), "--resolution", str(max(resolutions, default=1024)),
            "--batch", str((process.get("train") or {}).get("batch_size", 1)),
            "--rank", str((process.get("network") or {}).get("linear", 32)),
            "--in-flight", "2" if kwargs.get("stream_mode") == "overlapped" else "1",
            "--flux2-params", json.dumps(kwargs.get("flux2_params") or {})]
    if "vram_margin_gib" in kwargs:
        args += ["--margin-gib", str(kwargs["vram_margin_gib"])]
    return args


def check_plans(config: dict, python: Callable[[], Path | None], trainer: Path, preset_path: Path) -> list[str]:
    """The plan's lines for each planned process; LauncherError when the trainer refuses the budget.
    `python()` gives the trainer's interpreter, or None in a dry run without one (asked only when
    a budget is to be planned)."""
    lines = []
    for process in config["config"]["process"]:
        kwargs = (process.get("model") or {}).get("model_kwargs") or {}
        if kwargs.get("memory_plan") != "auto":
            continue
        if kwargs.get("vram_budget_gib") is None:
            lines.append("memory plan: made at launch from the VRAM free on the training device "
                         "(the preset gives no vram_budget_gib)")
            continue
        interpreter = python()
        if interpreter is None:
            lines.append(f"memory plan for vram_budget_gib {kwargs['vram_budget_gib']}: not shown, this workdir has "
                         f"no trainer venv yet (`python -m launcher setup`)")
            continue
        result = run_module(interpreter, "memory_plan", "--trainer", str(trainer.resolve()), *plan_arguments(process),
                            capture=True)
        try:
            answer = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise LauncherError(f"asking the trainer for the memory plan failed (exit {result.returncode}):\n"
                                f"{(result.stderr or result.stdout)[-2000:]}") from None
        if "error" in answer:
            raise LauncherError(f"{preset_path}: {answer['error']}")
        lines += answer["summary"] + ["  (from the preset's vram_budget_gib; the trainer plans again from the "
                                      "sizes of the loaded blocks)"]
    return lines
