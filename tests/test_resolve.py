"""One launch resolves its `auto` settings from one read of the self-test report and asks the
trainer's memory planner once per ask: `qtype: auto` (may the plan stream?), the printed plan
and each card's plan share the answer, where the qtype chosen does not change the ask."""

import copy
import io
import os

from test_run import dry_run, rendered_config
from test_selftest import GPU_RESULT, places, workdir_with  # noqa: F401  (places: the fixture)

from flux2_contract import memory_plan as planner, settings
from launcher import resolve
from launcher.runs import memory_plan
from launcher.selftest.verdict import Verdicts

BUDGETED = "inherits: base_512\nconfig:\n  process:\n    - model:\n        model_kwargs:\n          vram_budget_gib: 16\n"


def counting(calls: list, function, name: str):
    """`function`, with every call whose first argument names `name` noted in `calls`."""
    def counted(*args, **kwargs):
        if str(args[0] if args else kwargs.get("file", "")).endswith(name):
            calls.append(args[0])
        return function(*args, **kwargs)
    return counted


def test_a_launch_reads_the_selftest_once_and_plans_once(places, tmp_path, capsys, monkeypatch):  # noqa: F811
    workdir = workdir_with(tmp_path, GPU_RESULT)
    preset = tmp_path / "budgeted.yaml"
    preset.write_text(BUDGETED)
    reads, asks = [], []
    monkeypatch.setattr(io, "open", counting(reads, io.open, "selftest.json"))
    monkeypatch.setattr(os, "open", counting(reads, os.open, "selftest.json"))
    real = planner.plan_for_budget
    monkeypatch.setattr(planner, "plan_for_budget", lambda *args: asks.append(args) or real(*args))
    assert dry_run(places, str(preset), workdir=workdir.root) == 0
    out = capsys.readouterr().out
    assert out.startswith("# qtype auto -> int4_w4a8"), out[:300]  # the self-test decided it, and the others
    assert "# stream_mode auto -> serialized" in out and "# compile_blocks auto -> false" in out
    assert "# memory plan: budget 15.00 GiB, 512 px, batch 1" in out and "streamed: " in out
    model = rendered_config(out)["config"]["process"][0]["model"]
    assert model["model_kwargs"]["w4a8_gemm"] == "scaled_mm"
    assert len(reads) == 1, f"selftest.json read {len(reads)} times in one launch"
    # twice, each ask once: may a plan stream before the qtype is chosen, then the plan of int4_w4a8,
    # whose 8-bit weight copies (none here: the plan streams) are part of its ask
    assert [(args[0], args[-2]) for args in asks] == [(16.0, False), (16.0, True)], asks
    # the plan goes to the trainer with the config, with the budget bytes and run shape it was made for
    ask, handed = planner.handed(model["model_kwargs"]["launch_plan"])
    assert ask["budget_bytes"] == 15 * 2**30 and (ask["resolution"], ask["batch"], ask["in_flight"]) == (512, 1, 1)
    process = rendered_config(out)["config"]["process"][0]
    assert handed.to_json() == memory_plan.plan_for(process).to_json() and handed.streamed()


def test_cards_of_one_budget_share_the_launchs_plan(monkeypatch):
    """`run --gpus 2` with a preset budget: every rank plans that budget, so one plan serves all."""
    process = {"model": {"model_kwargs": {"memory_plan": "auto", "vram_budget_gib": 16}},
               "datasets": [{"resolution": [512]}], "train": {"batch_size": 1}, "network": {"linear": 32}}
    asks = []
    monkeypatch.setattr(planner, "plan_for_budget", counting(asks, planner.plan_for_budget, ""))
    plans = memory_plan.Planner()
    assert memory_plan.streams_on(process, None, plans)
    cards = ({"name": "RTX 4090", "vram_total_gib": 23.6}, {"name": "RTX 4080", "vram_total_gib": 15.6})
    lines = memory_plan.card_plans({"config": {"process": [process]}}, cards, plans)
    assert lines[0] == "GPU 0 (RTX 4090, 23.6 GiB), budget 16 GiB:" and "GPU 1 (RTX 4080, 15.6 GiB), budget 16 GiB:" in lines
    assert len(asks) == 1


def test_a_selftest_that_saw_no_gpu_decides_qtype_auto(tmp_path):
    """A self-test of a machine without a GPU names no card: a plan there may stream, so
    `qtype: auto` takes the streamable fallback (this once stopped `run` with an AttributeError)."""
    no_gpu = {**GPU_RESULT, "environment": {"gpu": None}, "fastest": {"qtype": None, "reason": "saw no GPU"}}
    config = {"config": {"process": [{"model": {"qtype": "auto", "model_kwargs": {"memory_plan": "auto"}}}]}}
    resolution = resolve.resolve_run(config, Verdicts.read(workdir_with(tmp_path, no_gpu)), "auto", tmp_path / "p.yaml")
    assert resolution.config["config"]["process"][0]["model"]["qtype"] == "int4_fused"
    assert config["config"]["process"][0]["model"]["qtype"] == "auto", "the rendered config stays as it was"
    assert resolution.lines[0].startswith("qtype auto -> int4_fused (plain-PyTorch path") and "saw no GPU" in resolution.lines[0]


def test_resolving_leaves_the_rendered_config_and_writes_no_auto(tmp_path):
    """An `auto` that does not apply (a stream mode without a plan, a kernel of another qtype) takes the
    catalogue's default in the resolved config; the rendered config `run` resolved is left as it was."""
    kwargs = {"stream_mode": "auto", "w4a8_gemm": "auto", "compile_blocks": "auto"}
    rendered = {"config": {"process": [{"model": {"qtype": "int4_fused", "model_kwargs": kwargs}, "train": {}}]}}
    before = copy.deepcopy(rendered)
    resolution = resolve.resolve_run(rendered, Verdicts.read(workdir_with(tmp_path, None)), "auto", tmp_path / "p.yaml")
    resolved = resolution.config["config"]["process"][0]
    assert rendered == before
    assert resolved["model"]["model_kwargs"]["stream_mode"] == settings.CATALOGUE["stream_mode"].default
    assert resolved["model"]["model_kwargs"]["w4a8_gemm"] == settings.CATALOGUE["w4a8_gemm"].default
    assert resolved["model"]["model_kwargs"]["compile_blocks"] is False
    assert "auto" not in resolved["model"]["model_kwargs"].values()
    assert resolved["train"]["disable_sampling"] is True and "disable_sampling" not in rendered["config"]["process"][0]["train"]
