"""The memory plan `run` hands the trainer (model_kwargs launch_plan, made by the overlay's
flux2_contract/memory_plan.py as launcher/runs/memory_plan.py makes it): before the transformer loads, the
trainer carries it out without planning where the budget bytes and run shape it finds are the
ones `run` planned for, and plans again, saying why, where they are not; once loaded, it plans
again only where the loaded block sizes differ from the ones the plan assumed. The plan carried
out is the one the trainer made on its own before the plan was handed over."""

from types import SimpleNamespace

import pytest
import torch
from test_memory_budget import Allocator

pytestmark = pytest.mark.first_target
GIB = 2**30
FLUX2_PARAMS = {"hidden_size": 64, "num_heads": 2, "depth": 2, "depth_single_blocks": 2, "mlp_ratio": 3.0,
                "context_in_dim": 32, "in_channels": 16}
PARAMS = SimpleNamespace(**FLUX2_PARAMS)
RUN = {"resolution": 256, "batch": 1, "lora_rank": 8, "copies": False, "compiled": False}


@pytest.fixture
def modules(trainer_on_path, monkeypatch):
    """memory_plan and memory_budget, with every call of the planner counted in `calls` and
    block_streaming.install recorded in `installed` (the plan is the point here, not the copies)."""
    from toolkit import block_streaming, memory_budget
    from flux2_contract import memory_plan

    calls, installed = [], []
    real = memory_budget.make_plan

    def counted(inputs):
        calls.append(inputs.budget_bytes)
        return real(inputs)

    monkeypatch.setattr(memory_budget, "make_plan", counted)
    monkeypatch.setattr(block_streaming, "install", lambda transformer, plan, device, mode: installed.append(plan))
    return SimpleNamespace(plan=memory_plan, budget=memory_budget, calls=calls, installed=installed)


def launch_plan(mp, budget_gib: float) -> str:
    """What `run` writes for a preset with this budget (serialized streaming, no margin)."""
    asked = (budget_gib, RUN["resolution"], RUN["batch"], RUN["lora_rank"], 1, FLUX2_PARAMS, 0)
    return mp.hand_over(mp.ask_for_budget(*asked), mp.plan_for_budget(*asked))


def settings(budget_gib: float, **more) -> dict:
    return {"memory_plan": "auto", "stream_mode": "serialized", "vram_budget_gib": budget_gib,
            "vram_margin_gib": 0, **more}


def base_model(kwargs: dict, run: dict = RUN, device: str = "cpu"):
    return SimpleNamespace(model_config=SimpleNamespace(model_kwargs=kwargs, qtype="int4_fused"),
                           device_torch=torch.device(device), memory_plan_run=dict(run))


class Holding(torch.nn.Module):
    def __init__(self, nbytes: int):
        super().__init__()
        self.register_buffer("weights", torch.zeros(nbytes, dtype=torch.uint8))


def transformer(blocks: dict, outside: int) -> torch.nn.Module:
    """A stand-in transformer whose blocks and the rest hold these bytes."""
    model = Holding(outside)
    for prefix in ("double_blocks", "single_blocks"):
        names = sorted((name for name in blocks if name.startswith(prefix)), key=lambda n: int(n.split(".")[1]))
        setattr(model, prefix, torch.nn.ModuleList(Holding(blocks[name]) for name in names))
    return model


def budgets(mp) -> dict:
    """A budget that keeps every block resident, and one that keeps only double_blocks.0 so."""
    whole = mp.plan_for_budget(1.0, RUN["resolution"], RUN["batch"], RUN["lora_rank"], 1, FLUX2_PARAMS, 0)
    sizes, _ = whole.assumed_sizes()
    partly = sum(whole.fixed_bytes.values()) + max(sizes.values()) + sizes["double_blocks.0"] + 1
    return {"resident": 1.0, "streamed": partly / GIB}


@pytest.mark.parametrize("case", ["resident", "streamed"])
@pytest.mark.parametrize("loaded", ["as planned", "larger"])
def test_the_handed_plan_is_carried_out_as_the_trainer_planned_before(modules, case, loaded, capsys):
    mp, mb = modules.plan, modules.budget
    budget_gib = budgets(mp)[case]
    budget = int(budget_gib * GIB)
    own = mb.plan_for(settings(budget_gib), PARAMS, RUN, budget)  # what the trainer planned on its own
    assumed, outside = own.assumed_sizes()
    extra = 0 if loaded == "as planned" else 4096
    blocks = {name: nbytes + extra for name, nbytes in assumed.items()}
    carried_before = mb.plan_for(settings(budget_gib), PARAMS, RUN, budget, weight_bytes=blocks,
                                 nonblock_bytes=outside)
    modules.calls.clear()

    model = base_model(settings(budget_gib, launch_plan=launch_plan(mp, budget_gib)))
    plan = mb.before_load(model, PARAMS)
    assert modules.calls == [], "the trainer planned although run's plan was made for what it found"
    assert plan.to_json() == own.to_json()
    carried = mb.after_load(model, transformer(blocks, outside), PARAMS, plan)
    out = capsys.readouterr().out
    assert modules.installed == [carried] and carried.to_json() == carried_before.to_json()
    assert (len(carried.streamed()) > 0) == (case == "streamed")
    if loaded == "as planned":
        assert modules.calls == [] and carried is plan and "planning again" not in out
    else:
        assert modules.calls == [budget]
        assert "memory plan: 4 of 4 loaded blocks differ from the sizes planned from the shapes" in out
        assert "planning again from the loaded sizes" in out


def test_other_free_vram_plans_again_and_says_so(modules, monkeypatch, capsys):
    mp, mb = modules.plan, modules.budget
    in_use = 256 * 1024  # the card holds tensors run could not know of
    budget_gib = budgets(mp)["streamed"] + in_use / GIB
    Allocator(in_use=in_use, cached=0).install(monkeypatch)
    model = base_model(settings(budget_gib, launch_plan=launch_plan(mp, budget_gib)), device="cuda")
    plan = mb.before_load(model, PARAMS)
    found = int(budget_gib * GIB) - in_use
    assert modules.calls == [found] and plan.budget_bytes == found
    lines = [line for line in capsys.readouterr().out.splitlines() if "planning again" in line]
    assert lines == [f"memory plan: {mp.size(found)} found, not the {mp.size(int(budget_gib * GIB))} "
                     "`run` planned for: planning again"]
    assert plan.to_json() == mb.plan_for(settings(budget_gib), PARAMS, RUN, found).to_json()


def test_another_run_shape_plans_again_and_says_so(modules, capsys):
    mp, mb = modules.plan, modules.budget
    budget_gib = budgets(mp)["resident"]
    model = base_model(settings(budget_gib, launch_plan=launch_plan(mp, budget_gib)), run={**RUN, "batch": 2})
    plan = mb.before_load(model, PARAMS)
    assert modules.calls == [int(budget_gib * GIB)] and plan.batch == 2
    assert "memory plan: batch 2 found, not the 1 `run` planned for: planning again" in capsys.readouterr().out


def test_a_launch_plan_run_did_not_write_is_named_and_planned_again(modules, capsys):
    mb = modules.budget
    model = base_model(settings(1.0, launch_plan='{"plan": {}}'))
    assert mb.before_load(model, PARAMS).budget_bytes == GIB and len(modules.calls) == 1
    out = capsys.readouterr().out
    assert "memory plan: model_kwargs launch_plan is not a plan `python -m launcher run` wrote" in out
    assert out.rstrip().endswith(": planning again")


class Trainable(torch.nn.Module):
    """An unquantized block: its weights still require grad when the plan measures them."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(nbytes // 2, dtype=torch.bfloat16))


def test_block_weights_that_require_grad_at_load_are_planned_as_always_resident(modules):
    """An unquantized base (its weights require grad until the trainer freezes them) is not planned
    as weightless: its block tensors stay on the device (streaming moves frozen tensors only), so
    they count with the weights outside the blocks."""
    mb = modules.budget
    blocks = {"double_blocks.0": 4096, "single_blocks.0": 2048}
    loaded = Holding(512)
    loaded.double_blocks = torch.nn.ModuleList([Trainable(blocks["double_blocks.0"])])
    loaded.single_blocks = torch.nn.ModuleList([Holding(blocks["single_blocks.0"])])
    plan = SimpleNamespace(blocks=[SimpleNamespace(name=name) for name in blocks])
    assert mb.measured(loaded, plan) == ({"double_blocks.0": 0, "single_blocks.0": 2048}, 512 + 4096)


def test_a_replan_that_would_stream_a_qtype_streaming_does_not_carry_keeps_every_block_resident(modules, capsys):
    """Frozen blocks of a qtype outside the streamable ones, loaded larger than planned: the plan from
    the loaded sizes would stream, so it is dropped (every block resident, as without a plan), and said."""
    mp, mb = modules.plan, modules.budget
    whole = mp.plan_for_budget(1.0, RUN["resolution"], RUN["batch"], RUN["lora_rank"], 1, FLUX2_PARAMS, 0)
    sizes, outside = whole.assumed_sizes()
    budget_gib = (sum(whole.fixed_bytes.values()) + sum(sizes.values()) + 1) / GIB  # every block resident, just
    model = base_model(settings(budget_gib))
    model.model_config.qtype = "qfloat8"
    plan = mb.before_load(model, PARAMS)
    assert plan is not None and not plan.streamed()
    grown = {name: nbytes + 4096 for name, nbytes in sizes.items()}
    assert mb.after_load(model, transformer(grown, outside), PARAMS, plan) is None
    out = capsys.readouterr().out
    assert "4 of 4 loaded blocks differ" in out and "(this run: qtype qfloat8): every block resident" in out
    assert modules.installed == []
