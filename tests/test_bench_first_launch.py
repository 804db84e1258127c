"""bench/first_launch.py: a call that measures some launches again replaces their rows only, each
where it stood."""

import csv
import json

from bench import first_launch


def launch(out, label, cap, s_per_it):
    figures = {"label": label, "cap_gib": cap, "to_first_step_s": 50.0, "s_per_it": s_per_it,
               "trainer_peak_rss_gib": 3.0, "trainer_peak_anon_gib": 2.5}
    (out / f"{label}.json").write_text(json.dumps(figures))
    (out / f"{label}.log").write_text("compile_blocks: DoubleStreamBlock 1 graph compiled in 30.0 s\n")


def table(tmp_path):
    with (tmp_path / "results" / "first_launch.csv").open(newline="") as handle:
        return {row["launch"]: row for row in csv.DictReader(handle)}


def test_write_replaces_the_rows_of_the_launches_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(first_launch, "HERE", tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "archive").mkdir()
    first, second = tmp_path / "call1", tmp_path / "call2"
    first.mkdir()
    second.mkdir()
    launch(first, "relaunch_16_512", 11.8, 0.84)
    launch(first, "relaunch_12_512", 8.3, 0.87)
    assert first_launch.main([str(first), "--write", "--date", "2026-01-01"]) == 0
    launch(second, "relaunch_12_512", 8.3, 0.80)
    assert first_launch.main([str(second), "--write", "--date", "2026-01-02"]) == 0
    rows = table(tmp_path)
    assert rows["relaunch_16_512"]["s/it:"] == "0.840" and rows["relaunch_16_512"]["date"] == "2026-01-01"
    assert rows["relaunch_12_512"]["s/it:"] == "0.800" and rows["relaunch_12_512"]["date"] == "2026-01-02"
    assert rows["relaunch_12_512"]["compile per class"] == "DoubleStreamBlock 30 s"
    launch(second, "relaunch_16_512", 11.8, 0.83)
    assert first_launch.main([str(second), "--write", "--date", "2026-01-02"]) == 0
    archived = [json.loads(line)["label"] for line in (tmp_path / "archive" / "first_launch_2026-01-02.jsonl").read_text().splitlines()]
    assert archived == ["relaunch_12_512", "relaunch_16_512"]  # the date's file holds each launch once
    assert list(table(tmp_path)) == ["relaunch_16_512", "relaunch_12_512"]  # each row where it stood
    launch(second, "relaunch_22_512", 18.8, 0.72)
    assert first_launch.main([str(second), "--write", "--date", "2026-01-02"]) == 0
    assert list(table(tmp_path)) == ["relaunch_16_512", "relaunch_12_512", "relaunch_22_512"]
