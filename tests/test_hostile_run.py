"""`run` against hostile input, without the trainer (the stand-in of test_run_guards): a resume
with a changed preset, writes through planted links, aliases that expand without bound."""

import json
import signal
import sys
import time
import struct
import zlib
from pathlib import Path

import yaml

import pytest
from conftest import write_png
from test_comfy import NAME, comfy_dir, fake_run, launch  # noqa: F401 - fixtures
from test_run_guards import StandIn, stand_in  # noqa: F401 - the fixture

from launcher.cli import main
from launcher.commands import run as run_command
from launcher.commands.doctor import print_report
from launcher.runs.schema import Vocabulary

CHECKPOINT = "tiny_flux2.safetensors"


def edit_preset(stand_in: StandIn, edit) -> None:
    preset = yaml.safe_load(stand_in.preset.read_text(encoding="utf-8"))
    edit(preset["config"]["process"][0])
    stand_in.preset.write_text(yaml.safe_dump(preset), encoding="utf-8")


def trained(stand_in: StandIn) -> None:
    """A first launch, and a LoRA in its job folder as the trainer leaves one."""
    assert stand_in.run() == 0
    (stand_in.run_root / "tiny_flux2" / CHECKPOINT).write_bytes(b"saved")


# -- resume -------------------------------------------------------------------------------------


def test_a_resume_that_changes_the_network_or_optimizer_is_refused(stand_in, capsys):
    trained(stand_in)
    config_before = (stand_in.run_root / "config.yaml").read_text()

    def shrink(process):
        process["network"]["linear"] = 2
        process["train"]["optimizer"] = "adafactor"
        process["train"]["steps"] = 9
    edit_preset(stand_in, shrink)
    capsys.readouterr()
    assert stand_in.run("--resume", "--accept-changes") == 2
    err = capsys.readouterr().err
    assert "config.process[0].network.linear: the run has 4, now 2" in err
    assert "config.process[0].train.optimizer: the run has 'adamw', now 'adafactor'" in err
    assert "steps" not in err, "only the changes that break the saved state are listed"
    assert "another --output" in err
    assert (stand_in.run_root / "config.yaml").read_text() == config_before
    assert (stand_in.run_root / "tiny_flux2" / CHECKPOINT).read_bytes() == b"saved"


def test_a_resume_with_more_steps_needs_the_flag_and_is_recorded(stand_in, capsys):
    trained(stand_in)
    edit_preset(stand_in, lambda process: process["train"].update(steps=9))
    capsys.readouterr()
    assert stand_in.run("--resume") == 2
    err = capsys.readouterr().err
    assert "config.process[0].train.steps: the run has 2, now 9" in err and "--accept-changes" in err
    assert stand_in.run("--resume", "--accept-changes") == 0
    metadata = json.loads((stand_in.run_root / "tiny_flux2" / "run.json").read_text())
    assert metadata["resume_changes"][0]["changes"] == [{"key": "config.process[0].train.steps", "was": 2, "now": 9}]
    assert stand_in.run("--resume") == 0, "the same preset again resumes without the flag"
    metadata = json.loads((stand_in.run_root / "tiny_flux2" / "run.json").read_text())
    assert len(metadata["resume_changes"]) == 1, "earlier accepted changes stay recorded"


# -- the trainer leaves with its launcher ---------------------------------------------------------


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "State:\tZ" in state  # a zombie waiting for its new parent to reap it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kill -9 and /proc: Linux")
def test_the_trainer_dies_with_a_killed_launcher(stand_in, tmp_path):
    release = tmp_path / "release"
    stand_in.mode(f"wait {release}")
    launcher = stand_in.start()
    pid_file = stand_in.workdir.trainer / "trainer.pid"
    deadline = time.monotonic() + 60
    while not pid_file.is_file():
        assert time.monotonic() < deadline, "the stand-in trainer did not start"
        time.sleep(0.05)
    trainer = int(pid_file.read_text())
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=30)
    try:
        deadline = time.monotonic() + 5
        while not gone(trainer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(trainer), "the trainer outlived its launcher (and the run folder's lock)"
    finally:
        release.touch()


# -- links ------------------------------------------------------------------------------------


def plant_link(link: Path, target: Path, folder: bool = False) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    try:
        link.symlink_to(target, target_is_directory=folder)
    except OSError as error:  # Windows without the symlink privilege
        pytest.skip(f"cannot create a link here: {error}")


@pytest.mark.parametrize("name", ["train.log", "telemetry.jsonl", "trainer-telemetry.jsonl", "run.lock"])
def test_run_does_not_append_through_a_planted_link(stand_in, tmp_path, capsys, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    plant_link(stand_in.run_root / name, victim)
    assert stand_in.run() == 2
    err = capsys.readouterr().err
    assert f"{stand_in.run_root / name} is a link (to {victim}); the launcher does not write through links" in err
    assert victim.read_text() == "keep me"


def test_a_job_folder_that_is_a_link_receives_nothing(stand_in, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plant_link(stand_in.run_root / "tiny_flux2", elsewhere, folder=True)
    assert stand_in.run() == 2
    assert f"{stand_in.run_root / 'tiny_flux2'} is a link" in capsys.readouterr().err
    stand_in.run_root.joinpath("config.yaml").write_text(yaml.safe_dump({"config": {"name": "tiny_flux2", "process": []}}))
    assert main(["save", str(stand_in.run_root), "--workdir", str(stand_in.workdir.root)]) == 2
    assert list(elsewhere.iterdir()) == []


def test_sample_writes_into_no_linked_samples_folder(fake_run, tmp_path, capsys):  # noqa: F811
    workdir, root = fake_run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plant_link(root / "samples", elsewhere, folder=True)
    assert main(["sample", str(root), "--workdir", str(workdir)]) == 2
    assert f"{root / 'samples'} is a link" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []


def test_the_preset_env_cannot_redirect_the_trainers_telemetry(stand_in, tmp_path, capsys):
    stand_in.write_preset(env={"AITK_TELEMETRY": str(tmp_path / "elsewhere.jsonl")})
    assert stand_in.run("--dry-run") == 2
    assert "launcher.env.AITK_TELEMETRY = " in capsys.readouterr().err


def test_comfy_writes_through_no_planted_link(fake_run, comfy_dir, tmp_path, capsys):  # noqa: F811
    workdir, root = fake_run
    victims = [tmp_path / "victim-1", tmp_path / "victim-2"]
    for victim in victims:
        victim.write_text("keep me")
    loras = comfy_dir / "models" / "loras"
    plant_link(loras / f"{NAME}.safetensors.partial", victims[0])
    plant_link(root / "comfyui" / f"{NAME}.workflow.json", victims[1])
    assert launch(workdir, "--comfy-dir", str(comfy_dir)) == 0
    assert [victim.read_text() for victim in victims] == ["keep me", "keep me"]
    placed = loras / f"{NAME}.safetensors"
    assert not placed.is_symlink() and placed.read_bytes() == (root / NAME / f"{NAME}.safetensors").read_bytes()
    assert not (root / "comfyui" / f"{NAME}.workflow.json").is_symlink()


# -- YAML ---------------------------------------------------------------------------------------


def alias_bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_in_a_preset_is_refused_without_expanding_it(stand_in, capsys):
    text = stand_in.preset.read_text(encoding="utf-8")
    stand_in.preset.write_text(text + "bomb:\n" + "".join("  " + line + "\n" for line in alias_bomb(6).splitlines()),
                               encoding="utf-8")
    assert stand_in.run("--dry-run") == 2
    err = capsys.readouterr().err
    assert "is refused: it holds more than 100,000 values once its aliases (*name) are expanded" in err
    assert len(err) < 1000


def test_a_damaged_run_config_is_named_by_save_stop_and_comfy(stand_in, capsys):
    trained(stand_in)
    (stand_in.run_root / "config.yaml").write_text("config: [unclosed\n", encoding="utf-8")
    for command in ("save", "stop", "comfy"):
        capsys.readouterr()
        assert main([command, str(stand_in.run_root), "--workdir", str(stand_in.workdir.root)]) == 2, command
        err = capsys.readouterr().err
        assert f"{stand_in.run_root / 'config.yaml'} is not valid YAML" in err and "Traceback" not in err, command


# -- the dataset as the trainer reads it --------------------------------------------------------


def png(path: Path, width: int, height: int, depth: int = 8, colour: int = 0, transparency: bool = False) -> Path:
    """A PNG whose header says what the test needs; its pixel data is a stub (only the header is read)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    chunks = [chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0))]
    if colour == 3:
        chunks.append(chunk(b"PLTE", b"\x00\x00\x00\xff\xff\xff"))
    if transparency:
        chunks.append(chunk(b"tRNS", b"\x00"))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"".join(chunks) + chunk(b"IDAT", zlib.compress(b"\x00"))
                     + chunk(b"IEND", b""))
    path.with_suffix(".txt").write_text("a photo")
    return path


def test_images_the_trainers_pil_cannot_use_are_named_and_skippable(stand_in, capsys):
    png(stand_in.dataset / "huge.png", 100_000, 100_000)
    png(stand_in.dataset / "grey16.png", 128, 128, depth=16)
    png(stand_in.dataset / "palette.png", 128, 128, colour=3, transparency=True)
    png(stand_in.dataset / "palette_opaque.png", 128, 128, colour=3)
    assert stand_in.run() == 2
    err = capsys.readouterr().err
    assert "3 of 7 images" in err
    assert "huge.png is 100000x100000 px (10,000 Mpx); the trainer's PIL refuses images over 179 Mpx" in err
    assert "grey16.png is a 16-bit greyscale PNG: the trainer's PIL opens it as mode I;16" in err
    assert "palette.png is a palette PNG with transparency" in err
    stand_in.write_preset(skip_bad_images=True)
    assert stand_in.run() == 0
    skipped = json.loads((stand_in.run_root / "tiny_flux2" / "run.json").read_text())["skipped_images"]
    assert sorted(Path(item["file"]).name for item in skipped) == ["grey16.png", "huge.png", "palette.png"]


def test_a_caption_longer_than_the_text_encoder_reads_is_warned(stand_in, capsys):
    stand_in.add_image("long.png", 128, 128, caption=b"word " * 800)
    assert stand_in.run() == 0
    err = capsys.readouterr().err
    assert f"{stand_in.dataset / 'long.txt'} is 4,000 characters (about 1000 tokens); the text encoder reads at most 512" in err


# -- what the trainer would only find at step 1 -------------------------------------------------


def test_a_network_the_4bit_base_cannot_train_is_refused_at_dry_run(stand_in, capsys):
    edit_preset(stand_in, lambda process: process["network"].update(type="lokr"))
    assert stand_in.run("--dry-run") == 2
    err = capsys.readouterr().err
    assert "config.process[0].network.type = 'lokr': the 4-bit base (model.qtype uint4) cannot train it" in err


# -- clear messages -----------------------------------------------------------------------------


def test_a_read_only_output_folder_is_named(stand_in, tmp_path, capsys, monkeypatch):
    output = tmp_path / "read-only"
    output.mkdir()
    output.chmod(0o555)
    make_folder = Path.mkdir

    def as_for_a_user(self, *args, **kwargs):  # root writes into a read-only folder anyway
        if self.parent == output:
            raise PermissionError(13, "Permission denied", str(self))
        return make_folder(self, *args, **kwargs)
    monkeypatch.setattr(Path, "mkdir", as_for_a_user)
    try:
        assert stand_in.run("--output", str(output)) == 2
    finally:
        output.chmod(0o755)
    assert f"cannot create the run folder {output / 'tiny_flux2'} (Permission denied)" in capsys.readouterr().err


def test_every_schema_problem_at_once_with_the_trainers_values(stand_in, capsys, monkeypatch):
    monkeypatch.setattr(run_command, "trainer_vocabulary", lambda workdir, keep: Vocabulary(qtypes={"uint4", "uint8"}))
    def break_it(process):
        process["train"]["steps"] = "ten"
        process["model"]["qtype"] = "int3"
    stand_in.write_preset(telemetry={"interval_s": 0.001})
    edit_preset(stand_in, break_it)
    capsys.readouterr()
    assert stand_in.run("--dry-run") == 2
    err = capsys.readouterr().err
    assert "has 3 problems" in err
    assert "launcher.telemetry.interval_s = 0.001: out of range; allowed: a number >= 0.1, at most 3600" in err
    assert "train.steps = 'ten'" in err and "model.qtype = 'int3'" in err


def test_the_tiny_preset_trains_on_the_dataset_given(stand_in, tmp_path, capsys):
    mine = tmp_path / "mine"
    write_png(mine / "photo.png", 128, 128).with_suffix(".txt").write_text("my photo")
    assert stand_in.run("--dataset", str(mine)) == 0
    assert f"the tiny preset trains on the dataset {mine}" in capsys.readouterr().out
    config = yaml.safe_load((stand_in.run_root / "config.yaml").read_text())
    assert config["config"]["process"][0]["datasets"][0]["folder_path"] == str(mine)


def test_doctor_claims_only_the_allocator_variables_run_sets(stand_in, capsys):
    print_report({"launcher": "x", "platform": {"system": "Linux", "release": "6", "machine": "x86_64", "python": "3"},
                  "workdir": "w", "torch": {"error": "none"},
                  "allocator": dict.fromkeys(("PYTORCH_HIP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")),
                  "memory_gib": {"ram_total": 1, "ram_available": 1, "swap_total": 0}, "free_disk_gib": 1,
                  "selftest": {"summary": "none"}, "warnings": []})
    claimed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if "`run` sets" in line}
    assert stand_in.run("--dry-run") == 0
    printed = {line.split("=")[0] for line in capsys.readouterr().out.splitlines() if "=" in line}
    assert claimed and claimed <= printed, f"doctor says run sets {claimed - printed}, which it does not"


# -- ComfyUI as ComfyUI sees it -------------------------------------------------------------------


def test_comfy_names_the_turbo_lora_the_canvas_workflow_needs(fake_run, comfy_dir, capsys):  # noqa: F811
    workdir, _ = fake_run
    assert launch(workdir, "--comfy-dir", str(comfy_dir)) == 0
    err = capsys.readouterr().err
    assert ("lacks models/loras/Flux_2-Turbo-LoRA_comfyui.safetensors (from Hugging Face ByteZSzn/Flux.2-Turbo-ComfyUI"
            in err) and "even with its switch off" in err


@pytest.mark.parametrize("version, warned", [("0.8.0", True), ("0.19.0", False), ("0.21.1", False), (None, True)])
def test_comfy_warns_about_a_comfyui_too_old_for_the_vae(fake_run, comfy_dir, capsys, version, warned):  # noqa: F811
    workdir, _ = fake_run
    if version:
        (comfy_dir / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')
    assert launch(workdir, "--comfy-dir", str(comfy_dir)) == 0
    err = capsys.readouterr().err
    assert ("0.19.0" in err) == warned
    if version == "0.8.0":
        assert f"ComfyUI 0.8.0 in {comfy_dir} is older than 0.19.0, the first release that loads" in err


def test_comfy_accepts_the_folder_given_to_run_output(fake_run, capsys):  # noqa: F811
    workdir, root = fake_run
    assert launch(workdir, str(root.parent)) == 0
    assert (root / "comfyui" / f"{NAME}.api.json").is_file()
