"""bench/'s scenario table and runner: every scenario names a script that exists and tables that
exist, every results table is made by a scenario (or says where it came from), bench/README.md
shows the table as `python -m bench.run --list` prints it, and archived output never overwrites."""

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python(*args, **kwargs):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, **kwargs)


def scenarios() -> dict:
    code = ("import json; from bench.scenarios import SCENARIOS, ELSEWHERE; print(json.dumps("
            "{'scenarios': {n: [list(s.command), list(s.tables), list(s.outputs)] for n, s in SCENARIOS.items()},"
            " 'elsewhere': list(ELSEWHERE)}))")
    done = python("-c", code)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_scenario_runs_a_script_that_exists():
    for name, (command, _, _) in scenarios()["scenarios"].items():
        head = command[1] if command[0] == "bash" else command[0]
        path = REPO / head if "/" in head else REPO / (head.replace(".", "/") + ".py")
        assert path.is_file(), f"scenario {name}: {path} does not exist"


def test_every_results_table_is_made_by_a_scenario_or_says_where_it_came_from():
    found = scenarios()
    fed = {table for _, tables, _ in found["scenarios"].values() for table in tables}
    tables = {path.stem for path in (REPO / "bench" / "results").glob("*.csv")}
    assert fed <= tables, f"scenarios feed tables without a bench/results/ CSV: {sorted(fed - tables)}"
    orphans = tables - fed - set(found["elsewhere"])
    assert not orphans, f"bench/results/ tables no scenario makes: {sorted(orphans)} (add to scenarios.ELSEWHERE)"


def test_the_readme_shows_the_scenario_table_as_the_runner_prints_it():
    done = python("-m", "bench.run", "--list")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in (REPO / "bench" / "README.md").read_text(encoding="utf-8"), (
        "bench/README.md: paste the output of `python -m bench.run --list` in place of its scenario table")


def test_a_missing_placeholder_is_named_before_anything_runs(tmp_path):
    done = python("-m", "bench.run", "train_step", "--out", str(tmp_path / "out"))
    assert done.returncode != 0 and "needs --trainer" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_dry_run_shows_the_filled_command_with_the_extra_arguments_last(tmp_path):
    done = python("-m", "bench.run", "train_step", "--trainer", str(tmp_path), "--out", str(tmp_path / "o"),
                  "--dry-run", "--", "--weights", "bf16")
    assert done.returncode == 0, done.stderr
    # the template is "{out}/step.json": the folder given, then "/" (Windows takes it as its own)
    assert re.search(rf"-m bench\.train_step --trainer {re.escape(str(tmp_path))} .*--out {re.escape(str(tmp_path / 'o'))}"
                     r"/step\.json --weights bf16(  env\+|$)", done.stdout.strip()), done.stdout


def test_archived_output_is_dated_and_never_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "suite.json").write_text("{}")
    (out / "suite.log").write_text("log")
    code = (f"import pathlib, bench.run as r; r.ARCHIVE = pathlib.Path({str(tmp_path)!r}); "
            f"s = r.SCENARIOS['gpu_suite']; o = pathlib.Path({str(out)!r}); "
            "print([p.name for p in r.archive(s, o, '2026-12-01') + r.archive(s, o, '2026-12-01')])")
    done = python("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(["gpu_suite_suite_2026-12-01.json", "gpu_suite_suite_2026-12-01.log",
                                       "gpu_suite_suite_2026-12-01_2.json", "gpu_suite_suite_2026-12-01_2.log"])


def test_every_archived_file_a_table_names_exists_in_the_archive():
    for path in (REPO / "bench" / "results").glob("*.csv"):
        with path.open(newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                for source in row["source"].split():
                    assert (REPO / "bench" / source).is_file(), f"{path.name}: {source}"


def test_no_in_trainer_test_runs_a_bench_script():
    """Tests measure with code under tests/: a benchmark edit cannot change what CI checks."""
    for path in (REPO / "tests" / "trainer_patches").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"""["']bench["'/]|^\s*(import|from) bench\b""", text, re.M), f"{path.name} uses bench/"
