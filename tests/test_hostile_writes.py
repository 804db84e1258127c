"""Hostile run folders and ComfyUI folders for the commands that write beside a run: `plot`, `stop`,
`save`, `comfy` and `sample`. Each case ends in one `error:` line (or a warning) that names the
file, never in a traceback, and nothing is written through a planted link or outside the run.

The run folders are test_comfy's hand-made ones (a config, a base checkpoint and a LoRA written
with the standard library); `plot`'s drawing, which needs the trainer venv's matplotlib, is
replaced by a stand-in that writes to the path it is given the way savefig does.
"""

import json
import os
import time
from pathlib import Path

import pytest
import yaml
from test_comfy import NAME, comfy_dir, fake_run  # noqa: F401 (fixtures)
from test_run_guards import stand_in  # noqa: F401 (fixture)

from launcher.cli import main
from launcher.comfy import folder
from launcher.commands import plot as plot_command
from launcher.envs.workdir import venv_python
from launcher.errors import LauncherError
from launcher.in_trainer import plot as in_trainer_plot
from launcher.runs.folders import RunFolder

links = pytest.mark.skipif(os.name == "nt", reason="creating links needs rights Windows does not grant by default")
PHOTO = b"a user's photo"


@pytest.fixture
def run_dirs(request):
    """test_comfy's hand-made run: (workdir, run folder)."""
    return request.getfixturevalue("fake_run")


@pytest.fixture
def comfyui(request):
    """test_comfy's ComfyUI folder: models/loras and main.py."""
    return request.getfixturevalue("comfy_dir")


def error_line(capsys) -> str:
    """The one line a refused command printed; a traceback would have raised instead."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def set_name(root: Path, name) -> Path:
    path = root / "config.yaml"
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    config["config"]["name"] = name
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


# --- plot -------------------------------------------------------------------------------------

@pytest.fixture
def plottable(run_dirs, monkeypatch):
    """run_dirs with telemetry, a trainer venv interpreter, and a drawing stand-in that reads the rows
    as the trainer venv's plot does and writes the PNG the way savefig does (following links)."""
    workdir, root = run_dirs
    python = venv_python(workdir / "venv")
    python.parent.mkdir(parents=True)
    python.write_text("")
    (root / "telemetry.jsonl").write_text(json.dumps({"t": 1.0, "step": 1, "loss": 0.5, "s_it": 2.0}) + "\n")
    drawn = []

    def draw(python, telemetry, events, out_png, sheet=None):
        in_trainer_plot.series(in_trainer_plot._rows(telemetry))
        with open(out_png, "wb") as handle:
            handle.write(b"\x89PNG drawn")
        drawn.append(Path(out_png))
        return 0

    monkeypatch.setattr(plot_command, "plot_with", draw)
    return workdir, root, drawn


def plot(workdir: Path, *args: str) -> int:
    return main(["plot", "--workdir", str(workdir), *args])


@links
def test_plot_does_not_write_through_a_link_at_telemetry_png(plottable, tmp_path, capsys):
    workdir, root, _ = plottable
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(PHOTO)
    (root / "telemetry.png").symlink_to(photo)
    assert plot(workdir, str(root)) == 2
    assert photo.read_bytes() == PHOTO
    line = error_line(capsys)
    assert str(root / "telemetry.png") in line and "is a link" in line


@links
def test_plot_out_that_is_a_link_is_not_followed(plottable, tmp_path, capsys):
    workdir, root, _ = plottable
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(PHOTO)
    out = tmp_path / "plot.png"
    out.symlink_to(photo)
    assert plot(workdir, str(root), "--out", str(out)) == 2
    assert photo.read_bytes() == PHOTO
    assert "is a link" in error_line(capsys)


def test_plot_writes_the_png_whole_through_a_temporary_file(plottable, capsys):
    workdir, root, drawn = plottable
    assert plot(workdir, str(root)) == 0
    assert (root / "telemetry.png").read_bytes() == b"\x89PNG drawn"
    assert drawn and drawn[0] != root / "telemetry.png" and drawn[0].parent == root
    assert [p.name for p in root.iterdir() if ".tmp" in p.name] == []
    assert f"wrote {root / 'telemetry.png'}" in capsys.readouterr().out


def test_plot_skips_junk_telemetry_rows_with_one_warning(plottable, capsys):
    workdir, root, _ = plottable
    good = json.dumps({"t": 2.0, "step": 2, "loss": 0.4, "s_it": 2.0})
    junk = ["not json at all", "[1, 2]", json.dumps({"t": 3.0, "step": "three", "loss": "low"}), "{\"t\": 4.0, \"st"]
    with (root / "telemetry.jsonl").open("a") as handle:
        handle.write("\n".join([junk[0], good, junk[1], junk[2], junk[3]]))
    assert plot(workdir, str(root)) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "telemetry.jsonl" in line]
    assert len(warnings) == 1 and "line 2" in warnings[0] and "skipped 3" in warnings[0], err
    rows = in_trainer_plot._rows(root / "telemetry.jsonl")
    assert [row["step"] for row in rows] == [1, 2]


def test_junk_watchdog_events_are_skipped_too(plottable, capsys):
    workdir, root, _ = plottable
    (root / "watchdog.jsonl").write_text("\n".join(['{"kind": "burst"}', '{"step": 3}', "oops",
                                                    '{"kind": "stall", "step": 4}']) + "\n")
    assert plot(workdir, str(root)) == 0
    assert [event["step"] for event in in_trainer_plot._rows(root / "watchdog.jsonl", events=True)] == [4]
    assert "skipped 3" in capsys.readouterr().err


# --- names read back from a run's config.yaml ---------------------------------------------------

@pytest.mark.parametrize("command", ["stop", "save"])
@pytest.mark.parametrize("bad", ["../../../escaped", "ABSOLUTE", "a/b", "..", ""])
def test_a_config_name_that_leaves_the_run_is_refused(run_dirs, tmp_path, capsys, command, bad):
    workdir, root = run_dirs
    if bad == "ABSOLUTE":
        bad = str(tmp_path / "absolute" / "name")
    config = set_name(root, bad)
    before = sorted(tmp_path.rglob("*"))
    assert main([command, str(root), "--workdir", str(workdir)]) == 2
    assert sorted(tmp_path.rglob("*")) == before, "nothing may be created"
    line = error_line(capsys)
    assert str(config) in line and "config.name" in line and "plain folder name" in line


@pytest.mark.parametrize("command", ["comfy", "sample"])
def test_comfy_and_sample_refuse_a_config_name_that_leaves_the_run(run_dirs, capsys, command):
    workdir, root = run_dirs
    config = set_name(root, "../../x")
    assert main([command, str(root), "--workdir", str(workdir)]) == 2
    line = error_line(capsys)
    assert str(config) in line and "'../../x'" in line


def test_a_plain_name_with_spaces_and_dots_is_still_a_run(run_dirs, capsys):
    workdir, root = run_dirs
    set_name(root, "my run v1.2")
    assert main(["stop", str(root), "--workdir", str(workdir)]) == 0
    assert (root / "my run v1.2" / "STOP_NOW").is_file()


@links
def test_stop_does_not_make_folders_through_a_linked_job_folder(run_dirs, tmp_path, capsys):
    workdir, root = run_dirs
    elsewhere = tmp_path / "elsewhere"
    (root / NAME).rename(tmp_path / "moved")
    (root / NAME).symlink_to(elsewhere, target_is_directory=True)  # dangling: mkdir would fail or follow
    assert main(["stop", str(root), "--workdir", str(workdir)]) == 2
    assert not elsewhere.exists()
    assert "is a link" in error_line(capsys)


# --- run folders inside the workdir's trainer checkout or venv --------------------------------

@pytest.fixture
def set_up_workdir(tmp_path):
    workdir = tmp_path / "wd"
    (workdir / "trainer" / ".git").mkdir(parents=True)
    (workdir / "trainer" / "run.py").write_text("")
    (workdir / "venv").mkdir()
    (workdir / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (workdir / "runs").mkdir()
    (workdir / "setup-state.json").write_text("{}")
    return workdir


@pytest.mark.parametrize("output, name", [(".", "trainer"), (".", "venv"), ("trainer", "x"), ("venv", "x"),
                                          ("trainer/toolkit", "x"), (".", "trainer.partial")])
def test_a_run_folder_in_the_trainer_checkout_or_venv_is_refused(set_up_workdir, output, name):
    out = (set_up_workdir / output).resolve()
    with pytest.raises(LauncherError) as raised:
        RunFolder.inside(out, name)
    message = str(raised.value)
    assert "config.name" in message and "--output" in message
    assert not (out / name).exists() or name in ("trainer", "venv")


def test_run_folders_beside_the_checkout_are_fine(set_up_workdir):
    assert RunFolder.inside(set_up_workdir, "my_run").root == (set_up_workdir / "my_run").resolve()
    assert RunFolder.inside(set_up_workdir / "runs", "trainer").root == (set_up_workdir / "runs" / "trainer").resolve()


# --- stale flag files --------------------------------------------------------------------------

def test_stale_flags_are_reported_and_cleared(run_dirs):
    from launcher.runs.folders import clear_stale_flags

    _, root = run_dirs
    run = RunFolder(root, NAME)
    assert clear_stale_flags(run) == []
    run.flag("STOP_NOW").touch()
    run.flag("SAVE_NOW").touch()
    old = time.time() - 3600
    os.utime(run.flag("STOP_NOW"), (old, old))
    lines = clear_stale_flags(run)
    assert len(lines) == 2 and all("before this launch" in line for line in lines)
    assert any(str(run.flag("STOP_NOW")) in line for line in lines)
    assert not run.flag("STOP_NOW").exists() and not run.flag("SAVE_NOW").exists()
    assert (root / NAME / f"{NAME}.safetensors").is_file()


@links
def test_a_stale_flag_that_is_a_link_is_removed_not_its_target(run_dirs, tmp_path):
    from launcher.runs.folders import clear_stale_flags

    _, root = run_dirs
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(PHOTO)
    run = RunFolder(root, NAME)
    run.flag("STOP_NOW").symlink_to(photo)
    assert len(clear_stale_flags(run)) == 1
    assert photo.read_bytes() == PHOTO and not run.flag("STOP_NOW").is_symlink()


def test_no_job_folder_no_stale_flags(tmp_path):
    from launcher.runs.folders import clear_stale_flags

    assert clear_stale_flags(RunFolder(tmp_path, "fresh")) == []


# --- comfy -------------------------------------------------------------------------------------

def comfy(workdir: Path, *args: str) -> int:
    return main(["comfy", "--workdir", str(workdir), *args])


@links
def test_a_linked_comfyui_folder_is_refused_before_the_lora_is_copied(run_dirs, comfyui, tmp_path, capsys):
    workdir, root = run_dirs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "comfyui").symlink_to(elsewhere, target_is_directory=True)
    assert comfy(workdir, "--comfy-dir", str(comfyui)) == 2
    assert list((comfyui / "models" / "loras").iterdir()) == [], "nothing may be copied before the refusal"
    assert list(elsewhere.iterdir()) == []
    assert "is a link" in error_line(capsys)


def test_a_loras_folder_that_is_a_file_is_one_line(run_dirs, comfyui, capsys):
    workdir, root = run_dirs
    loras = comfyui / "models" / "loras"
    loras.rmdir()
    loras.write_text("not a folder")
    assert comfy(workdir, "--comfy-dir", str(comfyui)) == 2
    line = error_line(capsys)
    assert str(loras) in line and "file" in line
    assert not (root / "comfyui").exists(), "refused before anything is written"


@pytest.mark.parametrize("version", ["nightly", "", "v-next"])
def test_a_comfyui_version_that_is_not_a_number_is_not_called_older(tmp_path, version):
    (tmp_path / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')
    note = folder.version_note(tmp_path)
    assert note is not None and "cannot tell" in note and "older" not in note
    assert str(tmp_path / "comfyui_version.py") in note


@pytest.mark.parametrize("version, older", [("0.19", False), ("0.19.0", False), ("0.20.1", False), ("v0.19.2-rc1", False),
                                            ("0.18.9", True), ("0.3", True)])
def test_comfyui_versions_compare_as_numbers(tmp_path, version, older):
    (tmp_path / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')
    note = folder.version_note(tmp_path)
    assert (note is not None and "older" in note) if older else note is None


# --- sample ------------------------------------------------------------------------------------

def test_sample_names_the_workdir_by_its_path(run_dirs, capsys):
    workdir, _ = run_dirs
    assert main(["sample", "--workdir", str(workdir)]) == 2
    line = error_line(capsys)
    assert "Workdir(" not in line and str(workdir.resolve()) in line


@links
def test_sample_does_not_open_a_linked_run_lock(run_dirs, tmp_path, capsys):
    workdir, root = run_dirs
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(PHOTO)
    (root / "run.lock").symlink_to(photo)
    assert main(["sample", str(root), "--workdir", str(workdir)]) == 2
    assert photo.read_bytes() == PHOTO
    line = error_line(capsys)
    assert str(root / "run.lock") in line and "is a link" in line


def test_a_run_folder_with_files_no_launch_wrote_is_refused_untouched(stand_in, capsys):  # noqa: F811
    """`run --output DIR` where DIR/<config.name>/ holds the user's config.yaml (and no run.lock,
    which every launch makes before it writes): refused before anything is written, file kept."""
    stand_in.run_root.mkdir(parents=True)
    mine = stand_in.run_root / "config.yaml"
    mine.write_text("my own config\n", encoding="utf-8")
    assert stand_in.run() == 2
    assert mine.read_text(encoding="utf-8") == "my own config\n"
    assert sorted(p.name for p in stand_in.run_root.iterdir()) == ["config.yaml"]
    assert "holds files no launch wrote (config.yaml)" in capsys.readouterr().err


def test_a_run_folder_a_launch_made_is_used_again(stand_in, capsys):  # noqa: F811
    assert stand_in.run() == 0
    assert (stand_in.run_root / "config.yaml").is_file()
    assert stand_in.run() == 0, capsys.readouterr().err
