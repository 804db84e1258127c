"""What `run` does with a preset's memory plan before launching: `stream_mode: auto` follows the
self-test's overlapped-streaming result (serialized unless it passed on a GPU), and a preset's
`vram_budget_gib` is planned by the trainer's own planner: printed by `--dry-run`, refused with
the numbers when it cannot hold the resident minimum."""

import pytest
import yaml
from test_selftest import GPU_RESULT, workdir_with
from tiny_run import tiny_preset

from launcher import resolve
from launcher.cli import main
from launcher.runs import files, resume
from launcher.selftest.verdict import Verdicts


def planned(mode=None):
    kwargs = {"memory_plan": "auto"} if mode is None else {"memory_plan": "auto", "stream_mode": mode}
    return {"config": {"process": [{"model": {"model_kwargs": kwargs}}]}}


def resolved(config, workdir):
    """What `run` says of the stream mode of the config's one process, which takes the resolved process."""
    processes = config["config"]["process"]
    processes[0], line = resolve.stream_mode(processes[0], Verdicts.read(workdir))
    return line


def stream_mode(config):
    return config["config"]["process"][0]["model"]["model_kwargs"]["stream_mode"]


PASSED = {"passed": True, "completed": True, "device": "cuda", "steps": 40, "seconds": 20.1}


@pytest.mark.parametrize("streaming, mode, why", [
    (None, "serialized", "overlapped streaming was not tested on a GPU"),
    (PASSED, "overlapped", "overlapped streaming completed in 20 s"),
    ({**PASSED, "device": "cpu"}, "serialized", "not tested on a GPU"),
    ({"passed": False, "completed": False, "reason": "did not finish within its 120 s deadline"}, "serialized",
     "did not finish within its 120 s deadline"),
])
def test_stream_mode_auto_follows_the_selftest(tmp_path, streaming, mode, why):
    result = {**GPU_RESULT, **({"streaming": streaming} if streaming else {})}
    config = planned()
    line = resolved(config, workdir_with(tmp_path, result))
    assert stream_mode(config) == mode
    assert line.startswith(f"stream_mode auto -> {mode}: ") and why in line and "NVIDIA H200" in line


def test_stream_mode_without_a_selftest_is_serialized_and_a_named_mode_stays(tmp_path):
    workdir = workdir_with(tmp_path, None)
    config = planned()
    assert "no self-test result" in resolved(config, workdir)
    assert stream_mode(config) == "serialized"
    config = planned("overlapped")
    assert resolved(config, workdir) is None and stream_mode(config) == "overlapped"
    assert resolved({"config": {"process": [{"model": {}}]}}, workdir) is None


def tiny_planned(tmp_path, budget_gib):
    kwargs = {"memory_plan": "auto", "vram_budget_gib": budget_gib, "vram_margin_gib": 0}
    return tiny_preset(tmp_path / "tiny.yaml", model={"qtype": "int4_fused", "model_kwargs": kwargs})


@pytest.mark.trainer
def test_dry_run_prints_the_trainers_plan_and_refuses_a_budget_below_the_minimum(trainer_workdir, tmp_path, capsys):
    workdir = str(trainer_workdir.root)
    assert main(["run", str(tiny_planned(tmp_path, 0.5)), "--dry-run", "--workdir", workdir]) == 0
    out = capsys.readouterr().out
    assert "# stream_mode auto -> serialized" in out
    assert "# memory plan: budget 0.50 GiB, 128 px, batch 1" in out
    assert "#   weights: 2 of 2 blocks resident" in out and "#   kept: double_blocks.0, single_blocks.0" in out

    path = tiny_planned(tmp_path, 0.0001)
    assert main(["run", str(path), "--dry-run", "--workdir", workdir]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "a VRAM budget of 0.10 MiB cannot hold the resident minimum of 3." in err
    assert "LoRA + optimizer" in err and "vram_budget_gib" in err


def budgeted_run(budget_gib=None, **kwargs) -> dict:
    kwargs = {"memory_plan": "auto", "launch_plan": '{"written": "by hand"}', **kwargs}
    if budget_gib is not None:
        kwargs["vram_budget_gib"] = budget_gib
    process = {"model": {"qtype": "int4_fused", "model_kwargs": kwargs}, "datasets": [{"resolution": [512]}]}
    return {"job": "extension", "config": {"name": "run", "process": [process]}}


def launched(config: dict, workdir, tmp_path) -> dict:
    """The config as `run` writes it for the trainer: resolved, then handed over."""
    resolution = resolve.resolve_run(config, Verdicts.read(workdir), "auto", tmp_path / "p.yaml")
    return files.hand_over(resolution.config, {}, {}, resolution.launch_plans)


def test_run_hands_its_plan_only_where_it_made_one(tmp_path):
    """A budget's plan replaces whatever launch_plan the preset wrote; without a budget the
    trainer plans from the VRAM it finds, and no launch_plan goes to it."""
    workdir = workdir_with(tmp_path, GPU_RESULT)
    for budget, handed in ((16, True), (None, False)):
        config = launched(budgeted_run(budget), workdir, tmp_path)
        kwargs = config["config"]["process"][0]["model"]["model_kwargs"]
        assert ("launch_plan" in kwargs) == handed
        assert not handed or kwargs["launch_plan"].startswith(f'{{"ask":{{"batch":1,"budget_bytes":{15 * 2**30},')


def test_a_resume_accepts_a_handed_plan_without_a_flag(tmp_path, capsys):
    """A run trained before `run` handed its plan over resumes with one, and with another
    plan (another budget), without --accept-changes."""
    workdir = workdir_with(tmp_path, GPU_RESULT)
    trained = launched(budgeted_run(16), workdir, tmp_path)
    del trained["config"]["process"][0]["model"]["model_kwargs"]["launch_plan"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(trained), encoding="utf-8")
    for budget in (16, 20):
        config = launched(budgeted_run(budget), workdir, tmp_path)
        changes = resume.check_changes(tmp_path / "config.yaml", config, accept=False)
        assert changes == [] and "launch_plan was None, now '{\"ask\"" in capsys.readouterr().out
