"""Patch "atomic checkpoint saves" (toolkit/atomic_checkpoint.py): every crash point of a save.

A save is replayed with a simulated crash at each file-system operation in turn (each
write, fsync and rename): the operation raises and nothing is cleaned up, as after a kill -9.
Whatever the crash point, `find_checkpoint` must then return either the previous set or the
new one, whole: a LoRA, optimizer state and step that were saved together.
"""

import importlib
import json
import os

import pytest

JOB = "tiny_flux2"


class Crash(BaseException):
    """Stands for a kill -9: raised by the n-th file operation, never caught by the code under test."""


@pytest.fixture(scope="module")
def ac(trainer_on_path):
    return importlib.import_module("toolkit.atomic_checkpoint")


@pytest.fixture
def crash_at(ac, monkeypatch):
    """crash_at(n): the n-th write/fsync/rename from now raises Crash; `remove` does nothing
    (a killed process cleans nothing up). crash_at(None) restores everything."""
    real = {"replace": os.replace, "fsync": os.fsync, "remove": ac.remove}
    counter = {"left": None}

    def tick():
        if counter["left"] is not None:
            counter["left"] -= 1
            if counter["left"] == 0:
                raise Crash()

    def replace(src, dst):
        tick()
        real["replace"](src, dst)

    def fsync(fd):
        tick()
        real["fsync"](fd)

    def arm(n):
        counter["left"] = n
        if n is None:
            monkeypatch.setattr(ac.os, "replace", real["replace"])
            monkeypatch.setattr(ac.os, "fsync", real["fsync"])
            monkeypatch.setattr(ac, "remove", real["remove"])
        else:
            monkeypatch.setattr(ac.os, "replace", replace)
            monkeypatch.setattr(ac.os, "fsync", fsync)
            monkeypatch.setattr(ac, "remove", lambda path: None)
        return tick

    return arm


def save(ac, folder, step, lora_name, tick=lambda: None):
    """What the trainer's save() does, with contents that name the step they belong to."""

    def write(path, text):
        tick()
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)

    checkpoint = ac.CheckpointSave(str(folder))
    checkpoint.stage("network", str(folder / lora_name), write, f"lora {step}")
    checkpoint.stage("optimizer", str(folder / "optimizer.pt"), write, f"optimizer {step}" + " " * step)
    checkpoint.commit({"step": step, "epoch": 0})


def read_set(found):
    with open(found["files"]["network"], encoding="utf-8") as handle:
        lora = handle.read()
    with open(found["files"]["optimizer"], encoding="utf-8") as handle:
        optimizer = handle.read().strip()
    return found["step"], lora, optimizer


@pytest.mark.parametrize("same_names", [False, True], ids=["new-file-names", "overwrites-the-last-save"])
def test_a_crash_anywhere_in_a_save_leaves_a_whole_checkpoint(ac, crash_at, tmp_path, same_names):
    def name(step):
        return f"{JOB}.safetensors" if same_names else f"{JOB}_{step:09d}.safetensors"

    seen = set()
    point = 0
    while True:
        point += 1
        folder = tmp_path / f"crash-{point}"
        folder.mkdir()
        crash_at(None)
        save(ac, folder, 1, name(1))
        tick = crash_at(point)
        try:
            save(ac, folder, 2, name(2), tick)
            finished = True
        except Crash:
            finished = False
        crash_at(None)
        found = ac.find_checkpoint(str(folder))
        assert found is not None, f"crash at operation {point}: no checkpoint left"
        step, lora, optimizer = read_set(found)
        assert lora == f"lora {step}" and optimizer == f"optimizer {step}", (point, step, lora, optimizer)
        assert not [p for p in os.listdir(folder) if ac.TEMP_MARK in p], "leftover temporary files"
        seen.add(step)
        if finished:
            assert step == 2
            break
        assert point < 50, "a save should not take 50 file operations"
    assert seen == {1, 2}, "the crash points should cover both outcomes"


def test_first_save_crashed_means_no_checkpoint(ac, crash_at, tmp_path):
    for point in range(1, 8):  # 2 writes, 2 file fsyncs, folder fsync, manifest fsync, manifest rename
        folder = tmp_path / f"first-{point}"
        folder.mkdir()
        tick = crash_at(point)
        with pytest.raises(Crash):
            save(ac, folder, 1, f"{JOB}_000000001.safetensors", tick)
        crash_at(None)
        assert ac.find_checkpoint(str(folder)) is None
        assert os.listdir(folder) == [], "temporary files of the unfinished save are removed"


def test_committed_save_is_rolled_forward(ac, crash_at, tmp_path):
    """Killed right after the manifest replaced: resume renames the staged files into place."""
    folder = tmp_path / "roll"
    folder.mkdir()
    save(ac, folder, 1, f"{JOB}_000000001.safetensors")
    real_replace = os.replace
    calls = []

    def replace_then_crash(src, dst):
        real_replace(src, dst)
        calls.append(dst)
        if dst.endswith(ac.CHECKPOINT_MANIFEST):
            raise Crash()

    crash_at(10**6)
    ac.os.replace = replace_then_crash
    try:
        with pytest.raises(Crash):
            save(ac, folder, 2, f"{JOB}_000000002.safetensors")
    finally:
        crash_at(None)
    manifest = json.loads((folder / ac.CHECKPOINT_MANIFEST).read_text(encoding="utf-8"))
    assert manifest["step"] == 2
    assert not (folder / f"{JOB}_000000002.safetensors").exists()
    found = ac.find_checkpoint(str(folder))
    assert read_set(found) == (2, "lora 2", "optimizer 2")
    assert (folder / f"{JOB}_000000002.safetensors").is_file()


def test_no_manifest_means_upstream_resume(ac, tmp_path):
    (tmp_path / f"{JOB}_000000003.safetensors").write_text("saved by an unpatched trainer")
    (tmp_path / "optimizer.pt").write_text("x")
    assert ac.find_checkpoint(str(tmp_path)) is None
    assert ac.find_checkpoint(str(tmp_path / "missing")) is None


def test_manifest_with_missing_files_is_ignored(ac, tmp_path):
    save(ac, tmp_path, 4, f"{JOB}_000000004.safetensors")
    (tmp_path / "optimizer.pt").unlink()
    assert ac.find_checkpoint(str(tmp_path)) is None


def test_temporary_names_hide_from_the_trainer_globs(ac, tmp_path):
    import glob

    name = ac.temp_name(f"{JOB}_000000005.safetensors", "abc")
    assert name.startswith(".") and name.endswith(".safetensors") and ac.TEMP_MARK in name
    (tmp_path / name).write_text("x")
    for pattern in (f"{JOB}*.safetensors", f"{JOB}*", f"{JOB}_*"):
        assert glob.glob(str(tmp_path / pattern)) == []
