"""A user whose folders and name are not ASCII, end to end: the workdir, the run folder, the dataset
and the user name hold Cyrillic, Japanese and Latin letters outside cp1252's reach, and the
launcher's own output goes to a pipe in cp1252, as Windows sets it. Through the dry run, a run on
the stand-in trainer (its output carried into train.log), the report (no spelling of the name
left) and comfy. On Linux here, and under the Windows interpreter in CI."""

import json
import os
import subprocess
import sys
import zipfile

import pytest
from test_comfy import comfy_dir, fake_run  # noqa: F401 - fixtures, built under the tmp_path below
from test_run_guards import stand_in  # noqa: F401 - the fixture

from launcher.cli import main

USER = "Zoë_张伟"
FOLDER = f"{USER} данные_日本"
"""The user's name is in the path, as in a Windows home folder (C:\\Users\\<name>\\...)."""


@pytest.fixture
def tmp_path(tmp_path):
    """Every fixture of this module builds under a folder no ANSI code page can spell."""
    folder = tmp_path / FOLDER
    folder.mkdir()
    return folder


def launcher_in_cp1252(*args: str, user: str = USER) -> subprocess.CompletedProcess:
    """The launcher in a process of its own whose streams start in cp1252 (Windows with its output
    to a pipe), its user named `user`."""
    env = {**os.environ, "PYTHONIOENCODING": "cp1252", "PYTHONUTF8": "0", "LOGNAME": user, "USER": user,
           "USERNAME": user}
    return subprocess.run([sys.executable, "-m", "launcher", *args], capture_output=True, env=env, timeout=300)


def test_dry_run_and_a_run_on_the_stand_in_trainer_keep_every_character(stand_in):  # noqa: F811
    dataset = stand_in.dataset
    assert FOLDER in str(dataset)
    dry = launcher_in_cp1252(*stand_in.args("--dry-run"))
    out = dry.stdout.decode("utf-8") + dry.stderr.decode("utf-8")
    assert dry.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert str(stand_in.run_root) in out
    done = launcher_in_cp1252(*stand_in.args())
    out = done.stdout.decode("utf-8") + done.stderr.decode("utf-8")
    assert done.returncode == 0 and "Traceback" not in out, out[-3000:]
    # the stand-in trainer printed its config's path, under the non-ASCII run folder, into train.log
    log = (stand_in.run_root / "train.log").read_bytes().decode("utf-8")
    assert f"stand-in trainer {stand_in.run_root / 'config.yaml'}" in log, log[-2000:]
    assert "\ufffd" not in log


def test_the_report_of_a_non_ascii_user_and_workdir_holds_no_spelling_of_them(stand_in, tmp_path):  # noqa: F811
    assert stand_in.run() == 0
    out = tmp_path / "report.zip"
    done = launcher_in_cp1252("report", "--workdir", str(stand_in.workdir.root), "--no-selftest", "--out", str(out))
    assert done.returncode == 0, done.stderr.decode("utf-8")[-3000:]
    with zipfile.ZipFile(out) as archive:
        members = {name: archive.read(name).decode("utf-8") for name in archive.namelist()}
    workdir = str(stand_in.workdir.root)
    spellings = {USER, json.dumps(USER)[1:-1], workdir, json.dumps(workdir)[1:-1]}  # JSON writes \u00eb, \u5f20
    for name, text in members.items():
        for spelling in spellings:
            assert spelling not in text and spelling not in name, (name, spelling)
    assert any("<user>" in text for text in members.values())  # the preset's path outside the workdir


def test_comfy_hands_over_a_lora_of_a_non_ascii_run(fake_run, comfy_dir, capsys):  # noqa: F811
    workdir, root = fake_run
    assert FOLDER in str(root)
    assert main(["comfy", "--workdir", str(workdir), "--comfy-dir", str(comfy_dir)]) == 0, capsys.readouterr().err
    workflows = list((root / "comfyui").glob("*.api.json"))
    assert workflows and json.loads(workflows[0].read_text(encoding="utf-8"))
    assert list((comfy_dir / "models" / "loras").glob("*.safetensors"))
