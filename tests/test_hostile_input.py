"""Hostile preset and flag values: each is refused in one line that names the file (and the line
in the YAML) and says how to fix it, before anything is written or any long work starts."""

import json
import os
from pathlib import Path

import pytest
import yaml
from test_run import dry_run, fake_safetensors, places  # noqa: F401 - the fixture
from test_run_guards import StandIn, stand_in  # noqa: F401 - the fixture

from launcher.cli import main
from launcher.errors import LauncherError
from launcher.runs import resume
from launcher.runs.presets import PRESETS_DIR, read_preset
from launcher.runs.schema import check_preset

TINY = (PRESETS_DIR / "tiny.yaml").read_text(encoding="utf-8")


def tiny_text(runner: StandIn, old: str, new: str) -> int:
    """The shipped tiny preset with `old` replaced by `new`, as the stand-in's preset; the line of the last line of `new`."""
    assert old in TINY
    text = TINY.replace(old, new, 1)
    runner.preset.write_text(text, encoding="utf-8")
    return text[: text.index(new)].count("\n") + 1 + new.rstrip("\n").count("\n")


def refused(runner: StandIn, capsys) -> str:
    """The stand-in's run refuses its preset and writes nothing; the error text."""
    capsys.readouterr()
    assert runner.run() == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert not (runner.run_root / "config.yaml").exists() and not (runner.run_root / "tiny_flux2").exists()
    return err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 2, err
    return err


# -- YAML: what PyYAML reads differently from what was written ----------------------------------------


def test_a_duplicate_key_is_refused_with_its_line(stand_in, capsys):  # noqa: F811
    line = tiny_text(stand_in, "        lr: 0.0001\n", "        lr: 0.0001\n        lr: 0.5\n")
    err = one_line(refused(stand_in, capsys))
    assert f"{stand_in.preset}, line {line}: the key `lr` is given twice in one mapping (first on line {line - 1})" in err


@pytest.mark.parametrize("written, meaning", [("017", "octal number (read as 15)"),
                                              ("0x10", "hexadecimal number (read as 16)"),
                                              ("1:30", "base-60 number (read as 90)"),
                                              ("0b11", "binary number (read as 3)")])
def test_yaml_11_number_forms_are_refused_with_their_line(stand_in, capsys, written, meaning):  # noqa: F811
    line = tiny_text(stand_in, "        steps: 2\n", f"        steps: {written}\n")
    err = one_line(refused(stand_in, capsys))
    assert f"{stand_in.preset}, line {line}: `{written}` is a YAML 1.1 {meaning}" in err
    assert "quote it" in err


def test_a_numeric_trigger_word_is_refused_with_its_line(stand_in, capsys):  # noqa: F811
    line = tiny_text(stand_in, "      training_seed: 42", "      trigger_word: 1234\n      training_seed: 42") - 1
    err = refused(stand_in, capsys)
    assert f"line {line}: config.process[0].trigger_word = 1234: a number, not text (write it in quotes: '1234')" in err
    assert str(stand_in.preset) in err


def test_memory_plan_off_as_the_readme_writes_it_is_off(stand_in, capsys):  # noqa: F811
    tiny_text(stand_in, "        model_kwargs: {}", "        model_kwargs:\n          memory_plan: off")
    assert stand_in.run("--dry-run") == 0
    assert "memory_plan: 'off'" in capsys.readouterr().out
    tiny_text(stand_in, "        model_kwargs: {}", "        model_kwargs:\n          memory_plan: on")
    assert "memory_plan = True: not one of the allowed values" in refused(stand_in, capsys)


# -- launcher.env: only variables that cannot redirect the trainer -----------------------------------


@pytest.mark.parametrize("name", ["AITK_QUANT_CACHE_DIR", "AITK_TEXT_CACHE_DIR", "TRITON_CACHE_DIR",
                                  "TORCHINDUCTOR_CACHE_DIR", "HF_HOME", "TMPDIR", "PYTHONPATH", "A=B"])
def test_the_preset_env_may_not_redirect_the_trainers_writes_and_caches(stand_in, capsys, name):  # noqa: F811
    stand_in.write_preset(env={name: "/elsewhere"})
    err = refused(stand_in, capsys)
    assert f"launcher.env.{name} = '/elsewhere': not a variable a preset may set" in err


def test_a_nul_in_an_env_value_is_refused(stand_in, capsys):  # noqa: F811
    stand_in.write_preset(env={"HF_HUB_OFFLINE": "1\0"})
    assert "launcher.env.HF_HUB_OFFLINE = '1\\x00': holds a NUL character" in refused(stand_in, capsys)


def test_the_env_variables_tests_and_presets_use_stay_allowed(stand_in, capsys):  # noqa: F811
    stand_in.write_preset(env={"HF_HUB_OFFLINE": "1", "AITK_TEST_PIDFILE": "pid", "AITK_TEST_DELAY_US": "500000"})
    assert stand_in.run("--dry-run") == 0


def test_no_variable_carries_a_setting(stand_in, capsys):  # noqa: F811
    """The kernel choice is model_kwargs (flux2_contract/settings.py), not an environment variable."""
    stand_in.write_preset(env={"INT4_W4A8_ACT": "fp8"})
    assert "launcher.env.INT4_W4A8_ACT = 'fp8': not a variable a preset may set" in refused(stand_in, capsys)
    stand_in.write_preset(env={"AITK_ALL_EXTENSIONS": "1"})
    assert ("launcher.env.AITK_ALL_EXTENSIONS = '1': the trainer reads no AITK_ variable; remove it and set "
            "model_kwargs all_extensions: true in the preset") in refused(stand_in, capsys)


# -- resume: what shapes the LoRA and optimizer, not how the run is carried out ------------------------


def wrapped(process: dict) -> dict:
    return {"job": "extension", "config": {"name": "run", "process": [process]}}


def saved_run(tmp_path: Path, process: dict) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(wrapped(process)))
    return folder / "config.yaml"


PROCESS = {
    "network": {"type": "lora", "linear": 32, "linear_alpha": 32},
    "datasets": [{"folder_path": "/data/a", "resolution": [512]}],
    "train": {"optimizer": "adamw8bit", "lr": 1e-4, "dtype": "bf16"},
    "model": {"name_or_path": "/models/flux2", "arch": "flux2", "quantize": True, "qtype": "uint4",
              "model_kwargs": {"text_encoder_path": "/models/mistral", "compile_blocks": False, "stream_mode": "serialized",
                               "memory_plan": "auto", "vram_budget_gib": 20, "vram_margin_gib": 1.0}},
}


def test_a_resume_ignores_how_the_run_is_carried_out(tmp_path):
    config_file = saved_run(tmp_path, PROCESS)
    moved = json.loads(json.dumps(PROCESS))
    moved["datasets"][0]["folder_path"] = "/elsewhere/data"
    moved["model"].update(name_or_path="/elsewhere/flux2", qtype="int4_fused")
    moved["model"]["model_kwargs"].update(text_encoder_path="/elsewhere/mistral", compile_blocks=True,
                                          stream_mode="overlapped", memory_plan="off", vram_budget_gib=8,
                                          vram_margin_gib=0.5)
    assert resume.check_changes(config_file, wrapped(moved), accept=False) == []


@pytest.mark.parametrize("edit, key", [
    (lambda p: p["network"].update(linear=16), "network.linear"),
    (lambda p: p["network"].update(type="lokr"), "network.type"),
    (lambda p: p["network"].update(network_kwargs={"only_if_contains": ["attn"]}), "network.network_kwargs"),
    (lambda p: p["model"].update(arch="flux"), "model.arch"),
    (lambda p: p["train"].update(optimizer="adafactor"), "train.optimizer"),
    (lambda p: p["model"]["model_kwargs"].update(flux2_params={"depth": 2}), "model.model_kwargs.flux2_params"),
])
def test_a_resume_that_reshapes_the_lora_or_optimizer_is_refused(tmp_path, edit, key):
    config_file = saved_run(tmp_path, PROCESS)
    changed = json.loads(json.dumps(PROCESS))
    edit(changed)
    with pytest.raises(LauncherError, match=f"config.process\\[0\\].{key}"):
        resume.check_changes(config_file, wrapped(changed), accept=True)


def test_a_resume_after_the_selftest_with_the_same_preset_goes_on(stand_in, capsys):  # noqa: F811
    assert stand_in.run() == 0
    (stand_in.run_root / "tiny_flux2" / "tiny_flux2.safetensors").write_bytes(b"saved")
    config = yaml.safe_load((stand_in.run_root / "config.yaml").read_text())
    kwargs = config["config"]["process"][0]["model"]["model_kwargs"]
    kwargs.update(compile_blocks=False, stream_mode="serialized")  # what `auto` became before the self-test
    (stand_in.run_root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    tiny_text(stand_in, "        model_kwargs: {}", "        model_kwargs:\n          compile_blocks: true\n"
                                                   "          stream_mode: overlapped")
    capsys.readouterr()
    assert stand_in.run("--resume") == 0, capsys.readouterr().err


# -- the memory plan the dry run shows is the one the trainer carries out ------------------------------


def full_preset(tmp_path: Path, **kwargs) -> Path:
    data = read_preset("7900xtx_512").data
    data["config"]["process"][0]["model"]["model_kwargs"].update(kwargs.pop("model_kwargs", {}))
    data["config"]["process"][0]["model"].update(kwargs)
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def full_dry_run(places, path: Path, *extra: str) -> int:  # noqa: F811
    return main(["run", str(path), "--dry-run", "--workdir", str(places["workdir"]),
                             "--model-dir", str(places["model"]), "--text-encoder", str(places["encoder"]),
                             "--dataset", str(places["data"]), *extra])


def test_a_qtype_that_cannot_stream_is_refused_where_the_plan_streams(places, tmp_path, capsys):  # noqa: F811
    """The trainer's own planner, in-process: 8 GiB at 512 px streams most of the 56 blocks."""
    path = full_preset(tmp_path, qtype="uint4", model_kwargs={"vram_budget_gib": 8})
    assert full_dry_run(places, path) == 2
    err = one_line(capsys.readouterr().err)
    assert (f"{path}: config.process[0].model.qtype uint4 cannot stream blocks (only int4_fused and int4_w4a8 can): "
            "the trainer would keep all 56 blocks resident, where the plan for vram_budget_gib 8 streams") in err
    assert "set qtype auto" in err
    path = full_preset(tmp_path, qtype="uint4", model_kwargs={"vram_budget_gib": 40})
    assert full_dry_run(places, path) == 0, "nothing streamed: uint4 runs the plan as shown"


def test_a_budget_within_the_margin_is_refused_with_the_budget_given(places, tmp_path, capsys):  # noqa: F811
    path = full_preset(tmp_path, model_kwargs={"vram_budget_gib": 1})
    assert full_dry_run(places, path) == 2
    err = one_line(capsys.readouterr().err)
    assert (f"{path}: model_kwargs vram_budget_gib 1 GiB less vram_margin_gib 1.0 GiB (the default) leaves "
            "0 GiB for the plan") in err
    assert "0.0 KiB" not in err
    path = full_preset(tmp_path, model_kwargs={"vram_budget_gib": 1.5, "vram_margin_gib": 1.25})
    assert full_dry_run(places, path) == 2
    assert "vram_budget_gib 1.5 GiB less vram_margin_gib 1.25 GiB leaves 0.25 GiB for the plan: a VRAM budget of" \
        in capsys.readouterr().err


# -- flux2_params ---------------------------------------------------------------------------------------


def tiny_data() -> dict:
    return yaml.safe_load(TINY)


def problems_with(edit) -> list[str]:
    data = tiny_data()
    edit(data["config"]["process"][0], data)
    return check_preset(data)


@pytest.mark.parametrize("params, message", [
    ({"hidden_size": "big"}, "model_kwargs.flux2_params.hidden_size = 'big': not a whole number"),
    ({"depht": 2}, "model_kwargs.flux2_params.depht: unknown key (not a setting); did you mean `depth`?"),
    ({"axes_dim": 4}, "model_kwargs.flux2_params.axes_dim = 4: not a list"),
    ({"hidden_size": 64, "num_heads": 3}, "flux2_params: hidden_size 64 is not a multiple of num_heads 3"),
])
def test_flux2_params_are_checked(params, message):
    found = problems_with(lambda process, data: process["model"]["model_kwargs"].update(flux2_params=params))
    assert any(message in item for item in found), found


def test_a_transformer_file_that_is_not_safetensors_is_refused_with_flux2_params(places, tmp_path, capsys):  # noqa: F811
    (places["model"] / "flux2-dev.safetensors").write_bytes(bytes(16))
    path = full_preset(tmp_path, model_kwargs={"flux2_params": {}})
    assert full_dry_run(places, path) == 2
    assert "flux2-dev.safetensors: malformed safetensors header" in capsys.readouterr().err


def test_empty_flux2_params_is_the_full_model_and_its_size_is_checked(places, tmp_path, capsys):  # noqa: F811
    fake_safetensors(places["model"] / "flux2-dev.safetensors", 16)
    path = full_preset(tmp_path, model_kwargs={"flux2_params": {}})
    assert full_dry_run(places, path) == 2
    assert "flux2-dev.safetensors is 0.0 GiB; FLUX.2 [dev] is about 64 GB" in one_line(capsys.readouterr().err)


def blocks_file(path: Path, double: int, single: int) -> None:
    names = [f"double_blocks.{i}.img_attn.qkv.weight" for i in range(double)]
    names += [f"single_blocks.{i}.linear1.weight" for i in range(single)]
    header = json.dumps({name: {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i, name in enumerate(names)})
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(len(names)))


def test_a_transformer_without_the_blocks_flux2_params_gives_is_refused(places, tmp_path, capsys):  # noqa: F811
    blocks_file(places["model"] / "flux2-dev.safetensors", 8, 48)
    shape = {"hidden_size": 64, "num_heads": 2, "axes_dim": [8, 8, 8, 8], "depth": 1, "depth_single_blocks": 1}
    path = full_preset(tmp_path, model_kwargs={"flux2_params": shape})
    assert full_dry_run(places, path) == 2
    assert "flux2-dev.safetensors holds 8 double_blocks where model_kwargs flux2_params gives depth 1" in \
        one_line(capsys.readouterr().err)


# -- values that ended in a traceback ----------------------------------------------------------------


@pytest.mark.parametrize("edit, message", [
    (lambda p, d: d["launcher"].update(telemetry={"interval_s": 1.0e10}),
     "launcher.telemetry.interval_s = 10000000000.0: out of range; allowed: a number >= 0.1, at most 3600"),
    (lambda p, d: p["sample"].update(prompts=["x" * (128 * 1024 + 1)]),
     "config.process[0].sample.prompts[0] = '" + "x" * 56 + "...: "
     "longer than 131,072 characters (131,073)"),
    (lambda p, d: p["datasets"][0].update(caption_ext="txt/../x"),
     "config.process[0].datasets[0].caption_ext = 'txt/../x': not a plain file extension"),
    (lambda p, d: p["model"]["model_kwargs"].update(vram_budget_gib=1e300),
     "vram_budget_gib = 1e+300: out of range; allowed: a number > 0, at most 1024"),
    (lambda p, d: d["config"].update(name="n" * 300),
     "config.name = '" + "n" * 56 + "...: 300 characters; the run folder and "
     "LoRA files are named after it; allowed: a plain folder name of at most 100 characters"),
])
def test_values_that_failed_later_are_refused_by_the_schema(edit, message):
    found = problems_with(edit)
    assert any(message in item for item in found), found


def test_a_dataset_flag_with_an_unknown_user_is_one_line(places, capsys):  # noqa: F811
    places["data"] = Path("~no-such-user-here/x")
    assert dry_run(places) == 2
    err = one_line(capsys.readouterr().err)
    if os.name == "nt":  # Windows has no user database: ~user is taken as a sibling of the current home
        assert f"dataset folder {Path('~no-such-user-here/x').expanduser()} does not exist" in err
        return
    assert "--dataset ~no-such-user-here/x: the home folder of ~no-such-user-here is not known" in err


def test_a_dataset_that_is_a_file_is_said_to_be_one(places, capsys):  # noqa: F811
    places["data"] = places["data"] / "a.png"
    assert dry_run(places) == 2
    assert f"dataset {places['data']} is a file, not a folder" in one_line(capsys.readouterr().err)
