"""Peak host RSS and load-phase times: from the trainer's telemetry rows into run.json, and the plot's memory series."""

import json

from launcher.in_trainer.plot import memory_series
from launcher.runs import load_report
from launcher.runs.folders import RunFolder
from launcher.runs.telemetry import trainer_figures


def launch_rows(peak_during_load, transformer_source, first_step_s):
    return [
        {"time": 1.0, "step": None, "host_rss_gib": 1.0, "host_peak_rss_gib": 1.0, "event": "load"},
        {"time": 2.0, "step": None, "host_rss_gib": 1.2, "host_peak_rss_gib": peak_during_load, "event": "phase",
         "phase": {"name": "transformer", "seconds": 12.5, "source": transformer_source, "device": "cuda:0"}},
        {"time": 3.0, "step": 0, "host_rss_gib": 1.1, "host_peak_rss_gib": peak_during_load, "event": "start"},
        {"time": 4.0, "step": 0, "host_rss_gib": 1.1, "host_peak_rss_gib": peak_during_load, "event": "first_step",
         "since_start_s": first_step_s},
        {"time": 5.0, "step": 1, "loss": 0.5, "s_per_it": 1.0, "host_rss_gib": 1.1,
         "host_peak_rss_gib": peak_during_load},
    ]


def write_rows(path, rows):
    with path.open("a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def test_summary_has_peak_phases_and_time_to_first_step():
    summary = load_report.summarize(launch_rows(5.5, "cache", 41.0))
    assert summary == {
        "host_peak_rss_gib": 5.5,
        "phases": {"transformer": {"seconds": 12.5, "source": "cache", "device": "cuda:0"}},
        "to_first_step_s": 41.0,
    }
    assert load_report.describe(summary) == "peak host RSS 5.5 GiB; transformer 12.5 s (cache); first step after 41.0 s"


def test_run_json_gets_this_launch_only(tmp_path):
    """A resumed run appends to the same telemetry file: the relaunch's figures are its own."""
    run = RunFolder(tmp_path / "run", "job")
    run.job_dir.mkdir(parents=True)
    run.metadata.write_text(json.dumps({"commit": "abc"}))
    write_rows(run.trainer_telemetry, launch_rows(30.0, "streamed", 300.0))
    assert load_report.record(run)["host_peak_rss_gib"] == 30.0

    offset = load_report.telemetry_offset(run)
    write_rows(run.trainer_telemetry, launch_rows(5.5, "cache", 41.0))
    with run.trainer_telemetry.open("a") as handle:
        handle.write('{"time": 6.0, "host_rss')  # a row cut off by a kill
    load_report.record(run, offset)
    meta = json.loads(run.metadata.read_text())
    assert meta["commit"] == "abc", "the launcher's own metadata is kept"
    assert meta["load"]["host_peak_rss_gib"] == 5.5
    assert meta["load"]["phases"]["transformer"]["source"] == "cache"
    assert meta["load"]["to_first_step_s"] == 41.0


def test_run_telemetry_rows_keep_figures_not_phase_details():
    newest_first = list(reversed(launch_rows(5.5, "cache", 41.0)[:2]))
    figures = trainer_figures(newest_first)
    assert figures["host_peak_rss_gib"] == 5.5 and figures["host_rss_gib"] == 1.2
    assert "phase" not in figures and "event" not in figures


def test_memory_series_is_over_time_and_marks_the_first_step():
    rows = [
        {"t": 100.0, "trainer_time": None},  # before the trainer wrote anything
        {"t": 130.0, "trainer_time": 125.0, "host_rss_gib": 3.0, "host_peak_rss_gib": 3.0, "step": None},
        {"t": 160.0, "trainer_time": 125.0, "host_rss_gib": 3.0, "host_peak_rss_gib": 3.0, "step": None},  # repeat
        {"t": 190.0, "trainer_time": 185.0, "host_rss_gib": 2.0, "host_peak_rss_gib": 4.0, "step": 3},
    ]
    memory = memory_series(rows)
    assert memory["minutes"] == [0.5, 1.5]
    assert memory["rss"] == [3.0, 2.0] and memory["peak"] == [3.0, 4.0]
    assert memory["first_step"] == 1.5


def test_memory_plan_goes_to_run_json_and_its_bytes_to_the_plot():
    plan = {"budget_bytes": 1, "blocks": [{"name": "double_blocks.0", "weights": "streamed"}]}
    rows = [{"time": 1.0, "event": "memory_plan", "memory_plan": plan},
            {"time": 2.0, "step": 1, "streamed_bytes_step": 2 ** 30}]
    assert load_report.summarize(rows)["memory_plan"] == plan
    assert "memory_plan" not in trainer_figures(list(reversed(rows[:1])))
    merged = [{"t": 60.0 * i, "trainer_time": float(i), "host_rss_gib": 1.0, **row} for i, row in enumerate(rows)]
    assert memory_series(merged)["streamed"] == [0.0, 1.0]
