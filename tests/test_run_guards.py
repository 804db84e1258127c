"""`run` around the trainer, without the trainer: one run per folder, the trainer's exit code
and signals in words, bad dataset files refused or skipped, nothing written outside.

The workdir here holds a stand-in trainer (a run.py that exits, kills itself or waits, as
`mode.txt` says), this interpreter as its venv's python, and a tiny-assets manifest whose
dataset is a folder of small PNGs, so the whole of `run` executes in about a second.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, write_png

from launcher.cli import main
from launcher.envs.workdir import Workdir, venv_python
from launcher.in_trainer import tiny_assets
from launcher.runs.presets import PRESETS_DIR
from launcher.runs.run_lock import INFO_FILE

STAND_IN = """
import os, signal, sys, time
from pathlib import Path
mode, _, arg = (Path(__file__).parent / "mode.txt").read_text().strip().partition(" ")
(Path(__file__).parent / "trainer.pid").write_text(str(os.getpid()))
print("stand-in trainer", sys.argv[-1], flush=True)
if mode == "exit":
    sys.exit(int(arg))
if mode == "signal":
    os.kill(os.getpid(), getattr(signal, arg))
if mode == "wait":
    while not Path(arg).exists():
        time.sleep(0.05)
"""


def copy_interpreter(python: Path) -> None:
    """The venv `python -m venv --copies` made on Windows: python.exe with its DLLs, and a
    pyvenv.cfg naming this installation, whose stdlib and site-packages it then uses."""
    home = Path(sys.executable).parent
    for pattern in ("python.exe", "python*.dll", "vcruntime*.dll"):
        for item in home.glob(pattern):
            try:
                os.link(item, python.parent / item.name)  # a hard link needs no rights, on one volume
            except OSError:
                shutil.copyfile(item, python.parent / item.name)
    (python.parent.parent / "pyvenv.cfg").write_text(f"home = {home}\ninclude-system-site-packages = true\n", encoding="utf-8")


class StandIn:
    def __init__(self, root: Path) -> None:
        self.workdir = Workdir(root / "wd")
        self.preset = root / "preset.yaml"
        self.dataset = self.workdir.assets / "tiny" / tiny_assets.DATASET_DIR
        self.run_root = self.workdir.runs / "tiny_flux2"
        trainer = self.workdir.trainer
        trainer.mkdir(parents=True)
        (trainer / "run.py").write_text(STAND_IN, encoding="utf-8")
        python = venv_python(self.workdir.venv)
        python.parent.mkdir(parents=True)
        try:
            python.symlink_to(sys.executable)
        except OSError as error:
            if os.name != "nt":
                pytest.skip(f"cannot link an interpreter here: {error}")
            copy_interpreter(python)  # Windows grants links by default to admins only
        manifest = {"format": tiny_assets.ASSETS_FORMAT, "seed": tiny_assets.DEFAULT_SEED, "name_or_path": ".",
                    "dataset": tiny_assets.DATASET_DIR, "resolution": 128,
                    "model_kwargs": {"flux2_params": {}, "ae_params": {}, "text_encoder_path": "text_encoder"}}
        (self.workdir.assets / "tiny").mkdir(parents=True)
        (self.workdir.assets / "tiny" / tiny_assets.MANIFEST_NAME).write_text(json.dumps(manifest))
        for index in range(3):
            self.add_image(f"image_{index}.png", 128, 128)
        self.write_preset()
        self.mode("exit 0")

    def add_image(self, name: str, width: int, height: int, caption: bytes = b"a photo") -> Path:
        image = write_png(self.dataset / name, width, height)
        image.with_suffix(".txt").write_bytes(caption)
        return image

    def write_preset(self, **launcher) -> None:
        preset = yaml.safe_load((PRESETS_DIR / "tiny.yaml").read_text(encoding="utf-8"))
        preset["launcher"].update(launcher)
        self.preset.write_text(yaml.safe_dump(preset), encoding="utf-8")

    def mode(self, text: str) -> None:
        (self.workdir.trainer / "mode.txt").write_text(text, encoding="utf-8")

    def args(self, *extra: str) -> list[str]:
        return ["run", str(self.preset), "--workdir", str(self.workdir.root), *extra]

    def run(self, *extra: str) -> int:
        return main(self.args(*extra))

    def start(self) -> subprocess.Popen:
        """`run` in another process, returned once it holds the run folder's lock."""
        process = subprocess.Popen([sys.executable, "-m", "launcher", *self.args()], cwd=REPO_ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (self.run_root / INFO_FILE).is_file():
            assert process.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.05)
        return process


@pytest.fixture
def stand_in(tmp_path) -> StandIn:
    return StandIn(tmp_path)


# -- exit codes ---------------------------------------------------------------------------------


def test_launcher_exits_with_the_trainers_code(stand_in, capsys):
    stand_in.mode("exit 3")
    assert stand_in.run() == 3
    assert "the trainer exited with code 3" in capsys.readouterr().err


def test_a_finished_trainer_exits_zero_and_leaves_run_json(stand_in, capsys):
    assert stand_in.run() == 0
    assert "the trainer finished (exit code 0)" in capsys.readouterr().out
    metadata = json.loads((stand_in.run_root / "tiny_flux2" / "run.json").read_text())
    assert metadata["skipped_images"] == []
    assert not (stand_in.run_root / INFO_FILE).exists(), "the lock info goes with the lock"


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("name, words", [("SIGKILL", "out-of-memory killer"), ("SIGSEGV", "native code"),
                                          ("SIGTERM", "another process")])
def test_a_trainer_killed_by_a_signal_is_named_in_words(stand_in, capsys, name, words):
    stand_in.mode(f"signal {name}")
    number = getattr(signal, name).value
    assert stand_in.run() == 128 + number
    err = capsys.readouterr().err
    assert f"the trainer was killed by {name} ({number})" in err and words in err


# -- one run per folder -------------------------------------------------------------------------


def test_a_second_run_on_a_busy_folder_says_who_holds_it(stand_in, tmp_path, capsys):
    release = tmp_path / "release"
    stand_in.mode(f"wait {release}")
    first = stand_in.start()
    try:
        assert stand_in.run() == 2
        err = capsys.readouterr().err
        assert f"{stand_in.run_root} is in use by another run: pid {first.pid}" in err
        assert "python -m launcher stop" in err
    finally:
        release.touch()
        assert first.wait(timeout=60) == 0
    stand_in.mode("exit 0")
    assert stand_in.run() == 0, "the lock is released when the first run ends"


@pytest.mark.skipif(os.name == "nt", reason="kill -9 of the launcher is a POSIX test")
def test_the_lock_dies_with_a_killed_launcher(stand_in, tmp_path):
    release = tmp_path / "release"
    stand_in.mode(f"wait {release}")
    first = stand_in.start()
    stand_in.mode("exit 0")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    try:
        assert stand_in.run() == 0, "no stale lock after kill -9"
    finally:
        release.touch()  # ends the orphaned stand-in trainer


# -- the dataset --------------------------------------------------------------------------------


def break_dataset(stand_in: StandIn) -> None:
    (stand_in.dataset / "notes.png").write_text("this is text, not an image")
    stand_in.add_image("icon.png", 1, 1)
    stand_in.add_image("latin1.png", 128, 128, caption="caf\xe9".encode("latin-1"))


def test_bad_dataset_files_are_named_before_training(stand_in, capsys):
    break_dataset(stand_in)
    assert stand_in.run() == 2
    err = capsys.readouterr().err
    assert "3 of 6 images in the dataset" in err
    assert "notes.png is not a PNG, JPEG or WebP image" in err
    assert "icon.png is 1x1 px; both sides must be at least 64 px" in err
    assert "latin1.png has a caption latin1.txt that is not UTF-8 text" in err
    assert "skip_bad_images: true" in err
    assert not stand_in.run_root.exists(), "nothing is written for a refused run"


def test_skip_bad_images_trains_on_the_rest_and_records_what_it_skipped(stand_in, capsys):
    break_dataset(stand_in)
    stand_in.write_preset(skip_bad_images=True)
    assert stand_in.run() == 0
    assert "skipping 3 of 6 images" in capsys.readouterr().err
    config = yaml.safe_load((stand_in.run_root / "config.yaml").read_text())
    listed = Path(config["config"]["process"][0]["datasets"][0]["dataset_path"])
    assert listed.parent == stand_in.run_root
    assert sorted(Path(p).name for p in json.loads(listed.read_text())) == [f"image_{i}.png" for i in range(3)]
    skipped = json.loads((stand_in.run_root / "tiny_flux2" / "run.json").read_text())["skipped_images"]
    assert sorted(Path(item["file"]).name for item in skipped) == ["icon.png", "latin1.png", "notes.png"]
    assert all(item["reason"] for item in skipped)


def test_skip_bad_images_with_nothing_good_left(stand_in, capsys):
    for path in stand_in.dataset.glob("image_*.png"):
        path.write_text("not an image")
    stand_in.write_preset(skip_bad_images=True)
    assert stand_in.run() == 2
    assert "No usable image is left" in capsys.readouterr().err


# -- paths --------------------------------------------------------------------------------------


def test_output_that_is_a_file(stand_in, tmp_path, capsys):
    (tmp_path / "out").write_text("")
    assert stand_in.run("--output", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert f"--output {tmp_path / 'out'} is a file" in err


def test_a_run_folder_that_is_a_link_out_of_the_output_is_refused(stand_in, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stand_in.workdir.runs.mkdir()
    try:
        stand_in.run_root.symlink_to(elsewhere, target_is_directory=True)
    except OSError as error:  # Windows without the symlink privilege
        pytest.skip(f"cannot create a link here: {error}")
    assert stand_in.run() == 2
    assert "not in" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []


def test_a_workdir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "wd").write_text("")
    assert main(["run", "tiny", "--workdir", str(tmp_path / "wd")]) == 2
    assert "is a file" in capsys.readouterr().err
