"""The lengths a file system allows, checked on the longest files a run will write before it starts:
Windows' MAX_PATH and its long-path setting, and 255 per name (bytes on Linux, UTF-16 units on
Windows). Windows is simulated here; the Windows interpreter runs the same checks for real."""

from pathlib import PureWindowsPath

import pytest

from test_run_guards import stand_in  # noqa: F401 - the fixture

from launcher.runs import path_limits
from launcher.errors import LauncherError
from launcher.runs.folders import RunFolder
from launcher.runs.path_limits import check_lengths

DEEP = PureWindowsPath("C:\\Users\\someone\\" + "\\".join(["training runs of the summer"] * 9))


def test_the_lora_at_its_highest_step_is_among_the_longest_files():
    run = RunFolder(DEEP / "my_lora", "my_lora")
    longest = run.longest_files(12000)
    assert longest[0] == DEEP / "my_lora" / "my_lora" / "my_lora_000012000.safetensors"
    assert any(path.name == "my_lora_000012000.workflow.json" for path in longest)


def simulate(monkeypatch, windows: bool, long_paths: bool = False) -> None:
    monkeypatch.setattr(path_limits, "on_windows", lambda: windows)
    monkeypatch.setattr(path_limits, "long_paths_enabled", lambda: long_paths)


def test_a_path_past_max_path_is_refused_on_windows_without_long_paths(monkeypatch):
    path = DEEP / "my_lora" / "my_lora" / "my_lora_000012000.safetensors"
    assert len(str(path)) > 259
    simulate(monkeypatch, windows=True)
    with pytest.raises(LauncherError) as refused:
        check_lengths([path])
    assert str(path) in str(refused.value) and "MAX_PATH" in str(refused.value) and "LongPathsEnabled" in str(refused.value)
    simulate(monkeypatch, windows=True, long_paths=True)
    check_lengths([path])  # long paths on: nothing to say
    simulate(monkeypatch, windows=False)
    check_lengths([path])  # Linux: 4096


def test_a_name_is_counted_as_its_file_system_counts_it(monkeypatch):
    name = "\u65e5" * 100  # 100 UTF-16 units, 300 bytes in UTF-8
    simulate(monkeypatch, windows=True)
    check_lengths([PureWindowsPath("C:\\r") / name])
    simulate(monkeypatch, windows=False)
    with pytest.raises(LauncherError, match="300 bytes; a file system allows 255"):
        check_lengths([PureWindowsPath("/r") / name])


def test_run_refuses_a_run_whose_lora_would_pass_max_path_before_any_work(stand_in, capsys, monkeypatch):  # noqa: F811
    """Windows without long paths, simulated: the output folder is deep enough that the last LoRA's
    path passes 259 characters; `run` says so in one line, and creates nothing."""
    simulate(monkeypatch, windows=True)
    output = stand_in.workdir.root.parent / "out"
    while len(str(output)) < 240:
        output = output / "training runs"
    before = sorted(stand_in.workdir.root.parent.rglob("*"))
    assert stand_in.run("--output", str(output)) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "MAX_PATH" in err and "tiny_flux2_000000002.safetensors" in err, err
    assert sorted(stand_in.workdir.root.parent.rglob("*")) == before
