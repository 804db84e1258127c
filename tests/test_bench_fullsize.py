"""bench/fullsize.py launch: a launch that could not train at its resolution is refused before it
starts (the trainer trains images smaller than the resolution at their own size, so the figures
would be another resolution's under this one's label and plan)."""

import json
from pathlib import Path

from bench import fullsize

REPO = Path(__file__).resolve().parents[1]


def prepared(root: Path, image_size: int) -> Path:
    (root / "assets").mkdir(parents=True)
    (root / "assets" / fullsize.PREPARED).write_text(json.dumps({"image_size": image_size}), encoding="utf-8")
    return root


def test_a_resolution_above_the_prepared_images_is_refused_before_the_launch(tmp_path, capsys):
    root = prepared(tmp_path / "R", 512)
    code = fullsize.main(["launch", "--root", str(root), "--preset", str(REPO / "presets" / "base_512.yaml"),
                          "--label", "x_1024", "--set", "datasets.0.resolution", "[1024]"])
    assert code == 2
    err = capsys.readouterr().err
    assert "x_1024: resolution 1024 is above the 512 px images" in err and "--image-size 1024" in err
    assert not (root / "presets").exists() and not (root / "runs").exists()


def test_resolutions_within_the_prepared_images_and_older_assets_pass(tmp_path):
    process = {"datasets": [{"resolution": [512, 768]}]}
    assert fullsize.too_large(tmp_path / "older", process) is None  # assets prepared before the check
    assert "resolution 768" in fullsize.too_large(prepared(tmp_path / "512", 512) / "assets", process)
    assert fullsize.too_large(prepared(tmp_path / "768", 768) / "assets", process) is None
    broken = prepared(tmp_path / "broken", 768) / "assets"
    (broken / fullsize.PREPARED).write_text("[768]", encoding="utf-8")
    assert "prepared.json is not what `prepare` writes" in fullsize.too_large(broken, process)


def test_the_allocator_retries_within_the_timed_steps_are_counted_apart(tmp_path):
    """A launch's telemetry: retries while loading and in the 2 warm-up steps, then within the timed
    steps; the latter are what a streamed step pays (each a device-wide synchronisation)."""
    rows = [{"time": 100.0, "event": "start"}, {"time": 101.0, "event": "load", "vram_alloc_retries": 4},
            {"time": 101.5, "step": None, "vram_alloc_retries": 4}]  # a row written before the first step
    rows += [{"time": 102.0 + step, "step": step, "s_per_it": 0.5, "vram_alloc_retries": count}
             for step, count in [(1, 6), (2, 9), (3, 9), (4, 11), (5, 14)]]
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer-telemetry.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    figures = fullsize.telemetry_figures(tmp_path, started=90.0, skip=2)
    assert figures["vram_alloc_retries"] == 14 and figures["vram_alloc_retries_timed"] == 5
    assert figures["s_per_it_median"] == 0.5 and figures["to_first_step_s"] == 10.0
    for row in rows:
        row.pop("vram_alloc_retries", None)
    (run / "trainer-telemetry.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    assert fullsize.telemetry_figures(tmp_path, started=90.0)["vram_alloc_retries_timed"] is None
