"""What `run` and `selftest` do with compiled transformer blocks (`model_kwargs: {compile_blocks:
auto}`, wall 11): auto follows the self-test's compile check, the check's verdict from its
child's output, the setting in the schema, and how the self-test prints the check."""

import json

import pytest
import test_run
from test_run import dry_run
from test_selftest import GPU_RESULT, places, workdir_with  # noqa: F401  (places: the fixture)

from launcher.in_trainer.selftest import compiled
from launcher import resolve
from launcher.runs import disk_budget
from launcher.runs.presets import PRESETS_DIR, load_preset
from launcher.runs.schema import check_preset
from launcher.selftest import report
from launcher.selftest.verdict import Verdicts

CHILD = {"device": "cuda", "backend": "inductor", "candidate": "int4_w4a8 fp8 triton", "compiled": True,
         "failures": [], "max_relative_difference": 0.054, "eager_ms": 46.05, "compiled_ms": 46.71,
         "x_eager": 1.014, "compile_s": 43.3}


def with_compile(kwargs: dict | None = None) -> dict:
    return {"config": {"process": [{"model": {"model_kwargs": {"compile_blocks": "auto", **(kwargs or {})}}}]}}


def resolved(config: dict, workdir):
    """What `run` says of compiling the config's one process, which takes the resolved process."""
    processes = config["config"]["process"]
    processes[0], line = resolve.compile_blocks(processes[0], Verdicts.read(workdir))
    return line


def setting(config: dict):
    return config["config"]["process"][0]["model"]["model_kwargs"]["compile_blocks"]


def child_output(**changes) -> str:
    return "some warning on stdout\n" + json.dumps({**CHILD, **changes}) + "\n"


@pytest.mark.parametrize("changes, passed, why", [
    ({}, True, None),
    ({"x_eager": 1.3}, False, "stepped 1.30x the uncompiled time: slower on this GPU"),
    ({"max_relative_difference": 0.4}, False, "differ from the uncompiled ones by 4.0e-01 (limit 1e-01)"),
    ({"compiled": False, "failures": ["SingleStreamBlock: InductorError: no working C compiler"]}, False,
     "did not compile here (SingleStreamBlock: InductorError: no working C compiler)"),
])
def test_the_check_passes_only_compiled_matching_and_not_slower(changes, passed, why):
    result = compiled.verdict(child_output(**changes), 0, "")
    assert result["passed"] is passed and result["x_eager"] == {**CHILD, **changes}["x_eager"]
    assert ("reason" not in result) if passed else (why in result["reason"])


def test_a_child_that_dies_gives_its_exit_code_and_the_end_of_its_errors():
    result = compiled.verdict("", -11, "Traceback ...\nSegmentation fault in libamdhip64")
    assert not result["passed"]
    assert result["reason"] == ("the compile check stopped with exit code -11: Traceback ...\n"
                                "Segmentation fault in libamdhip64")


def test_the_check_runs_only_on_a_gpu_with_triton_and_a_4bit_path():
    gpu = {"gpu": {"name": "NVIDIA H200"}, "triton": "3.6.0"}
    assert "on a GPU with Triton only" in compiled.applicable({"environment": {"gpu": None, "triton": "3.6.0"}})
    assert "on a GPU with Triton only" in compiled.applicable({"environment": {**gpu, "triton": None}})
    assert "no 4-bit kernel path passed" in compiled.applicable(
        {"environment": gpu, "fastest": {"qtype": None, "reason": "..."}})
    fastest = {"qtype": "int4_w4a8", "candidate": "int4_w4a8 fp8 triton",
               "kernel": {"w4a8_activations": "fp8", "w4a8_gemm": "triton"}}
    assert compiled.applicable({"environment": gpu, "fastest": fastest}) is None
    assert compiled.candidate_from(fastest) == {"name": "int4_w4a8 fp8 triton", "qtype": "int4_w4a8",
                                                "kernel": {"w4a8_activations": "fp8", "w4a8_gemm": "triton"}}


@pytest.mark.parametrize("check, compiles, why", [
    (None, False, "compiling was not tested on a GPU"),
    ({**CHILD, "passed": True}, True, "stepped 1.01x the uncompiled time, 43 s to compile"),
    ({**CHILD, "passed": False, "reason": "the blocks did not compile here (InductorError: ...)"}, False,
     "the blocks did not compile here (InductorError: ...)"),
])
def test_compile_blocks_auto_follows_the_selftest(tmp_path, check, compiles, why):
    result = {**GPU_RESULT, **({"compile": check} if check else {})}
    config = with_compile()
    line = resolved(config, workdir_with(tmp_path, result))
    assert setting(config) is compiles
    assert line.startswith(f"compile_blocks auto -> {str(compiles).lower()}: ") and why in line
    assert "NVIDIA H200" in line


def test_without_a_valid_selftest_the_blocks_stay_uncompiled_and_a_named_setting_stays(tmp_path):
    config = with_compile()
    assert "no self-test result" in resolved(config, workdir_with(tmp_path, None))
    assert setting(config) is False
    workdir = workdir_with(tmp_path, {**GPU_RESULT, "compile": {**CHILD, "passed": True}})
    workdir.state_file.write_text(json.dumps({"target": "amd-fork", "commit": "abc", "patches": {"p": "2"}}))
    config = with_compile()
    assert "stale" in resolved(config, workdir) and setting(config) is False
    config = with_compile({"compile_blocks": False})
    assert resolved(config, workdir) is None and setting(config) is False
    config = with_compile({"compile_blocks": True})  # named: it runs, with one warning line
    line = resolved(config, workdir)
    assert setting(config) is True
    assert line.startswith("warning: compile_blocks: true, but the self-test's compile check has not passed here")
    assert "stale" in line and "falls back to uncompiled blocks" in line
    passed = workdir_with(tmp_path / "passed", {**GPU_RESULT, "compile": {**CHILD, "passed": True}})
    assert resolved(with_compile({"compile_blocks": True}), passed) is None


def test_the_schema_takes_auto_true_or_false():
    from test_preset_schema import TRAINER, shipped

    preset = shipped()
    kwargs = preset["config"]["process"][0]["model"]["model_kwargs"]
    assert kwargs["compile_blocks"] == "auto"
    for value in ("auto", True, False):
        kwargs["compile_blocks"] = value
        assert check_preset(preset, TRAINER) == []
    kwargs["compile_blocks"] = "yes"
    problems = check_preset(preset, TRAINER)
    assert len(problems) == 1 and "compile_blocks = 'yes': not true/false" in problems[0]
    assert "allowed: auto, true or false" in problems[0]


def test_dry_run_renders_the_selftests_choice(places, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 100.0)
    workdir = workdir_with(tmp_path, {**GPU_RESULT, "compile": {**CHILD, "passed": True}})
    assert dry_run(places, "base_512.yaml", workdir=workdir.root) == 0
    out = capsys.readouterr().out
    config = test_run.rendered_config(out)
    assert config["config"]["process"][0]["model"]["model_kwargs"]["compile_blocks"] is True
    assert "# compile_blocks auto -> true: the compiled blocks matched and stepped 1.01x" in out


def test_the_selftest_prints_the_check_and_what_auto_does():
    passed = report.compile_lines({**CHILD, "passed": True})
    assert passed[2] == ("  int4_w4a8 fp8 triton                   46.7 ms compiled, 46.0 ms uncompiled (1.01x), "
                         "difference 5.4e-02, 43 s to compile")
    assert passed[3:] == ["  pass", "  presets with `compile_blocks: auto` compile their blocks"]
    failed = report.compile_lines({"passed": False, "reason": "compiling the blocks is checked on a GPU with Triton only"})
    assert failed[2:] == ["  FAIL  compiling the blocks is checked on a GPU with Triton only",
                          "  presets with `compile_blocks: auto` leave their blocks uncompiled"]
    assert report.compile_lines(None)[2:] == ["  not run"]


def test_every_full_size_preset_lets_the_selftest_decide():
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        preset = load_preset(path.stem)
        kwargs = preset.config["config"]["process"][0]["model"].get("model_kwargs") or {}
        assert kwargs.get("compile_blocks") == (None if preset.settings["tiny"] else "auto"), path.name
