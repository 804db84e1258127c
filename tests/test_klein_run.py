"""`run` with a FLUX.2 klein preset checks klein's own files before anything starts: the model folder
holds klein's transformer file (not flux2-dev.safetensors), the text encoder folder is a Qwen3 one
(config and tokenizer, no processor), and --text-encoder reaches the trainer as text_encoder_path."""

import json
import struct
from pathlib import Path

import pytest
from conftest import write_png

from flux2_contract.families import KLEIN_4B, KLEIN_9B
from launcher.cli import main
from launcher.runs import disk_budget
from launcher.runs.presets import PRESETS_DIR

from test_run import rendered_config

KLEIN = {family.arch: family for family in (KLEIN_4B, KLEIN_9B)}


def fake_safetensors(path: Path, nbytes: int) -> None:
    """A header describing one tensor of `nbytes`, as a sparse file (no disk used)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + nbytes)


@pytest.fixture(params=["klein4b_512", "klein9b_512"])
def klein_places(request, tmp_path, monkeypatch):
    """A klein model folder, a Qwen3 folder as the hub snapshot holds it, a dataset."""
    monkeypatch.setattr(disk_budget, "free_disk_gib", lambda path: 500.0)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))  # no hub snapshot of Qwen3 on this machine
    arch = f"flux2_klein_{request.param[5:7]}"
    model = tmp_path / "model"
    fake_safetensors(model / KLEIN[arch].transformer_file, 8_000_000_000)
    fake_safetensors(model / "ae.safetensors", 168_000_000)
    encoder = tmp_path / "qwen3"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        (encoder / name).write_text("{}")
    fake_safetensors(encoder / "model.safetensors", 1_000_000)
    data = tmp_path / "data"
    data.mkdir()
    write_png(data / "a.png", 128, 96)
    (data / "a.txt").write_text("a photo of sks")
    return {"preset": request.param, "arch": arch, "model": model, "encoder": encoder, "data": data,
            "workdir": tmp_path / "wd"}


def dry_run(places, *, text_encoder=True):
    return main(["run", str(PRESETS_DIR / f"{places['preset']}.yaml"), "--dry-run", "--workdir", str(places["workdir"]),
                 "--model-dir", str(places["model"]), "--dataset", str(places["data"]),
                 *(["--text-encoder", str(places["encoder"])] if text_encoder else [])])


def test_a_klein_run_takes_klein_s_files_and_hands_the_encoder_folder_over(klein_places, capsys):
    assert dry_run(klein_places) == 0
    model = rendered_config(capsys.readouterr().out)["config"]["process"][0]["model"]
    assert model["arch"] == klein_places["arch"]
    assert model["name_or_path"] == str(klein_places["model"])
    assert model["model_kwargs"]["text_encoder_path"] == str(klein_places["encoder"])


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_dev_model_folder_is_refused_naming_klein_s_file(klein_places, capsys):
    transformer = KLEIN[klein_places["arch"]].transformer_file
    (klein_places["model"] / transformer).rename(klein_places["model"] / "flux2-dev.safetensors")
    assert dry_run(klein_places) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1, lines
    assert f"{klein_places['model'] / transformer} is missing" in lines[0]
    assert "holds flux2-dev.safetensors, FLUX.2 [dev]'s transformer" in lines[0]


@pytest.mark.parametrize("change, message", [
    ("no tokenizer", "lacks tokenizer.json (or vocab.json and merges.txt); it must hold the Qwen3 model and its tokenizer"),
    ("mistral config", "config.json says model_type 'mistral3', but FLUX.2 klein"),
    ("no config", "lacks config.json"),
    ("no weights", "holds neither model.safetensors.index.json nor model.safetensors"),
    ("huge config", "config.json is 16,777,217 bytes; a model's config.json or safetensors index"),
    ("utf-16 config", "config.json is UTF-16 text (it starts with a byte-order mark); save it as UTF-8"),
    ("huge index", "model.safetensors.index.json is 16,777,217 bytes; a model's config.json or safetensors index"),
])
def test_a_text_encoder_folder_that_is_not_qwen3_is_refused_naming_the_file(klein_places, capsys, change, message):
    encoder = klein_places["encoder"]
    if change == "no tokenizer":
        for name in ("tokenizer.json", "merges.txt"):
            (encoder / name).unlink()
    elif change == "mistral config":
        (encoder / "config.json").write_text(json.dumps({"model_type": "mistral3"}))
    elif change == "no config":
        (encoder / "config.json").unlink()
    elif change == "huge config":  # the one reader's cap, not a read of the whole file (a sparse one here)
        with (encoder / "config.json").open("r+b") as handle:
            handle.truncate(16 * 2**20 + 1)
    elif change == "utf-16 config":
        (encoder / "config.json").write_text(json.dumps({"model_type": "qwen3"}), encoding="utf-16")
    elif change == "huge index":
        with (encoder / "model.safetensors.index.json").open("wb") as handle:
            handle.truncate(16 * 2**20 + 1)
    else:
        (encoder / "model.safetensors").unlink()
    assert dry_run(klein_places) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and message in lines[0] and str(encoder) in lines[0], lines


def test_a_qwen3_folder_needs_no_processor_and_a_slow_tokenizer_is_enough(klein_places, capsys):
    (klein_places["encoder"] / "tokenizer.json").unlink()
    assert dry_run(klein_places) == 0


def test_without_text_encoder_a_klein_run_names_its_own_hub_encoder(klein_places, capsys):
    assert dry_run(klein_places, text_encoder=False) == 2
    lines = error_lines(capsys)
    snapshot = KLEIN[klein_places["arch"]].text_encoder.hub_id
    assert len(lines) == 1 and f"text encoder '{snapshot}' is neither a local folder" in lines[0], lines
    assert f"a local snapshot of {snapshot}" in lines[0]
