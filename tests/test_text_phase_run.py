"""Walls 3-4 end to end: the text phase embeds every prompt before the transformer loads, and a
relaunch with every prompt cached trains with the text encoder folder moved away, giving the
same first-step loss and the same LoRA (same `training_seed`, same embeddings).
"""

import re
import shutil
from pathlib import Path

import pytest
from conftest import private_workdir
from test_tiny_training import safetensors_tensors
from tiny_run import run_tiny

pytestmark = pytest.mark.trainer

FIRST_LOSS = re.compile(r"loss: ([0-9.eE+-]+)")
LORA = Path("tiny_flux2") / "tiny_flux2" / "tiny_flux2.safetensors"


def launch(workdir, output: Path) -> str:
    result = run_tiny(workdir.root, output=output)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def text_workdir(trainer_workdir, tmp_path_factory):
    """The test moves the text encoder away and starts from an empty text cache: in a workdir of
    its own, not in the shared one that the in-trainer suite reads at the same time."""
    return private_workdir(trainer_workdir, tmp_path_factory.mktemp("text-phase-workdir"))


@pytest.fixture(scope="module")
def runs(text_workdir, tmp_path_factory):
    """A first launch with an empty text cache, then one with the encoder folder moved away."""
    root = tmp_path_factory.mktemp("text-phase-runs")
    first = launch(text_workdir, root / "first")
    encoder = text_workdir.assets / "tiny" / "text_encoder"
    away = root / "text_encoder-moved-away"
    shutil.move(encoder, away)
    try:
        second = launch(text_workdir, root / "second")
    finally:
        shutil.move(away, encoder)
    return first, second, root


def test_first_launch_streams_the_encoder_before_the_transformer(runs, text_workdir):
    first, _, _ = runs
    assert re.search(r"text phase: \d+ prompt\(s\), 0 cached", first)
    assert first.index("text phase: done") < first.index("Loading transformer")
    assert "Loading Mistral" not in first and "Quantizing Mistral" not in first
    assert list(text_workdir.text_cache.glob("*.temb.safetensors"))


def test_relaunch_without_the_encoder_folder_trains_the_same(runs):
    first, second, root = runs
    assert "every prompt is cached; the text encoder is not opened" in second
    assert "Loading Mistral" not in second
    assert FIRST_LOSS.search(first).group(1) == FIRST_LOSS.search(second).group(1)
    assert safetensors_tensors(root / "first" / LORA) == safetensors_tensors(root / "second" / LORA)
