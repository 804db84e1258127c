"""`sample`: every bad input is refused before anything loads, and the tiny run's LoRA is sampled.

The bad-input tests reuse test_comfy's hand-made run folder (a config, a base checkpoint and a
LoRA written with the standard library, no trainer venv): a request that passes every check
reaches the venv check and stops there, so "refused before loading" is what each asserts.
"""

import json
import subprocess
import sys

import pytest
import yaml
from test_comfy import NAME, fake_run, lora_shapes, write_safetensors  # noqa: F401 (fixture)

from launcher.cli import main
from launcher.errors import LauncherError
from launcher.runs import samples
from launcher.runs.folders import RunFolder
from launcher.runs.run_lock import run_folder_lock


def sample(workdir, *args: str) -> int:
    return main(["sample", "--workdir", str(workdir), *args])


def edit_config(root, change) -> None:
    config = yaml.safe_load((root / "config.yaml").read_text(encoding="utf-8"))
    change(config["config"]["process"][0])
    (root / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")


def refused(workdir, capsys, *args: str) -> str:
    assert sample(workdir, *args) == 2
    err = capsys.readouterr().err
    assert "setup` first" not in err, "the request passed every check"
    return err


def test_a_good_request_reaches_the_trainer_venv_check(fake_run, capsys):
    workdir, root = fake_run
    assert sample(workdir, "--size", "512") == 2
    assert "run `python -m launcher setup` first" in capsys.readouterr().err
    assert not (root / "samples").exists()


def test_no_prompt_anywhere_is_refused(fake_run, capsys):
    workdir, root = fake_run
    for caption in (root.parent.parent.parent / "data").glob("*.txt"):
        caption.unlink()
    assert "no prompt to sample" in refused(workdir, capsys)


@pytest.mark.parametrize("prompts", [[1, "a dog"], [""], [{"prompt": "x"}]])
def test_prompts_that_are_not_text_are_refused(fake_run, capsys, prompts):
    workdir, root = fake_run
    edit_config(root, lambda process: process.update(sample={"prompts": prompts}))
    err = refused(workdir, capsys)
    assert "must be non-empty text" in err and "config.yaml" in err


def test_default_prompts_are_the_presets_then_the_caption_with_the_trigger(fake_run):
    workdir, root = fake_run
    config = yaml.safe_load((root / "config.yaml").read_text(encoding="utf-8"))
    assert samples.default_prompts(config) == ["a photo of sks on a white background"]
    config["config"]["process"][0]["sample"] = {"prompts": ["[trigger] in snow", "a cat"]}
    assert samples.default_prompts(config) == ["sks in snow", "sks a cat"]


def test_a_checkpoint_that_does_not_exist_is_refused(fake_run, capsys):
    workdir, _ = fake_run
    assert "no LoRA saved at step '500'" in refused(workdir, capsys, "--checkpoint", "500")


def test_a_lora_of_another_base_model_is_refused(fake_run, capsys):
    workdir, root = fake_run
    wider = {key: [shape[0], shape[1] * 2] if key.endswith("lora_A.weight") else shape for key, shape in lora_shapes().items()}
    write_safetensors(root / NAME / f"{NAME}.safetensors", wider)
    assert "does not fit the FLUX.2 transformer" in refused(workdir, capsys)


@pytest.mark.parametrize("size", ["100", "32", "4096"])
def test_a_size_the_model_cannot_take_is_refused(fake_run, capsys, size):
    workdir, _ = fake_run
    assert "multiple of 16 from 64 to 2048" in refused(workdir, capsys, "--size", size)


@pytest.mark.parametrize("text", ["", "a,b", "0,nan"])
def test_bad_strengths_are_refused(text):
    with pytest.raises(LauncherError, match="--strength"):
        samples.parse_strengths(text)


def test_strengths_parse():
    assert samples.parse_strengths("0, 0.5,1") == [0.0, 0.5, 1.0]


def test_a_run_still_training_is_refused_with_the_in_training_option(fake_run, capsys):
    workdir, root = fake_run
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from launcher.runs.run_lock import run_folder_lock\n"
        f"with run_folder_lock(Path({str(root)!r})):\n    print('locked', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        err = refused(workdir, capsys, "--size", "512")
        assert "still training" in err and f"pid {holder.pid}" in err and "sample_every" in err
    finally:
        holder.kill()
        holder.wait()
    assert sample(workdir, "--size", "512") == 2
    assert "setup` first" in capsys.readouterr().err, "a lock that died with its process must not block"


def test_a_lock_released_in_this_process_is_not_held(tmp_path):
    with run_folder_lock(tmp_path):
        pass
    assert not samples.run_lock.is_held(tmp_path)


def test_the_sample_folder_is_named_by_the_step(tmp_path):
    run = RunFolder(tmp_path, "my_run_2")
    assert samples.sample_folder(run, tmp_path / "my_run_2_000000500.safetensors") == tmp_path / "samples" / "500"
    assert samples.sample_folder(run, tmp_path / "my_run_2.safetensors") == tmp_path / "samples" / "final"


def sampling_config(disable: bool | None = False) -> dict:
    train = {} if disable is None else {"disable_sampling": disable}
    return {"config": {"process": [{"train": train, "sample": {"sample_every": 10}}]}}


def resolved(config: dict, workdir, setting: str) -> str | None:
    """What `run` says of in-training sampling, from the workdir's self-test report read once; `config`
    takes the processes of the config it resolves."""
    from launcher import resolve
    from launcher.selftest.verdict import Verdicts

    decided, line = resolve.sampling(config, Verdicts.read(workdir), setting)
    config["config"]["process"] = decided["config"]["process"]
    return line


def write_selftest(workdir, **sampling) -> None:
    from launcher.selftest.verdict import trainer_build

    result = {"created": "2026-12-01T12:00:00", "environment": {"gpu": {"name": "Radeon RX 7900 XTX"}},
              "trainer": trainer_build(workdir)}
    if sampling:
        result["sampling"] = sampling
    workdir.selftest.write_text(json.dumps(result), encoding="utf-8")


@pytest.mark.parametrize("sampling, why", [
    (None, "no self-test result"),
    ({}, "did not pass (not run)"),
    ({"passed": False, "error": "did not finish in 600 s"}, "did not finish in 600 s"),
])
def test_in_training_sampling_is_off_until_the_selftest_sampled(tmp_path, sampling, why):
    from launcher.envs.workdir import Workdir

    workdir = Workdir(tmp_path)
    if sampling is not None:
        write_selftest(workdir, **sampling)
    for disable in (False, None):  # the trainer samples unless disable_sampling is true
        config = sampling_config(disable)
        line = resolved(config, workdir, "auto")
        assert config["config"]["process"][0]["train"]["disable_sampling"] is True
        assert line.startswith("in-training sampling off") and why in line and "sampling: force" in line


def test_in_training_sampling_stays_on_after_a_passing_selftest_or_when_forced(tmp_path):
    from launcher.envs.workdir import Workdir

    workdir = Workdir(tmp_path)
    config = sampling_config()
    assert resolved(config, workdir, "force").startswith("in-training sampling on: forced")
    write_selftest(workdir, passed=True, device="cuda", seconds=12.0)
    line = resolved(config, workdir, "auto")
    assert config["config"]["process"][0]["train"]["disable_sampling"] is False
    assert "Radeon RX 7900 XTX" in line
    assert resolved(sampling_config(True), workdir, "auto") is None, "no line when sampling is off anyway"


def test_a_sampling_check_that_hangs_is_a_failure_not_a_hung_selftest(tmp_path, monkeypatch):
    from launcher.selftest import launch, report
    from launcher.envs.workdir import Workdir

    limits = []

    def hang(python, module, *args, timeout=None, **kwargs):
        limits.append(timeout)
        raise subprocess.TimeoutExpired(module, timeout)

    monkeypatch.setattr(launch.tiny, "ensure_assets", lambda *args: {"name_or_path": "x", "model_kwargs": {}})
    monkeypatch.setattr(launch, "run_module", hang)
    result = launch.sampling_check(Workdir(tmp_path), tmp_path / "python", {})
    assert limits == [launch.SAMPLING_LIMIT_S]
    assert result == {"passed": False, "error": f"did not finish in {launch.SAMPLING_LIMIT_S} s "
                                                 "(a driver deadlock looks like this)"}
    assert "FAIL  did not finish" in "\n".join(report.sampling_lines({"sampling": result}))
    passed = {"passed": True, "device": "cuda", "seconds": 9.5, "size": 128, "steps": 4}
    assert "pass  128 px, 4 steps, strengths 0 and 1 on the cuda in 9.5 s" in "\n".join(
        report.sampling_lines({"sampling": passed}))
