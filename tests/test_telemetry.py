"""Run telemetry rows: the trainer's in-process row merged with a GPU sample."""

import json
from pathlib import Path

from launcher.runs.folders import RunFolder
from launcher.runs.telemetry import TelemetryRecorder
from launcher.user_files import last_rows
from launcher.signals.gpu_sources import GpuSample


class SilentSource:
    """A platform whose GPU tool reports nothing."""

    def sample(self):
        return None


class FixedSource:
    def sample(self):
        return GpuSample(t=1.0, clock_mhz=2500.0, power_w=385.0, gpu_util=99.0, mem_load=40.0)


def test_row_merges_trainer_and_gpu_fields(tmp_path):
    run = RunFolder(tmp_path, "job")
    run.trainer_telemetry.write_text(
        json.dumps({"time": 5.0, "step": 3, "loss": 0.5, "s_per_it": 9.5, "vram_allocated_gib": 20.1}) + "\n"
        + json.dumps({"time": 5.5, "step": 3, "loss": 0.5, "s_per_it": None, "vram_allocated_gib": 20.1,
                      "event": "save"}) + "\n"  # an event row: no speed in it
        + '{"time": 6.0, "step": 4, "lo'  # a row still being written is skipped
    )
    row = TelemetryRecorder(run, {"interval_s": 10}, source=FixedSource(), clock=lambda: 100.0).record()
    assert row == {"t": 100.0, "step": 3, "loss": 0.5, "s_it": 9.5, "vram_allocated_gib": 20.1, "trainer_time": 5.5,
                   "clock_mhz": 2500.0, "power_w": 385.0, "gpu_util": 99.0, "mem_load": 40.0}
    assert json.loads(run.telemetry.read_text().splitlines()[-1]) == row


def test_missing_sources_are_noted_once_and_never_crash(tmp_path, capsys):
    recorder = TelemetryRecorder(RunFolder(tmp_path, "job"), {"interval_s": 10}, source=SilentSource(), clock=lambda: 1.0)
    assert recorder.record() == {"t": 1.0}
    recorder.record()
    assert capsys.readouterr().err.count("no in-trainer telemetry yet") == 1


def test_last_row_of_a_missing_file():
    assert last_rows(Path("/nonexistent/x.jsonl")) == []


def test_recorder_finds_its_own_source_on_a_machine_without_gpu_tools(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, amd-smi, rocm-smi, typeperf
    recorder = TelemetryRecorder(RunFolder(tmp_path, "job"), {"interval_s": 10}, clock=lambda: 2.0)
    assert recorder.source is None
    assert recorder.record() == {"t": 2.0}
    assert "no GPU telemetry tool found" in capsys.readouterr().err
