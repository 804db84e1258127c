"""`sample` on the shared tiny run, and in-training samples (wall 6) on a tiny run of their own.

The images of the random-weight tiny model are noise; what these tests check is the machinery:
the files, the contact sheet's layout, the telemetry rows around each in-training sample and
that memory after sampling is what it was before. Finite, non-constant images, strengths that
differ and seeds that repeat are asserted on the model itself in
tests/trainer_patches/test_lora_sampler.py.
"""

import json

import pytest
from tiny_run import run_tiny, tiny_preset

from launcher.cli import main
from launcher.runs.folders import RunFolder

pytestmark = pytest.mark.trainer

SIZE = 128
GAP = 4  # toolkit/lora_sampler.py's SHEET_GAP
HOST_GROWTH_GIB = 0.25
"""How much host RSS may grow across all of a run's samples: allocator noise, not a model copy."""


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_sample_writes_a_png_per_prompt_and_strength_and_one_contact_sheet(trained_tiny_run, capsys):
    run, workdir = trained_tiny_run
    code = main(["sample", str(run.root), "--workdir", str(workdir.root), "--size", str(SIZE), "--steps", "2",
                 "--prompt", "a red square", "--prompt", "a blue circle", "--strength", "0,0.5,1"])
    assert code == 0, capsys.readouterr().err[-3000:]
    folder = run.samples / "final"
    names = sorted(p.name for p in folder.glob("*.png"))
    assert names == sorted([f"p{row}_s{s}.png" for row in (0, 1) for s in ("0", "0.5", "1")] + ["contact_sheet.png"])
    assert png_size(folder / "p0_s1.png") == (SIZE, SIZE)
    assert png_size(folder / "contact_sheet.png") == (3 * SIZE + 2 * GAP, 2 * SIZE + GAP), "3 strengths x 2 prompts"


def test_in_training_samples_leave_nothing_resident(trainer_workdir, tmp_path):
    preset = tiny_preset(tmp_path / "sampling.yaml", name="tiny_sampling", steps=2,
                         train={"disable_sampling": False}, launcher={"sampling": "force"},
                         process={"sample": {"sampler": "flowmatch", "sample_every": 1, "width": SIZE, "height": SIZE,
                                             "prompts": ["a photo of a red square"], "sample_steps": 2, "seed": 42}})
    result = run_tiny(trainer_workdir.root, preset, tmp_path / "out")
    assert result.returncode == 0, result.stdout[-6000:]
    assert "in-training sampling on: forced by the preset" in result.stdout
    run = RunFolder(tmp_path / "out" / "tiny_sampling", "tiny_sampling")
    # the baseline before the first step, each sample_every step, and the end of training
    assert sorted(p.parent.name for p in run.samples.glob("*/contact_sheet.png")) == ["0", "1", "2"]
    for sheet in run.samples.glob("*/contact_sheet.png"):
        assert png_size(sheet) == (2 * SIZE + GAP, SIZE), "strengths 0 and 1 of one prompt"
    rows = [json.loads(line) for line in run.trainer_telemetry.read_text(encoding="utf-8").splitlines()]
    starts = [row for row in rows if row.get("event") == "sample_start"]
    ends = [row for row in rows if row.get("event") == "sample"]
    assert len(starts) == len(ends) == 3 and all(row["images"] == 2 and row["seconds"] > 0 for row in ends)
    assert ends[-1]["host_rss_gib"] - starts[0]["host_rss_gib"] < HOST_GROWTH_GIB
    for before, after in zip(starts, ends):
        if before["vram_allocated_gib"] is not None:  # on a GPU: nothing left on the device
            assert after["vram_allocated_gib"] <= before["vram_allocated_gib"] + 0.01
    assert main(["plot", str(run.root), "--workdir", str(trainer_workdir.root), "--out", str(tmp_path / "p.png")]) == 0
    width, _ = png_size(tmp_path / "p.png")
    assert width > 1800, "the newest contact sheet is beside the curves (a column of its own)"
