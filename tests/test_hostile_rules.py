"""Hostile input, round 4: one regression test per case found, each held by a rule that lives in
one place (launcher/user_files.py for what is read, launcher/runs/folders.py for where a run is
written, the schema for preset values, launcher/runs/yaml_files.py for YAML, launcher/field_report.py
for the report). tests/test_fuzz_rules.py draws many more inputs against the same rules."""

import json
import os
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import write_png
from test_comfy import NAME, fake_run  # noqa: F401 - the fixture
from test_run_guards import StandIn, stand_in  # noqa: F401 - the fixture

from launcher import field_report
from launcher.cli import main
from launcher.errors import LauncherError
from launcher.runs import disk_budget
from launcher.runs.dataset import check_dataset
from launcher.runs.presets import PRESETS_DIR
from launcher.runs.schema import check_preset
from launcher.user_files import read_text

posix = pytest.mark.skipif(os.name == "nt", reason="links, FIFOs and /dev/zero as a POSIX user makes them")


def error_line(capsys) -> str:
    """The one `error:` line a refused command printed; never a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def report(workdir: Path, out: Path) -> int:
    return main(["report", "--workdir", str(workdir), "--no-selftest", "--out", str(out)])


def read_zip(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def a_run(runs: Path, name: str, log: str = "step 1\n") -> Path:
    root = runs / name
    (root / name).mkdir(parents=True)
    (root / "config.yaml").write_text(f"config:\n  name: {name}\n", encoding="utf-8")
    (root / name / "run.json").write_text(json.dumps({"preset": "mine.yaml"}), encoding="utf-8")
    (root / "train.log").write_text(log, encoding="utf-8")
    return root


# -- the report -----------------------------------------------------------------------------------


@posix
def test_report_follows_no_linked_run_folder(tmp_path, capsys):
    elsewhere = a_run(tmp_path / "elsewhere", "secret")
    (elsewhere / "secret" / "run.json").write_text('{"private": "elsewhere"}', encoding="utf-8")
    runs = tmp_path / "wd" / "runs"
    a_run(runs, "mine")
    (runs / "r3").symlink_to(elsewhere, target_is_directory=True)
    (runs / "mine" / "telemetry.jsonl").symlink_to(elsewhere / "secret" / "run.json")
    assert report(tmp_path / "wd", tmp_path / "out.zip") == 0
    files = read_zip(tmp_path / "out.zip")
    assert not any(b"elsewhere" in text or b"private" in text for text in files.values())
    assert not any("r3" in name or "secret" in name for name in files)
    assert b"left out: runs/0-mine/telemetry.jsonl.tail" in files["MANIFEST.txt"]


@posix
def test_report_follows_no_linked_runs_folder(tmp_path):
    a_run(tmp_path / "elsewhere", "secret")
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "runs").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert report(tmp_path / "wd", tmp_path / "out.zip") == 0
    assert not any(name.startswith("runs/") for name in read_zip(tmp_path / "out.zip"))


def test_report_scrubs_names_in_any_case_in_member_names_and_text(tmp_path, monkeypatch):
    home = Path(r"C:\Users\alice" if os.name == "nt" else "/home/alice")
    monkeypatch.setenv("USERPROFILE" if os.name == "nt" else "HOME", str(home))  # what Path.home() reads
    monkeypatch.setattr(field_report, "_user", lambda: "alice")
    log = f"user alice_smith, Alice and ALICE; backup at {home}-backup and {home / 'x'}\n"
    a_run(tmp_path / "wd" / "runs", "0-alice", log)
    assert report(tmp_path / "wd", tmp_path / "out.zip") == 0
    files = read_zip(tmp_path / "out.zip")
    for name, text in files.items():
        assert "alice" not in name.lower() and b"alice" not in text.lower(), (name, text[:300])
    tail = files["runs/0-0-<user>/train.log.tail"].decode()
    assert f"user <user>_smith, <user> and <user>; backup at <home>-backup and <home>{os.sep}x" in tail
    assert b"runs/0-0-<user>/train.log.tail" in files["MANIFEST.txt"]


def test_report_carries_the_end_of_a_1_gib_log_only(tmp_path):
    root = a_run(tmp_path / "wd" / "runs", "big")
    with (root / "train.log").open("wb") as handle:  # sparse: no disk used
        handle.seek(2**30)
        handle.write(b"\nthe last line\n")
    assert report(tmp_path / "wd", tmp_path / "out.zip") == 0
    with zipfile.ZipFile(tmp_path / "out.zip") as archive:
        sizes = {info.filename: info.file_size for info in archive.infolist()}
        tail = archive.read("runs/0-big/train.log.tail")
    assert max(sizes.values()) <= field_report.MEMBER_BYTES + 100
    assert tail.endswith(b"the last line\n") and len(tail) <= 256 * 1024


@posix
def test_report_out_a_dangling_link_writes_nothing_at_its_target(tmp_path, capsys):
    target = tmp_path / "target.zip"
    (tmp_path / "out.zip").symlink_to(target)
    assert report(tmp_path / "wd", tmp_path / "out.zip") == 2
    assert not target.exists()
    assert f"{tmp_path / 'out.zip'} is a link (to {target}); the launcher does not write through links" in error_line(capsys)


# -- where a run writes ---------------------------------------------------------------------------


def test_run_output_keeps_a_users_run_json_in_the_job_folder(stand_in, tmp_path, capsys):  # noqa: F811
    mine = tmp_path / "out" / "tiny_flux2" / "tiny_flux2" / "run.json"
    mine.parent.mkdir(parents=True)
    mine.write_text("my notes", encoding="utf-8")
    assert stand_in.run("--output", str(tmp_path / "out")) == 2
    assert mine.read_text(encoding="utf-8") == "my notes"
    assert sorted(p.name for p in mine.parent.parent.iterdir()) == ["tiny_flux2"]
    assert "holds files no launch wrote (tiny_flux2/run.json)" in error_line(capsys)


def test_run_output_refuses_a_file_named_like_the_job_folder(stand_in, tmp_path, capsys):  # noqa: F811
    mine = tmp_path / "out" / "tiny_flux2" / "tiny_flux2"
    mine.parent.mkdir(parents=True)
    mine.write_text("a user's file", encoding="utf-8")
    assert stand_in.run("--output", str(tmp_path / "out")) == 2
    assert sorted(p.name for p in mine.parent.iterdir()) == ["tiny_flux2"]
    assert f"{mine} is a file where the trainer keeps the run's job folder" in error_line(capsys)


@posix
def test_a_linked_runs_folder_receives_nothing_from_run_or_stop(stand_in, tmp_path, capsys):  # noqa: F811
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stand_in.workdir.runs.symlink_to(elsewhere, target_is_directory=True)
    assert stand_in.run() == 2
    assert f"{stand_in.workdir.runs} leads out of the workdir" in error_line(capsys)
    assert list(elsewhere.iterdir()) == []
    a_run(elsewhere, "old")
    before = sorted(elsewhere.rglob("*"))
    assert main(["stop", "--workdir", str(stand_in.workdir.root)]) == 2
    assert "leads out of the workdir" in error_line(capsys)
    assert sorted(elsewhere.rglob("*")) == before


@posix
def test_a_run_folder_linked_elsewhere_receives_no_flag(tmp_path, capsys):
    runs = tmp_path / "wd" / "runs"
    elsewhere = a_run(tmp_path / "elsewhere", "r3")
    runs.mkdir(parents=True)
    (runs / "r3").symlink_to(elsewhere, target_is_directory=True)
    for spec in ("r3", None):
        assert main(["stop", *([spec] if spec else []), "--workdir", str(tmp_path / "wd")]) == 2
        assert f"the run folder {runs / 'r3'} is a link" in error_line(capsys)
    assert not (elsewhere / "r3" / "STOP_NOW").exists()


@posix
def test_run_refuses_a_run_folder_linked_to_another_run_of_the_output(stand_in, capsys):  # noqa: F811
    other = stand_in.workdir.runs / "other"
    other.mkdir(parents=True)
    stand_in.run_root.symlink_to(other, target_is_directory=True)
    assert stand_in.run() == 2
    assert f"the run folder {stand_in.run_root} is a link" in error_line(capsys)
    assert list(other.iterdir()) == []


# -- a damaged run config -------------------------------------------------------------------------


@pytest.mark.parametrize("process, words", [
    (5, "config.process = 5: not a list"),
    ([], "config.process = []: too few items"),
    ([{"model": 3}], "config.process[0].model = 3: not a mapping"),
    ([{}], "config.process[0].model is missing"),
    ([{"model": {"name_or_path": "m"}, "datasets": [{"folder_path": 7}]}], "config.process[0].datasets[0].folder_path = 7"),
    ([{"model": {"name_or_path": "m"}, "sample": {"width": "big"}}], "config.process[0].sample.width = 'big'"),
])
@pytest.mark.parametrize("command", ["sample", "comfy"])
def test_sample_and_comfy_name_a_damaged_run_config(fake_run, capsys, command, process, words):  # noqa: F811
    workdir, root = fake_run
    (root / "config.yaml").write_text(yaml.safe_dump({"config": {"name": NAME, "process": process}}), encoding="utf-8")
    assert main([command, str(root), "--workdir", str(workdir)]) == 2
    line = error_line(capsys)
    assert f"{root / 'config.yaml'}: {words}" in line and "damaged" in line, line


# -- dataset files --------------------------------------------------------------------------------


@posix
def test_a_caption_linked_to_dev_zero_is_refused_unread(stand_in, capsys):  # noqa: F811
    caption = stand_in.dataset / "image_0.txt"
    caption.unlink()
    caption.symlink_to("/dev/zero")
    assert stand_in.run("--dry-run") == 2
    err = capsys.readouterr().err
    assert "image_0.png has a caption image_0.txt that is a device, not a regular file" in err


@posix
def test_an_image_that_is_a_fifo_is_refused_without_blocking(stand_in, capsys):  # noqa: F811
    os.mkfifo(stand_in.dataset / "pipe.png")
    (stand_in.dataset / "pipe.txt").write_text("a photo")
    assert stand_in.run("--dry-run") == 2
    assert "pipe.png is a FIFO (named pipe), not a regular file" in capsys.readouterr().err


def test_the_disk_check_counts_the_images_of_subfolders(tmp_path):
    for folder in (tmp_path / "flat", tmp_path / "nested" / "sub"):
        for index in range(3):
            write_png(folder / f"{index}.png", 64, 64)
    dataset = {"resolution": [512], "cache_latents_to_disk": True}
    flat = disk_budget._dataset_needs({**dataset, "folder_path": str(tmp_path / "flat")}, True)
    nested = disk_budget._dataset_needs({**dataset, "folder_path": str(tmp_path / "nested")}, True)
    assert [need.gib for need in nested] == [need.gib for need in flat] and flat[0].gib > 0


@pytest.mark.parametrize("caption, reason", [
    ("a photo of sks".encode("utf-16-le"), "holds a NUL byte at byte 1 (it looks like UTF-16 without a byte-order mark)"),
    ("a photo".encode("utf-16"), "is UTF-16 text (it starts with a byte-order mark); save it as UTF-8"),
    (b"a photo\x00of sks", "holds a NUL byte at byte 7; save it as UTF-8 text"),
])
def test_captions_that_are_not_utf8_text_are_named(tmp_path, caption, reason):
    write_png(tmp_path / "a.png", 128, 128).with_suffix(".txt").write_bytes(caption)
    with pytest.raises(LauncherError) as raised:
        check_dataset(tmp_path)
    assert f"a.png has a caption a.txt that {reason}" in str(raised.value)


def test_an_empty_caption_is_warned(stand_in, capsys):  # noqa: F811
    (stand_in.dataset / "image_1.txt").write_text("  \n")
    assert stand_in.run("--dry-run") == 0
    assert "1 caption file(s) are empty" in capsys.readouterr().err


# -- sample and comfy -----------------------------------------------------------------------------


def test_sample_size_0_is_refused(fake_run, capsys):  # noqa: F811
    workdir, root = fake_run
    assert main(["sample", str(root), "--workdir", str(workdir), "--size", "0"]) == 2
    assert "--size 0: FLUX.2 takes a multiple of 16 from 64 to 2048 px" in error_line(capsys)


def dataset_of(root: Path) -> Path:
    config = yaml.safe_load((root / "config.yaml").read_text(encoding="utf-8"))
    return Path(config["config"]["process"][0]["datasets"][0]["folder_path"])


def test_comfy_takes_its_prompt_from_an_images_caption_not_a_notes_file(fake_run, capsys):  # noqa: F811
    workdir, root = fake_run
    (dataset_of(root) / "0-notes.txt").write_text("private notes", encoding="utf-8")
    (dataset_of(root) / "00.txt").mkdir()
    assert main(["comfy", str(root), "--workdir", str(workdir)]) == 0
    workflow = (root / "comfyui" / f"{NAME}.api.json").read_text(encoding="utf-8")
    assert "private notes" not in workflow and "a photo of sks on a white background" in workflow


@pytest.mark.parametrize("command", ["comfy", "sample"])
def test_a_caption_that_is_a_folder_or_not_utf8_is_one_line(fake_run, capsys, command):  # noqa: F811
    workdir, root = fake_run
    data = dataset_of(root)
    (data / "a.txt").unlink()
    (data / "a.txt").mkdir()
    (data / "b.txt").write_bytes(b"\xff\xfe caption")
    assert main([command, str(root), "--workdir", str(workdir)]) == 2
    line = error_line(capsys)
    assert f"no usable caption in the run's dataset: {data / 'a.txt'} is a folder, not a regular file" in line
    assert "--prompt" in line


# -- YAML and preset values -----------------------------------------------------------------------


def test_a_string_alias_bomb_is_refused_by_its_expanded_bytes(stand_in, capsys):  # noqa: F811
    text = stand_in.preset.read_text(encoding="utf-8")
    bomb = "bomb:\n  text: &t " + "x" * 100_000 + "\n  copies: [" + ", ".join(["*t"] * 5000) + "]\n"
    stand_in.preset.write_text(text + bomb, encoding="utf-8")
    assert stand_in.run("--dry-run") == 2
    line = error_line(capsys)
    assert "is refused: it holds more than 4,194,304 characters of text once its aliases (*name) are expanded" in line
    assert len(line) < 1000


TINY = yaml.safe_load((PRESETS_DIR / "tiny.yaml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["network"].update(linear=100_000),
     "config.process[0].network.linear = 100000: out of range; allowed: a whole number >= 1, at most 1,024"),
    (lambda p: p["network"].update(linear=10**20), "network.linear = 100000000000000000000: out of range"),
    (lambda p: p["model"]["model_kwargs"].update(cache_staging_mib=10**26),
     "model_kwargs.cache_staging_mib = 100000000000000000000000000: out of range; allowed: a whole number >= 4, "
     "at most 65,536"),
    (lambda p: p["model"]["model_kwargs"].update(text_phase_budget_mib=10**12), "text_phase_budget_mib = 1000000000000"),
    (lambda p: p["train"].update(steps=10**9), "train.steps = 1000000000: out of range"),
    (lambda p: p["datasets"][0].update(resolution=[512, 65536]), "resolution[1] = 65536: out of range"),
    (lambda p: p["save"].update(max_step_saves_to_keep=10**6), "max_step_saves_to_keep = 1000000: out of range"),
])
def test_preset_values_past_what_a_human_means_are_refused(edit, message):
    data = json.loads(json.dumps(TINY))
    edit(data["config"]["process"][0])
    found = check_preset(data)
    assert any(message in item for item in found), found


def test_a_huge_rank_is_refused_before_the_disk_arithmetic(stand_in, capsys):  # noqa: F811
    preset = yaml.safe_load(stand_in.preset.read_text(encoding="utf-8"))
    preset["config"]["process"][0]["network"]["linear"] = 100_000
    stand_in.preset.write_text(yaml.safe_dump(preset), encoding="utf-8")
    assert stand_in.run("--dry-run") == 2
    err = capsys.readouterr().err
    assert "network.linear = 100000: out of range" in err and "GiB" not in err


# -- the reader itself ----------------------------------------------------------------------------


@posix
def test_the_reader_follows_no_link_below_its_folder(tmp_path):
    (tmp_path / "real.txt").write_text("text")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "linked.txt").symlink_to(tmp_path / "real.txt")
    assert read_text(tmp_path / "run" / "linked.txt", "caption") == "text"
    with pytest.raises(LauncherError, match="linked.txt is a link; the launcher follows no link here"):
        read_text(tmp_path / "run" / "linked.txt", "caption", within=tmp_path)


# -- found by tests/test_fuzz_rules.py ------------------------------------------------------------


@pytest.mark.parametrize("command", ["stop", "save"])
def test_stop_and_save_name_a_file_where_the_job_folder_goes(fake_run, capsys, command):  # noqa: F811
    workdir, root = fake_run
    job = root / NAME
    for path in sorted(job.iterdir()):
        path.unlink()
    job.rmdir()
    job.write_text("a user's file")
    assert main([command, str(root), "--workdir", str(workdir)]) == 2
    assert f"{job} is a file where the trainer keeps the run's job folder" in error_line(capsys)
    assert job.read_text() == "a user's file"


@posix
def test_report_does_not_block_on_a_fifo_at_the_trainer_telemetry(tmp_path):
    root = a_run(tmp_path / "wd" / "runs", "piped")
    os.mkfifo(root / "trainer-telemetry.jsonl")
    os.mkfifo(root / "telemetry.jsonl")
    assert report(tmp_path / "wd", tmp_path / "out.zip") == 0
    manifest = read_zip(tmp_path / "out.zip")["MANIFEST.txt"].decode()
    assert "left out: runs/0-piped/telemetry.jsonl.tail: is a FIFO (named pipe), not a regular file" in manifest
