"""Patch "in-trainer telemetry": the trainer's own JSONL rows from a tiny run.

The tiny preset runs 6 steps with a save every 3 and the shortest telemetry interval a preset may
set (0.1 s: a row after every step that ends 0.1 s after the last row; a step that ends sooner
has none, and a saved step's loss is in its "save" row), written by the launcher's
choice to <run folder>/trainer-telemetry.jsonl (a preset cannot redirect it). The rows must carry the step,
a finite loss, s/it, host RSS and the VRAM figures read inside the trainer (wall 10): numbers
on a GPU, null on a CPU-only machine, never missing. While the model loads there is no step
yet: "load" rows (host RSS over time, one an interval) and a "phase" row per load phase
come before the "start" row; a "first_step" row and a "save" row after each checkpoint follow.
"""

import json
import math
import subprocess

import pytest
from tiny_run import run_tiny, tiny_preset

from launcher.envs.torchenv import clean_env
from launcher.envs.workdir import venv_python

pytestmark = pytest.mark.trainer

NAME = "telemetry_tiny"
STEPS = 6
SAVE_EVERY = 3
INTERVAL = 0.1
VRAM = ("vram_allocated_gib", "vram_reserved_gib", "vram_max_allocated_gib", "vram_alloc_retries", "host_pinned_gib")


@pytest.fixture(scope="module")
def telemetry_rows(trainer_workdir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("telemetry")
    output = tmp / "runs"
    telemetry = output / NAME / "trainer-telemetry.jsonl"
    preset = tiny_preset(tmp / "telemetry.yaml", name=NAME, steps=STEPS, save={"save_every": SAVE_EVERY},
                         launcher={"telemetry": {"interval_s": INTERVAL}})
    result = run_tiny(trainer_workdir.root, preset, output)
    assert result.returncode == 0, result.stdout[-4000:]
    assert telemetry.is_file(), f"the trainer wrote no {telemetry}"
    return [json.loads(line) for line in telemetry.read_text(encoding="utf-8").splitlines()]


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def split_at_start(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the rows while the model loads, the rows from the "start" row on)."""
    start = next(i for i, row in enumerate(rows) if row.get("event") == "start")
    return rows[:start], rows[start:]


def test_every_row_has_the_fields(telemetry_rows):
    for row in telemetry_rows:
        assert is_number(row["time"]), row
        assert is_number(row["host_rss_gib"]) and row["host_rss_gib"] > 0, row
        assert is_number(row["host_peak_rss_gib"]) and row["host_peak_rss_gib"] >= row["host_rss_gib"] * 0.99, row
        for key in VRAM:
            assert key in row, f"{key} missing from {row}"
            assert row[key] is None or (is_number(row[key]) and row[key] >= 0), row
    _, training = split_at_start(telemetry_rows)
    assert all(isinstance(row["step"], int) for row in training), telemetry_rows


def test_loading_rows_come_first_without_a_step(telemetry_rows):
    loading, _ = split_at_start(telemetry_rows)
    assert all(row["step"] is None and row.get("event") in ("load", "phase") for row in loading), loading
    phases = [row["phase"]["name"] for row in loading if row.get("event") == "phase"]
    assert "transformer" in phases, loading
    assert all(is_number(row["phase"]["seconds"]) for row in loading if row.get("event") == "phase"), loading
    samples = [row["time"] for row in loading if row.get("event") == "load"]
    gaps = [b - a for a, b in zip(samples, samples[1:])]
    assert all(gap >= 0.9 * INTERVAL for gap in gaps), f"load rows closer than the interval: {gaps}"


def test_vram_is_read_in_process_when_there_is_a_gpu(telemetry_rows, trainer_workdir):
    probe = subprocess.run(
        [str(venv_python(trainer_workdir.venv)), "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True, text=True, env=clean_env(),
    )
    gpu = probe.stdout.strip().splitlines()[-1:] == ["True"]
    step_rows = [row for row in telemetry_rows if "event" not in row]
    for row in step_rows:
        if gpu:
            assert all(is_number(row[key]) for key in VRAM), row
            assert row["vram_max_allocated_gib"] > 0, row
        else:
            assert all(row[key] is None for key in VRAM), row


def test_step_rows_have_step_loss_and_speed(telemetry_rows):
    step_rows = [row for row in telemetry_rows if "event" not in row]
    steps = [row["step"] for row in step_rows]
    # a step that ends within the interval of the last row has none: the steps that have one rise
    assert steps == sorted(set(steps)) and set(steps) <= set(range(1, STEPS + 1)), telemetry_rows
    # the loss curve reaches the end: the final save row carries the last step and its loss
    with_loss = [row for row in telemetry_rows if "event" not in row or row["event"] == "save"]
    assert with_loss[-1]["step"] == STEPS and is_number(with_loss[-1]["loss"]), telemetry_rows
    assert all(is_number(row["loss"]) for row in step_rows), step_rows
    assert all(is_number(row["s_per_it"]) and row["s_per_it"] > 0 for row in step_rows), step_rows
    times = [row["time"] for row in telemetry_rows]
    assert times == sorted(times)


def test_start_and_save_events(telemetry_rows):
    events = [(row["event"], row["step"]) for row in telemetry_rows if row.get("event") in ("start", "save")]
    # the loop saves after step index 3 (index 0 never saves), when 4 steps are done; then the final save
    assert events[0] == ("start", 0), events
    assert events[1:] == [("save", SAVE_EVERY + 1), ("save", STEPS)], events
    first_save = next(i for i, row in enumerate(telemetry_rows) if row.get("event") == "save")
    assert telemetry_rows[first_save - 1]["step"] <= SAVE_EVERY + 1, "the save row follows the step it saved"
