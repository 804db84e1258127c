"""bench/klein_table.py and the host-memory sampler of bench/fullsize.py: each step is compared with
the 24 GB step of its own kind, and an earlier machine's rows stay in the table."""

import csv
import json
import os
import subprocess
import sys

import pytest

from bench import fullsize, klein_table


def launch(out, label, s_per_it, model="klein9b"):
    figures = {"label": label, "preset": f"presets/{model}_512.yaml", "rc": 0, "cap_gib": float(label.split("_")[1]),
               "to_first_step_s": 40.0, "s_per_it": s_per_it, "trainer_peak_rss_gib": 2.5,
               "trainer_peak_anon_gib": 1.9, "trainer_peak_file_gib": 0.6}
    (out / f"{label}.json").write_text(json.dumps(figures))


def rows(tmp_path):
    with (tmp_path / "results" / "klein.csv").open(newline="") as handle:
        return [row for row in csv.DictReader(handle)]


def test_each_step_is_compared_with_the_24_gb_step_of_its_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(klein_table, "HERE", tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "archive").mkdir()
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    launch(first, "relaunch_22_512_p2", 0.5)       # profiled: never the reference
    launch(first, "relaunch_22_512_m5", 0.45)      # another margin: never the reference
    launch(first, "relaunch_22_512_s20", 0.4)
    launch(first, "relaunch_22_512_s20_c", 0.3)
    launch(first, "relaunch_7_512_s20", 0.6)
    launch(first, "relaunch_7_512_s20_c", 0.45)
    assert klein_table.main([str(first), "--write", "--date", "2026-01-01"]) == 0
    launch(second, "relaunch_22_512", 0.2)
    launch(second, "relaunch_7_512", 0.3)
    assert klein_table.main([str(second), "--write", "--date", "2026-01-02", "--tag", "again"]) == 0
    found = {(row["launch"], row["date"]): row["x 24 GB:"] for row in rows(tmp_path)}
    assert found[("relaunch_7_512_s20", "2026-01-01")] == "1.50"
    assert found[("relaunch_7_512_s20_c", "2026-01-01")] == "1.50"
    assert found[("relaunch_22_512_p2", "2026-01-01")] == "1.25"
    assert found[("relaunch_7_512", "2026-01-02")] == "1.50"   # against its own machine's 0.2, not 0.4
    assert len(found) == 8
    assert (tmp_path / "archive" / "klein_again_2026-01-02.jsonl").is_file()
    with pytest.raises(SystemExit, match="exists"):
        klein_table.main([str(second), "--write", "--date", "2026-01-02", "--tag", "again"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/smaps is Linux's")
def test_the_sampler_finds_a_large_allocation_among_the_unnamed_mappings():
    before = fullsize.anon_parts(os.getpid()).get("unnamed >= 64 MiB", 0)
    held = bytearray(160 * 2**20)
    for offset in range(0, len(held), 4096):
        held[offset] = 1
    after = fullsize.anon_parts(os.getpid())
    assert after["unnamed >= 64 MiB"] - before >= 0.15, after
    assert fullsize.anon_parts(2**22 + 12345) == {}   # no such process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_the_sampler_sees_a_grandchild_s_memory():
    """The trainer runs two levels below the benchmark (launcher -> trainer): its pages are counted."""
    grandchild = ("b = bytearray(200 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
                  "import time; time.sleep(1.5)")
    launcher = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"])
    peak = fullsize.sample_peak_rss(launcher)
    assert launcher.returncode == 0
    assert peak["anon"] >= 190 * 2**20 and peak["rss"] >= peak["anon"], peak
    # the parts are read once the anonymous pages grew 128 MiB past the last reading, so they lag the
    # peak by up to that much: the allocation is seen, at least the 128 MiB less the interpreter's own
    assert peak["anon_parts"]["unnamed >= 64 MiB"] >= 0.1, peak["anon_parts"]
