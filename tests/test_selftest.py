"""`selftest`, and what `qtype: auto` becomes from its result (`run`, `doctor`).

The self-test itself runs in the trainer venv on this CPU machine: no GPU, so it must say so,
check the reference paths (quality gate, tiny training steps) and pick nothing. The choice of
`qtype: auto` is tested on stored results of each kind: none, stale, no GPU, a GPU that passed.
"""

import json

import pytest
import test_run
from test_run import dry_run

from launcher import resolve
from launcher.cli import main
from launcher.selftest import verdict
from launcher.envs.workdir import Workdir
from launcher.runs import disk_budget, memory_plan
from launcher.runs.schema import check_preset

places = test_run.places  # the fake model, encoder and dataset folders of test_run

GPU_RESULT = {
    "created": "2026-11-30T10:21:00+0000",
    "environment": {"gpu": {"name": "NVIDIA H200", "vram_gib": 139.8, "arch": "sm_90"}, "fp8_units": True},
    "fastest": {"qtype": "int4_w4a8", "candidate": "int4_w4a8 fp8 scaled_mm", "step_ms": 1318.5, "x_bf16": 0.94,
                "kernel": {"w4a8_activations": "fp8", "w4a8_gemm": "scaled_mm"}},
}


def workdir_with(tmp_path, result: dict | None, state: dict | None = None) -> Workdir:
    workdir = Workdir(tmp_path / "wd")
    workdir.root.mkdir(parents=True, exist_ok=True)
    workdir.state_file.write_text(json.dumps(state or {"target": "amd-fork", "commit": "abc", "patches": {"p": "1"}}))
    if result is not None:
        stamped = {**result, "trainer": verdict.trainer_build(workdir)}
        workdir.selftest.write_text(json.dumps(stamped))
    return workdir


def qtype_auto(workdir: Workdir) -> verdict.QtypeChoice:
    """What `qtype: auto` becomes where no memory plan streams blocks."""
    return verdict.Verdicts.read(workdir).qtype(streams=False)


def test_auto_without_a_selftest_is_uint4_and_says_how_to_test(tmp_path):
    choice = qtype_auto(workdir_with(tmp_path, None))
    assert choice.qtype == "uint4" and choice.kernel == {}
    assert "no self-test result" in choice.line and "python -m launcher selftest" in choice.line


def test_auto_follows_the_fastest_that_passed_with_its_kernel(tmp_path):
    choice = qtype_auto(workdir_with(tmp_path, GPU_RESULT))
    assert choice.qtype == "int4_w4a8"
    assert choice.kernel == {"w4a8_activations": "fp8", "w4a8_gemm": "scaled_mm"}
    assert "NVIDIA H200" in choice.line and "0.94x" in choice.line and "2026-11-30" in choice.line


def test_a_result_from_another_trainer_build_is_stale(tmp_path):
    workdir = workdir_with(tmp_path, GPU_RESULT)
    workdir.state_file.write_text(json.dumps({"target": "amd-fork", "commit": "abc", "patches": {"p": "2"}}))
    choice = qtype_auto(workdir)
    assert choice.qtype == "uint4" and "stale" in choice.line and "another trainer build" in choice.line


def test_nothing_passed_falls_back_with_the_reason(tmp_path):
    failed = {**GPU_RESULT, "fastest": {"qtype": None, "reason": "no 4-bit kernel path passed its checks"}}
    choice = qtype_auto(workdir_with(tmp_path, failed))
    assert choice.qtype == "uint4" and "no 4-bit kernel path passed its checks" in choice.line


def test_a_named_qtype_is_left_alone(tmp_path):
    process = {"model": {"qtype": "int4_fused", "model_kwargs": {}}}
    verdicts = verdict.Verdicts.read(workdir_with(tmp_path, GPU_RESULT))
    assert resolve.qtype(process, verdicts, memory_plan.Planner()) == (process, None)
    assert process["model"] == {"qtype": "int4_fused", "model_kwargs": {}}


def test_dry_run_renders_the_chosen_qtype_and_its_kernel(places, tmp_path, capsys, monkeypatch):
    """The choice reaches the trainer as concrete model_kwargs in the config, never as variables."""
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 100.0)  # this machine's disk is not the point
    workdir = workdir_with(tmp_path, GPU_RESULT)
    assert dry_run(places, "base_512.yaml", "--profile", "3", workdir=workdir.root) == 0
    out = capsys.readouterr().out
    config = test_run.rendered_config(out)  # the choice is a comment line in it
    assert config["config"]["process"][0]["model"]["qtype"] == "int4_w4a8"
    assert config["config"]["process"][0]["model"]["qtype_te"] == "uint4"
    assert out.startswith("# qtype auto -> int4_w4a8 (int4_w4a8 fp8 scaled_mm)")
    kwargs = config["config"]["process"][0]["model"]["model_kwargs"]
    assert (kwargs["w4a8_activations"], kwargs["w4a8_gemm"]) == ("fp8", "scaled_mm")
    assert all(kwargs[key] != "auto" for key in ("stream_mode", "compile_blocks", "w4a8_activations", "w4a8_gemm"))
    assert "INT4_" not in out
    for line in ("TRITON_CACHE_AUTOTUNING=1",
                 f"TRITON_CACHE_DIR={workdir.triton_cache}",
                 f"TORCHINDUCTOR_CACHE_DIR={workdir.inductor_cache}"):
        assert line in out, line
    assert (kwargs["profile_steps"], kwargs["profile_dir"]) == (3, str(workdir.runs / "flux2_base_512" / "profile"))


@pytest.mark.parametrize("preset", ["base_512.yaml", "7900xtx_512.yaml"])
def test_auto_on_a_card_whose_plan_may_stream_is_a_streamable_qtype(places, tmp_path, capsys, monkeypatch, preset):
    """The presets of 8-24 GB cards say `qtype: auto`: the self-test's pick (every one of them streams), and
    without one int4_fused on its plain-PyTorch path, never uint4, which a plan cannot stream."""
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 100.0)
    for result, qtype, kwargs in ((GPU_RESULT, "int4_w4a8", {"w4a8_activations": "fp8", "w4a8_gemm": "scaled_mm"}),
                                  (None, "int4_fused", {"int4_kernel": False})):
        workdir = workdir_with(tmp_path / str(result is None), result)
        assert dry_run(places, preset, workdir=workdir.root) == 0
        out = capsys.readouterr().out
        model = test_run.rendered_config(out)["config"]["process"][0]["model"]
        assert model["qtype"] == qtype and kwargs.items() <= model["model_kwargs"].items(), out[:400]
        assert out.startswith(f"# qtype auto -> {qtype}")


def test_an_old_preset_name_runs_its_preset_in_its_old_run_folder(places, tmp_path, capsys, monkeypatch):
    """`run presets/rtx16gb_512.yaml`, as written before the card presets were merged: base_512's
    config in flux2_rtx16gb_512, said first."""
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 100.0)
    workdir = workdir_with(tmp_path, GPU_RESULT)
    assert dry_run(places, "rtx16gb_512.yaml", workdir=workdir.root) == 0
    out = capsys.readouterr().out
    assert out.startswith("# rtx16gb_512 is base_512 now (presets/cards.csv: RTX 4060 Ti 16 GB, ")
    config = test_run.rendered_config(out)
    assert config["config"]["name"] == "flux2_rtx16gb_512"
    assert config["config"]["process"][0]["training_folder"].endswith("flux2_rtx16gb_512")


@pytest.mark.parametrize("value", ["0", "-2", "three"])
def test_profile_needs_a_positive_step_count(places, value, capsys):
    with pytest.raises(SystemExit):
        dry_run(places, "base_512.yaml", "--profile", value)
    assert "--profile takes a number of steps" in capsys.readouterr().err


@pytest.mark.trainer
def test_selftest_without_a_gpu_checks_the_reference_path(trainer_workdir, capsys):
    workdir = trainer_workdir
    assert main(["selftest", "--workdir", str(workdir.root)]) == 0
    out = capsys.readouterr().out
    assert "gpu       NONE: torch sees no GPU, so only the reference path (CPU) was checked" in out
    assert "kernels against the plain-PyTorch reference\n  not run" in out
    for line in ("fp8                                pass", "fp8, 100x outlier channels         pass",
                 "int8                               pass", "int8, 100x outlier channels        FAIL"):
        assert line in out, line
    for name in ("int4_fused (reference)", "int4_w4a8 fp8 (reference)", "int4_w4a8 int8 (reference)"):
        assert f"  {name:<34} pass  loss" in out, name
    assert "fastest that passed: none" in out and "use uint4" in out
    assert "overlapped block streaming (copies on a side stream during kernels: wall 5)\n  pass  " in out
    assert "on the cpu\n  presets with `stream_mode: auto` stream serialized" in out

    result = json.loads(workdir.selftest.read_text())
    assert result["trainer"] == verdict.trainer_build(workdir) and result["environment"]["gpu"] is None
    assert result["fastest"]["qtype"] is None and not result["timing"]
    assert all(row["passed"] and row["losses"][-1] < row["losses"][0] for row in result["training"])
    assert result["sampling"]["passed"] and result["sampling"]["device"] == "cpu", result["sampling"]
    assert "  pass  128 px, 4 steps, strengths 0 and 1 on the cpu" in out
    verdicts = verdict.Verdicts.read(workdir)
    choice = verdicts.qtype(streams=False)
    assert choice.qtype == "uint4" and "saw no GPU" in choice.line
    assert result["streaming"]["completed"] and result["streaming"]["matches_serialized"]
    assert verdicts.decide(verdict.streaming_from, None)[0] == "serialized"  # the mechanics ran, on no GPU
    assert ("transformer blocks compiled against uncompiled (a small FLUX.2, forward and backward)\n"
            "  FAIL  compiling the blocks is checked on a GPU with Triton only\n"
            "  presets with `compile_blocks: auto` leave their blocks uncompiled") in out
    assert verdicts.decide(verdict.compile_from, None)[0] is False

    assert main(["doctor", "--workdir", str(workdir.root)]) == 0
    assert "selftest        " in capsys.readouterr().out


def test_only_the_transformer_qtype_may_say_auto():
    from test_preset_schema import TRAINER, shipped

    preset = shipped()
    assert preset["config"]["process"][0]["model"]["qtype"] == "auto"
    assert check_preset(preset, TRAINER) == []
    preset["config"]["process"][0]["model"]["qtype_te"] = "auto"
    problems = check_preset(preset, TRAINER)
    assert len(problems) == 1 and "model.qtype_te = 'auto': not one of the allowed values" in problems[0]


def test_every_w4a8_gemm_is_a_candidate_and_auto_takes_only_one_that_passed():
    """Each 8-bit GEMM the table knows is checked, trained and timed where the GPU runs it; a
    faster path that failed a check is never `fastest`."""
    from launcher.in_trainer.selftest import runner as trainer_side
    from launcher.in_trainer.selftest.kernels import candidates

    names = [c["name"] for c in candidates(fp8_units=True, hip=False)]
    assert names == ["int4_fused", "int4_w4a8 fp8 triton", "int4_w4a8 fp8 scaled_mm", "int4_w4a8 fp8 in_register",
                     "int4_w4a8 int8 triton", "int4_w4a8 int8 in_register"]
    assert [c["name"] for c in candidates(fp8_units=False, hip=True)] == [
        "int4_fused", "int4_w4a8 int8 triton", "int4_w4a8 int8 in_register"]
    cands = candidates(fp8_units=True, hip=False)
    triton = next(c for c in cands if c["name"] == "int4_w4a8 fp8 triton")
    assert triton["kernel"] == {"w4a8_activations": "fp8", "w4a8_gemm": "triton"}
    timed = {"bf16": 330.0, "int4_w4a8 fp8 triton": 300.0, "int4_w4a8 fp8 scaled_mm": 390.0}
    report = {"timing": [{"results": [{"candidate": name, "step_ms": ms} for name, ms in timed.items()]}]}
    assert trainer_side.pick_fastest(report, cands, {"int4_w4a8 fp8 triton", "int4_w4a8 fp8 scaled_mm"})["kernel"] == \
        triton["kernel"]
    assert trainer_side.pick_fastest(report, cands, {"int4_w4a8 fp8 scaled_mm"})["candidate"] == \
        "int4_w4a8 fp8 scaled_mm"
