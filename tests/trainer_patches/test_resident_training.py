"""The low_vram patch: under low_vram the model stays on the CPU until the text encoder is unloaded (wall 9).

Trains the tiny preset for one step with the training device set to cpu:0 (see
record_model_moves.py) and records every move of the transformer to that device. With the
patch, no move happens while the text encoder is loaded, and the model is made resident right
after the encoder is unloaded, before the first step. The heap pages its host copy held are
handed back to the OS then and at the end of load_model (recorded calls of the heap trim,
toolkit/host_memory.py). `resident_after_te_cache: false` restores the fork's placement, which
the same recorder sees moving the model early: the check can fail.
These runs load the whole encoder (streamed_text_encoder: false); with the text phase no
encoder is ever loaded and the model goes to the device while loading.
"""

import json
import subprocess
from pathlib import Path

import pytest

from launcher.envs.torchenv import clean_env
from launcher.envs.workdir import Workdir, venv_python
from launcher.runs import tiny
from launcher.runs.presets import load_preset, render, write_config

RECORDER = Path(__file__).with_name("record_model_moves.py")


def record_moves(workdir, tmp_path: Path, resident: bool, text_phase: bool = False, dataset: Path | None = None,
                 model_kwargs: dict | None = None, run: str = "run") -> tuple[list[dict], str]:
    """One step of the tiny preset under the recorder: its events and its output.

    Runs named apart (`run`) in one `tmp_path` share the text and quantized caches: a relaunch.
    """
    python = venv_python(workdir.venv)
    preset = load_preset("tiny")
    config = render(preset, tmp_path / run, tiny_manifest=tiny.ensure_assets(workdir.assets / "tiny", workdir.trainer, python))
    process = config["config"]["process"][0]
    process["train"]["steps"] = 1
    if dataset is not None:
        process["datasets"][0]["folder_path"] = str(dataset)
    kwargs = process["model"]["model_kwargs"]
    # wall 9 is about the whole encoder sharing the device; the text phase (walls 3-4) avoids that
    kwargs["streamed_text_encoder"] = text_phase
    kwargs["text_embedding_cache_dir"] = str(tmp_path / "text-cache")
    kwargs["resident_after_te_cache"] = resident
    kwargs.update(model_kwargs or {})
    config_path = write_config(config, tmp_path / run / "config.yaml")
    events_path = tmp_path / f"{run}-events.json"
    result = subprocess.run(
        [str(python), "-u", str(RECORDER), str(config_path), str(events_path)],
        cwd=workdir.trainer, env={**clean_env(), **preset.env, "PYTHONUNBUFFERED": "1"},
        capture_output=True, text=True, errors="replace",
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(events_path.read_text(encoding="utf-8")), result.stdout


@pytest.fixture(scope="module")
def workdir(trainer_checkout) -> Workdir:
    return Workdir(trainer_checkout.parent)


def split_at_unload(events: list[dict]) -> tuple[list[dict], list[dict]]:
    names = [e["event"] for e in events]
    assert names.count("te_unloaded") == 1, names
    cut = names.index("te_unloaded")
    return events[:cut], events[cut + 1:]


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "switched-off"])
def test_model_moves_to_the_device_only_after_the_text_encoder_unloads(workdir, tmp_path, resident):
    events, log = record_moves(workdir, tmp_path, resident)
    before, after = split_at_unload(events)
    early = [e["caller"] for e in before if e["event"] == "model_to_device"]
    first_step = [e["event"] for e in after].index("train_step")
    resident_moves = [e["caller"] for e in after[:first_step] if e["event"] == "model_to_device"]
    if resident:
        assert early == [], f"model moved to the device while the text encoder was loaded, by {early}"
        assert "hook_before_train_loop" in resident_moves, after
        assert "low_vram: text encoder unloaded, moving the model to cpu:0 for training" in log
        trims = [e["caller"] for e in after[:first_step] if e["event"] == "heap_trim"]
        assert "hook_before_train_loop" in trims, f"the parked model's host pages were not handed back: {after}"
        loaded = [e["event"] for e in before].index("placed")
        trims = [e["caller"] for e in before[:loaded] if e["event"] == "heap_trim"]
        assert "load_model" in trims, f"no heap trim at the end of load_model: {before[:loaded]}"
    else:
        # the trainer's own placement: moved in run() and accelerate's prepare_model (the fork
        # also in load_model; upstream main stopped that, PR #726)
        assert {"run", "prepare_model"} <= set(early), early
        assert "hook_before_train_loop" not in resident_moves, after


def test_after_the_text_phase_the_model_is_resident_before_the_first_step(workdir, tmp_path):
    events, log = record_moves(workdir, tmp_path, resident=True, text_phase=True)
    before, after = split_at_unload(events)
    first_step = [e["event"] for e in after].index("train_step")
    moves = [e["caller"] for e in before + after[:first_step] if e["event"] == "model_to_device"]
    assert "load_model" in moves, events  # no encoder shares the device: nothing to park it for
    assert "Loading Mistral" not in log and "low_vram: text encoder unloaded" not in log
    assert log.index("text phase: done") < log.index("Loading transformer")
