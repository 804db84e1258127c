"""Preset loading and rendering: the launcher block is split off, machine paths are filled in."""

import re
from pathlib import Path

import pytest

from launcher.errors import LauncherError
from launcher.runs.presets import find_preset, load_preset, render

pytest.importorskip("yaml")

MANIFEST = {
    "name_or_path": "/assets/tiny",
    "dataset": "/assets/tiny/dataset",
    "resolution": 128,
    "model_kwargs": {"flux2_params": {"hidden_size": 64}, "text_encoder_path": "/assets/tiny/te"},
}


def test_shipped_tiny_preset_is_found_by_name():
    assert find_preset("tiny").name == "tiny.yaml"


def test_unknown_preset_names_the_shipped_ones():
    with pytest.raises(LauncherError, match="tiny"):
        find_preset("no-such-preset")


def test_tiny_preset_splits_launcher_block():
    preset = load_preset("tiny")
    assert preset.tiny and preset.name == "tiny_flux2"
    assert preset.env["HF_HUB_OFFLINE"] == "1"
    assert "launcher" not in preset.config


def test_render_fills_run_folder_and_tiny_assets(tmp_path):
    preset = load_preset("tiny")
    config = render(preset, tmp_path / "runs" / "x", MANIFEST)
    process = config["config"]["process"][0]
    assert Path(process["training_folder"]) == (tmp_path / "runs" / "x").resolve()
    assert process["model"]["name_or_path"] == "/assets/tiny"
    assert process["model"]["model_kwargs"]["flux2_params"] == {"hidden_size": 64}
    assert process["datasets"][0]["folder_path"] == "/assets/tiny/dataset"
    assert process["datasets"][0]["resolution"] == [128]
    assert preset.config["config"]["process"][0]["model"]["model_kwargs"] == {}  # preset untouched


def test_preset_comments_carry_no_benchmark_figures():
    """Figures drift; a preset comment may point to bench/RESULTS.md, not quote it."""
    figure = re.compile(r"\d\s*(GiB|MiB|s/it|s/step|it/s|TFLOP|ms\b|x bf16)")
    found = [f"{path.name}:{number}: {line.strip()}"
             for path in sorted((Path(__file__).resolve().parents[1] / "presets").glob("*.yaml"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if "#" in line and figure.search(line.split("#", 1)[1])]
    assert not found, "benchmark figures in preset comments (point to bench/RESULTS.md instead):\n" + "\n".join(found)
