"""bench/RESULTS.md's tables are generated from bench/results/: `report.py --check` (run by CI)
passes on the repository as it is and fails when a figure, a source file or a table disagrees."""

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def report(*args):
    return subprocess.run([sys.executable, str(BENCH / "report.py"), *map(str, args)],
                          capture_output=True, text=True)


@pytest.fixture
def copy(tmp_path):
    """RESULTS.md, results/ and archive/ copied, so a test can break one of them."""
    for name in ("results", "archive"):
        shutil.copytree(BENCH / name, tmp_path / name)
    shutil.copy(BENCH / "RESULTS.md", tmp_path / "RESULTS.md")
    return tmp_path


def check(folder):
    return report("--check", "--results", folder / "results", "--document", folder / "RESULTS.md")


def test_the_repository_s_tables_match_its_results():
    done = report("--check")
    assert done.returncode == 0, done.stderr


def test_every_table_of_results_md_is_generated():
    """A hand-written table (a markdown table outside the markers) would escape the check."""
    outside, inside = [], False
    for number, line in enumerate((BENCH / "RESULTS.md").read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("<!-- results: "):
            inside = True
        elif line == "<!-- end results -->":
            inside = False
        elif line.startswith("|") and not inside:
            outside.append(number)
    assert not outside, f"bench/RESULTS.md lines {outside}: a table not generated from bench/results/"


def test_a_changed_figure_fails_the_check_and_regenerating_shows_it(copy):
    table = copy / "results" / "same_call.csv"
    table.write_text(table.read_text(encoding="utf-8").replace("0.654", "0.555"), encoding="utf-8")
    assert check(copy).returncode == 1
    assert report("--results", copy / "results", "--document", copy / "RESULTS.md").returncode == 0
    assert "| bf16 | none | 0.555 | 62.79 / 63.19 | 411.3 |" in (copy / "RESULTS.md").read_text(encoding="utf-8")
    assert check(copy).returncode == 0


def test_a_figure_edited_in_the_document_fails_the_check(copy):
    document = copy / "RESULTS.md"
    text = document.read_text(encoding="utf-8")
    assert "| 1536:8:48 (full depth) | 3.79 |" in text
    document.write_text(text.replace("| 1536:8:48 (full depth) | 3.79 |", "| 1536:8:48 (full depth) | 3.80 |"),
                        encoding="utf-8")
    assert check(copy).returncode == 1


@pytest.mark.parametrize("breakage, message", [
    ("missing_source", "is not a file of bench/"),
    ("unused_table", "not shown in the document"),
    ("missing_table", "no "),
    ("short_row", "cells for"),
])
def test_a_results_folder_that_cannot_match_says_what_to_fix(copy, breakage, message):
    results = copy / "results"
    if breakage == "missing_source":
        (copy / "archive" / "pinned_retention_2026-11-30.jsonl").unlink()
    elif breakage == "unused_table":
        shutil.copy(results / "samples.csv", results / "samples_again.csv")
    elif breakage == "missing_table":
        (results / "relaunch.csv").unlink()
    else:
        table = results / "baseline.csv"
        table.write_text(table.read_text(encoding="utf-8") + "only one cell\n", encoding="utf-8")
    done = check(copy)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_column_name_ending_in_a_colon_is_right_aligned(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "raw.json").write_text("{}")
    (tmp_path / "results" / "t.csv").write_text("what,s/step:,date,source\nbf16,0.649,2026-11-29,archive/raw.json\n")
    (tmp_path / "RESULTS.md").write_text("text\n<!-- results: t -->\nstale\n<!-- end results -->\nmore\n")
    assert report("--results", tmp_path / "results", "--document", tmp_path / "RESULTS.md").returncode == 0
    assert (tmp_path / "RESULTS.md").read_text() == (
        "text\n<!-- results: t -->\n| what | s/step |\n| --- | ---: |\n| bf16 | 0.649 |\n<!-- end results -->\nmore\n")


def test_each_klein_row_links_the_raw_file_of_its_batch(copy):
    """klein's rows come from several machines: each names the archive its figures came from."""
    rows = [line for line in report_table(copy / "RESULTS.md", "klein") if line.startswith("| klein")]
    with (copy / "results" / "klein.csv").open(newline="", encoding="utf-8") as handle:
        sources = [row["source"] for row in csv.DictReader(handle)]
    assert len(rows) == len(sources) > 0
    for row, name in zip(rows, sources):
        assert row.endswith(f"| [{Path(name).stem}]({name}) |"), row


def report_table(document: Path, name: str) -> list[str]:
    text = document.read_text(encoding="utf-8")
    return text.split(f"<!-- results: {name} -->\n", 1)[1].split("<!-- end results -->", 1)[0].splitlines()
