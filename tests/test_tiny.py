"""The tiny FLUX.2 shape rules and manifest; the builders are tested in trainer_patches/test_tiny_assets.py."""

import json

import pytest

from launcher.errors import LauncherError
from launcher.in_trainer import tiny_assets as tiny


def test_shapes_fit_the_flux2_code_and_uint4():
    flux2, ae = tiny.FLUX2_PARAMS, tiny.AE_PARAMS
    assert flux2["context_in_dim"] == 3 * tiny.TE_HIDDEN  # hidden states 10, 20, 30 stacked
    assert tiny.TE_LAYERS >= 30
    assert sum(flux2["axes_dim"]) == flux2["hidden_size"] // flux2["num_heads"]
    mlp = int(flux2["hidden_size"] * flux2["mlp_ratio"])
    for width in (flux2["in_channels"], flux2["context_in_dim"], flux2["hidden_size"], mlp, tiny.TE_HIDDEN):
        assert width % 64 == 0, width  # torchao uint4 Linear input widths
    assert ae["z_channels"] * 4 == flux2["in_channels"] == 128  # 2x2 pixel shuffle; pipeline's 128
    assert len(ae["ch_mult"]) == 4  # 8x downsampling, 16x with the shuffle
    assert all(ae["ch"] * mult % 32 == 0 for mult in ae["ch_mult"])  # GroupNorm(32)
    assert tiny.IMAGE_SIZE % 16 == 0


def test_manifest_must_match_seed_and_format(tmp_path):
    assert tiny.read_manifest(tmp_path, 0) is None
    manifest = tmp_path / tiny.MANIFEST_NAME
    manifest.write_text(json.dumps({"format": tiny.ASSETS_FORMAT, "seed": 0}), encoding="utf-8")
    assert tiny.read_manifest(tmp_path, 0) == {"format": tiny.ASSETS_FORMAT, "seed": 0}
    assert tiny.read_manifest(tmp_path, 1) is None
    manifest.write_text(json.dumps({"format": tiny.ASSETS_FORMAT - 1, "seed": 0}), encoding="utf-8")
    assert tiny.read_manifest(tmp_path, 0) is None


def test_manifest_paths_follow_the_folder_when_it_moves(tmp_path):
    from launcher.runs import tiny as runs_tiny

    relative = {"format": tiny.ASSETS_FORMAT, "seed": 0, "name_or_path": ".", "dataset": tiny.DATASET_DIR,
                "model_kwargs": {"text_encoder_path": tiny.TEXT_ENCODER_DIR}}
    first = tmp_path / "first"
    first.mkdir()
    (first / tiny.MANIFEST_NAME).write_text(json.dumps(relative), encoding="utf-8")
    moved = first.rename(tmp_path / "moved")
    manifest = runs_tiny.read_manifest(moved, 0)
    assert manifest["name_or_path"] == str(moved.resolve())
    assert manifest["dataset"] == str(moved.resolve() / tiny.DATASET_DIR)
    assert manifest["model_kwargs"]["text_encoder_path"] == str(moved.resolve() / tiny.TEXT_ENCODER_DIR)


def test_manifest_naming_a_path_outside_its_folder_is_refused(tmp_path):
    from launcher.runs import tiny as runs_tiny

    for escape in ("../elsewhere", str(tmp_path / "elsewhere")):
        manifest = {"format": tiny.ASSETS_FORMAT, "seed": 0, "name_or_path": ".", "dataset": escape,
                    "model_kwargs": {"text_encoder_path": tiny.TEXT_ENCODER_DIR}}
        (tmp_path / "assets").mkdir(exist_ok=True)
        (tmp_path / "assets" / tiny.MANIFEST_NAME).write_text(json.dumps(manifest), encoding="utf-8")
        with pytest.raises(LauncherError, match="outside"):
            runs_tiny.read_manifest(tmp_path / "assets", 0)
