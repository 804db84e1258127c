"""Patch "in-trainer telemetry" (toolkit/trainer_telemetry.py) without a training run.

The end-to-end rows of a tiny run are checked in tests/test_trainer_telemetry.py; these cover
what that run cannot show quickly: no file without model_kwargs telemetry_file, the interval, s/it as the
mean since the last row, a NaN loss, a file that cannot be written, the first-step row, and the
load-phase rows with host RSS sampled while the model loads.
"""

import importlib
import json

import pytest


@pytest.fixture
def telemetry(trainer_on_path, monkeypatch):
    """A fresh module (it keeps its state in a module global), set up by each test's model_kwargs."""
    monkeypatch.setenv("AITK_TELEMETRY", "elsewhere.jsonl")  # the trainer reads no variable
    module = importlib.import_module("toolkit.trainer_telemetry")
    return importlib.reload(module)


def rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_off_without_the_setting(telemetry, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    telemetry.configure({})
    telemetry.record_event("start", step=0)
    telemetry.record_step(1, {"loss": 0.5})
    assert list(tmp_path.iterdir()) == []
    assert telemetry._telemetry is False


def test_interval_events_and_speed(telemetry, tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    clock = iter([100.0, 100.0, 101.5, 102.0, 104.0, 110.0, 130.0]).__next__
    monkeypatch.setattr(telemetry.time, "time", clock)
    telemetry.configure({"telemetry_file": str(path), "telemetry_interval_s": 3600})
    telemetry.record_event("start", step=10)          # t=100 (set-up reads the clock first)
    telemetry.record_step(11, {"loss": 0.25})         # t=101.5: the first-step row; t=102: not due
    telemetry.record_step(12, {"loss": 0.75})         # t=104: not due
    telemetry.record_event("save", step=12)           # t=110: 2 steps in 10 s
    telemetry.record_event("save", step=12)           # t=130: no step since
    first, first_step, save, again = rows(path)
    assert first["event"] == "start" and first["step"] == 10 and first["loss"] is None and first["s_per_it"] is None
    assert first_step["event"] == "first_step" and first_step["step"] == 11 and first_step["s_per_it"] is None
    assert isinstance(first_step["since_start_s"], float)
    assert save == {**save, "event": "save", "step": 12, "loss": 0.75, "s_per_it": 5.0}
    assert again["s_per_it"] is None
    for row in (first, first_step, save, again):
        assert {"time", "step", "loss", "s_per_it", "vram_allocated_gib", "vram_reserved_gib",
                "vram_max_allocated_gib", "host_rss_gib", "host_peak_rss_gib"} <= row.keys()
        assert row["host_rss_gib"] > 0
        assert row["host_peak_rss_gib"] >= row["host_rss_gib"]


def test_a_row_per_step_at_interval_zero_and_nan_loss_is_null(telemetry, tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    telemetry.configure({"telemetry_file": str(path), "telemetry_interval_s": 0})
    telemetry.record_step(1, {"loss": float("nan")})
    telemetry.record_step(2, {"other": 3.0})
    first_step, nan_row, other_row = rows(path)
    assert first_step["event"] == "first_step"
    assert nan_row["loss"] is None and other_row["loss"] == 3.0


def test_unwritable_file_turns_telemetry_off_not_the_run(telemetry, tmp_path, monkeypatch, capsys):
    telemetry.configure({"telemetry_file": str(tmp_path / "missing-folder" / "t.jsonl")})
    telemetry.record_event("start", step=0)
    telemetry.record_step(1, {"loss": 1.0})
    assert telemetry._telemetry is False
    assert capsys.readouterr().out.count("Telemetry off") == 1


def test_load_phases_and_rss_sampled_while_loading(telemetry, tmp_path, monkeypatch):
    """A phase row when a load phase ends, "load" rows every interval until training starts."""
    import time

    path = tmp_path / "t.jsonl"
    telemetry.configure({"telemetry_file": str(path), "telemetry_interval_s": 0.05})
    host_memory = importlib.import_module("toolkit.host_memory")
    began = time.monotonic()
    phase = telemetry.start_phase("transformer")
    ballast = bytearray(b"\x01") * (64 << 20)  # 64 MiB written, so resident
    held = host_memory.current_rss_bytes()
    time.sleep(0.4)
    deadline = time.monotonic() + 30  # a busy machine may hold the sampler back; three rows come all the same
    while (not path.is_file() or sum(row.get("event") == "load" for row in rows(path)) < 3) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    del ballast
    phase.end(source="cache", device="cuda:0")
    lasted = time.monotonic() - began
    telemetry.record_event("start", step=0)
    written = len(rows(path))
    time.sleep(0.3)
    assert len(rows(path)) == written, "the load sampler kept writing after training started"

    found = rows(path)
    loads = [row for row in found if row.get("event") == "load"]
    assert len(loads) >= 3, found
    assert all(row["step"] is None and row["host_rss_gib"] > 0 for row in loads)
    (done,) = [row for row in found if row.get("event") == "phase"]
    assert done["phase"]["name"] == "transformer" and done["phase"]["source"] == "cache"
    assert 0.4 <= done["phase"]["seconds"] <= lasted + 0.01
    # the peak is the process's high-water mark: at least the resident set while the ballast was
    # held (rows round to 1 MiB). A fixed gap to the RSS after it is not: once failed at 41 MiB of 64
    assert done["host_peak_rss_gib"] >= held / 2**30 - 0.001, "the ballast's resident set is not in the peak"
    assert done["host_rss_gib"] < done["host_peak_rss_gib"]


def test_interval_zero_samples_loading_once_a_second_not_continuously(telemetry, tmp_path, monkeypatch):
    """Interval 0 means a row per step; loading has no steps, so it must not write rows in a loop."""
    import time

    path = tmp_path / "t.jsonl"
    telemetry.configure({"telemetry_file": str(path), "telemetry_interval_s": 0})
    began = time.monotonic()
    telemetry.start_phase("transformer").end(source="streamed", device="cpu")
    time.sleep(0.5)
    telemetry.record_event("start", step=0)
    seconds = time.monotonic() - began  # half a second, more on a busy machine: a row per whole second
    loads = [row for row in rows(path) if row.get("event") == "load"]
    assert len(loads) <= int(seconds), f"{len(loads)} load rows in {seconds:.2f} s at interval 0"
