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
