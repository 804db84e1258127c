"""The memory plan of a preset before launching, by the trainer's own planner (the overlay's
`flux2_contract/memory_plan.py`, stdlib only, imported in-process from the contract package) for
every process whose `model_kwargs` say `memory_plan: auto` and give `vram_budget_gib`. A budget
below the resident minimum is refused here, with the numbers, before anything loads; `run
--dry-run` prints the plan, with or without a trainer venv. Without `vram_budget_gib` the trainer
plans from the VRAM free on the device at launch.

The trainer streams blocks only for the qtypes of its table (`qtypes.STREAMABLE`); with any other a
plan that streams is dropped and every block stays resident, under an allocator capped at the
budget. So a preset whose plan streams with such a qtype is refused here, not shown as a plan the
trainer would not carry out.

One launch asks the planner once for each ask (budget, run shape, and whether the qtype's 8-bit
weight copies may take what is left; `Planner`): `qtype: auto`, the printed plan and each card's
plan of `run --gpus N` share the answer where the qtype chosen leaves the ask as it was, and the
plan goes to the trainer with the config (model_kwargs `launch_plan`, with the ask it was made
for), which plans again only where it finds another, and says so.
"""

import json
from pathlib import Path

from flux2_contract import memory_plan, qtypes, settings
from launcher.errors import LauncherError

DESKTOP_GIB = 1.5
"""What a desktop keeps of a card's VRAM while it trains (one display): left out of the
plan `run` predicts from a card's total VRAM (the trainer plans from what is really free)."""


def plans(kwargs: dict) -> bool:
    """Whether a process's model_kwargs (resolved by `run`) ask for a memory plan."""
    return settings.read(kwargs, "memory_plan") == "auto"


def budget_words(kwargs: dict) -> tuple[str, float]:
    """The budget as the preset gives it, less the margin: words for a message, and the GiB left."""
    margin = settings.read(kwargs, "vram_margin_gib")
    default = " (the default)" if margin == settings.CATALOGUE["vram_margin_gib"].default else ""
    left = float(kwargs["vram_budget_gib"]) - float(margin)
    return (f"model_kwargs vram_budget_gib {kwargs['vram_budget_gib']} GiB less vram_margin_gib {margin} GiB"
            f"{default} leaves {max(left, 0):g} GiB for the plan"), left


def streams_on(process: dict, vram_gib: float | None, planner: "Planner | None" = None) -> bool:
    """Whether a process's memory plan may stream blocks on a card of `vram_gib` (total): its
    preset budget, else the card's less a desktop's share, planned by the trainer's own rule; an
    unknown card may stream, and so may a budget the trainer would refuse."""
    kwargs = (process.get("model") or {}).get("model_kwargs") or {}
    if not plans(kwargs):
        return False
    budget = kwargs.get("vram_budget_gib") or (vram_gib - DESKTOP_GIB if vram_gib else None)
    if budget is None:
        return True
    try:
        return bool((planner or Planner()).plan(process, float(budget)).streamed())
    except memory_plan.PlanError:
        return True


def resolutions(process: dict) -> list:
    """Every resolution a process's datasets train at (a dataset's one value or its list; 512 unset)."""
    found = []
    for dataset in process.get("datasets") or []:
        value = dataset.get("resolution", 512)
        found += value if isinstance(value, list) else [value]
    return found


def plan_inputs(process: dict, budget_gib: float | None = None) -> tuple:
    """What the trainer's planner is asked for one process of a rendered config, from its preset
    budget (or `budget_gib`), run shape, attention kernels, qtype and compiled blocks: plan_for_budget's
    arguments."""
    model = process.get("model") or {}
    kwargs = model.get("model_kwargs") or {}
    return (budget_gib or float(kwargs["vram_budget_gib"]), max(resolutions(process), default=1024),
            (process.get("train") or {}).get("batch_size", 1), (process.get("network") or {}).get("linear", 32),
            2 if kwargs.get("stream_mode") == "overlapped" else 1, kwargs.get("flux2_params") or {},
            float(settings.read(kwargs, "vram_margin_gib")), kwargs.get("sdpa_kernels") == "math",
            memory_plan.holds_8bit_copies(model.get("qtype"), kwargs), kwargs.get("compile_blocks") is True)


def plan_for(process: dict, budget_gib: float | None = None):
    """The trainer's plan for one process of a rendered config, from its preset budget (or
    `budget_gib`) and run shape."""
    return memory_plan.plan_for_budget(*plan_inputs(process, budget_gib))


class Planner:
    """The trainer's planner asked once per launch for each ask: the same budget and run shape
    get the same plan (or the same refusal) without planning again."""

    def __init__(self) -> None:
        self.answers: dict[str, object] = {}

    def plan(self, process: dict, budget_gib: float | None = None):
        """plan_for, answered from what this launch already planned where it can."""
        ask = json.dumps(plan_inputs(process, budget_gib), sort_keys=True, default=str)
        if ask not in self.answers:
            try:
                self.answers[ask] = plan_for(process, budget_gib)
            except memory_plan.PlanError as error:
                self.answers[ask] = error
        answer = self.answers[ask]
        if isinstance(answer, Exception):
            raise answer
        return answer


def check_plans(config: dict, preset_path: Path, planner: Planner) -> list[str]:
    """The plan's lines for each planned process; LauncherError when the trainer would refuse the budget."""
    lines = []
    for index, process in enumerate(config["config"]["process"]):
        model = process.get("model") or {}
        kwargs = model.get("model_kwargs") or {}
        if not plans(kwargs):
            continue
        if kwargs.get("vram_budget_gib") is None:
            lines.append("memory plan: made at launch from the VRAM free on the training device "
                         "(the preset gives no vram_budget_gib)")
            continue
        words, left = budget_words(kwargs)
        if left <= 0:
            raise LauncherError(f"{preset_path}: {words}; give a larger vram_budget_gib or a smaller vram_margin_gib")
        try:
            plan = planner.plan(process)
        except memory_plan.PlanError as error:
            raise LauncherError(f"{preset_path}: {words}: {error}") from None
        refuse_unstreamable(plan.to_json(), model, kwargs, f"{preset_path}: config.process[{index}].model")
        lines += plan.summary() + ["  (from the preset's vram_budget_gib, handed to the trainer: it plans again "
                                   "where it finds other free VRAM or loaded block sizes)"]
    return lines


def launch_plans(config: dict, planner: Planner) -> list[str | None]:
    """Per process, what `run` hands the trainer as model_kwargs launch_plan (files.hand_over): the
    plan this launch made for its preset budget with what it was made for, from the planner's
    answers (check_plans asked it); None where the trainer plans from the VRAM it finds."""
    handed = []
    for process in config["config"]["process"]:
        kwargs = (process.get("model") or {}).get("model_kwargs") or {}
        if not plans(kwargs) or kwargs.get("vram_budget_gib") is None:
            handed.append(None)
            continue
        handed.append(memory_plan.hand_over(memory_plan.ask_for_budget(*plan_inputs(process)), planner.plan(process)))
    return handed


def refuse_unstreamable(plan: dict, model: dict, kwargs: dict, where: str) -> None:
    """A plan that streams blocks, for a qtype the trainer does not stream: it would keep every
    block resident under the budget's allocator cap instead."""
    streamable = qtypes.STREAMABLE
    blocks = plan.get("blocks") or []
    streamed = sum(1 for block in blocks if block.get("weights") == "streamed")
    qtype = model.get("qtype") or "qfloat8 (the trainer's default)"
    if streamed and qtype not in streamable:
        raise LauncherError(
            f"{where}.qtype {qtype} cannot stream blocks (only {' and '.join(streamable)} can): the trainer would "
            f"keep all {len(blocks)} blocks resident, where the plan for vram_budget_gib {kwargs['vram_budget_gib']} "
            f"streams {streamed}; set qtype auto (the fastest of these that `python -m launcher selftest` passed) or "
            f"one of them, or give a vram_budget_gib that holds every block")


def card_plans(config: dict, cards: tuple[dict, ...], planner: Planner | None = None) -> list[str]:
    """`run --gpus N`: the plan each rank makes for its own card (the preset's budget, else the card's
    total less a desktop's share), card by card; ranks step together, so the slower card sets the pace."""
    if len(cards) < 2:
        return []
    planner = planner or Planner()
    lines = []
    for index, card in enumerate(cards):
        for process in config["config"]["process"]:
            kwargs = (process.get("model") or {}).get("model_kwargs") or {}
            total = card.get("vram_total_gib")
            if not plans(kwargs) or not (kwargs.get("vram_budget_gib") or total):
                continue
            budget = float(kwargs.get("vram_budget_gib") or total - DESKTOP_GIB)
            head = f"GPU {index} ({card.get('name')}, {total} GiB), budget {budget:g} GiB:"
            try:
                lines += [head] + [f"  {line}" for line in planner.plan(process, budget).summary()]
            except memory_plan.PlanError as error:
                lines.append(f"{head} {error}")
    if lines:
        lines.append("each rank plans its own card and every step waits for the slowest rank: the card that "
                     "streams the most sets the pace of all")
    return lines
