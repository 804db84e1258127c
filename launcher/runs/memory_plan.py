"""The memory plan of a preset before launching: asked from the trainer's own planner
(`launcher.in_trainer.memory_plan` under the trainer's interpreter) for every process whose
`model_kwargs` say `memory_plan: auto` and give `vram_budget_gib`. A budget below the resident
minimum is refused here, with the numbers, before anything loads; `run --dry-run` prints the plan.
Without `vram_budget_gib` the trainer plans from the VRAM free on the device at launch.

The trainer streams blocks only for the int4 qtypes (overlay/toolkit/memory_budget.py); with any
other a plan that streams is dropped and every block stays resident, under an allocator capped at
the budget. So a preset whose plan streams with such a qtype is refused here, not shown as a plan
the trainer would not carry out.
"""

import json
from collections.abc import Callable
from pathlib import Path

from launcher.envs.trainer_python import run_module
from launcher.errors import LauncherError


DEFAULT_MARGIN_GIB = 1.0
"""The trainer's vram_margin_gib when the preset gives none (overlay/toolkit/memory_plan.py)."""
STREAMING_QTYPES = ("int4_fused", "int4_w4a8")
"""The qtypes whose blocks the trainer streams (INT4_QTYPES of overlay/toolkit/memory_budget.py)."""


def budget_words(kwargs: dict) -> tuple[str, float]:
    """The budget as the preset gives it, less the margin: words for a message, and the GiB left."""
    budget = float(kwargs["vram_budget_gib"])
    margin = float(kwargs.get("vram_margin_gib", DEFAULT_MARGIN_GIB))
    default = "" if "vram_margin_gib" in kwargs else " (the default)"
    left = budget - margin
    return (f"model_kwargs vram_budget_gib {kwargs['vram_budget_gib']} GiB less vram_margin_gib "
            f"{kwargs.get('vram_margin_gib', DEFAULT_MARGIN_GIB)} GiB{default} leaves {max(left, 0):g} GiB for the plan"), left


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
    for index, process in enumerate(config["config"]["process"]):
        model = process.get("model") or {}
        kwargs = model.get("model_kwargs") or {}
        if kwargs.get("memory_plan") != "auto":
            continue
        if kwargs.get("vram_budget_gib") is None:
            lines.append("memory plan: made at launch from the VRAM free on the training device "
                         "(the preset gives no vram_budget_gib)")
            continue
        words, left = budget_words(kwargs)
        if left <= 0:
            raise LauncherError(f"{preset_path}: {words}; give a larger vram_budget_gib or a smaller vram_margin_gib")
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
            raise LauncherError(f"{preset_path}: {words}: {answer['error']}")
        refuse_unstreamable(answer["plan"], model, kwargs, f"{preset_path}: config.process[{index}].model")
        lines += answer["summary"] + ["  (from the preset's vram_budget_gib; the trainer plans again from the "
                                      "sizes of the loaded blocks)"]
    return lines


def refuse_unstreamable(plan: dict, model: dict, kwargs: dict, where: str) -> None:
    """A plan that streams blocks, for a qtype the trainer does not stream: it would keep every
    block resident under the budget's allocator cap instead."""
    blocks = plan.get("blocks") or []
    streamed = sum(1 for block in blocks if block.get("weights") == "streamed")
    qtype = model.get("qtype") or "qfloat8 (the trainer's default)"
    if streamed and qtype not in STREAMING_QTYPES:
        raise LauncherError(
            f"{where}.qtype {qtype} cannot stream blocks (only {' and '.join(STREAMING_QTYPES)} can): the trainer would "
            f"keep all {len(blocks)} blocks resident, where the plan for vram_budget_gib {kwargs['vram_budget_gib']} "
            f"streams {streamed}; set qtype int4_fused or int4_w4a8 (`qtype: auto` picks one once `python -m launcher "
            f"selftest` has passed it), or give a vram_budget_gib that holds every block")
