#!/usr/bin/env python3
"""The first launch and the relaunches of `bench/same_call.sh first` as one results table.

Reads what that stage left in OUT (each launch's `<label>.json` from bench/fullsize.py, its
`<label>.run.json` and `<label>.log`) and prints one row per launch: seconds from `launcher run`'s
start to the training loop's (bench/fullsize.py) and from the trainer's start to its first step
done (run.json; it includes compiling the blocks), the load phases, the compile seconds of each
block class (the trainer's `compile_blocks:` lines), the peak host RSS and its parts, the bytes
the memory plan streamed, s/it. With --write the rows go to results/first_launch.csv and the raw
figures to archive/first_launch_<date>.jsonl, replacing the rows of the same launches only.

    python3 -m bench.first_launch OUT [--write --date YYYY-MM-DD]
"""

import argparse
import csv
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
CARDS = {18.8: "22 GiB card", 11.8: "16 GB card", 8.3: "12 GB card",  # same_call.sh's caps
         12.8: "16 GB card, plan matched", 9.55: "12 GB card, plan matched", 6.3: "8 GB card, plan matched"}
COMPILED = re.compile(r"compile_blocks: (\w+) (.+?) compiled in ([\d.]+) s")
COLUMNS = ["launch", "cap:", "px:", "to training start:", "to first step:", "text phase:", "transformer:", "compile per class",
           "peak RSS GiB:", "anon GiB:", "file GiB:", "RAM disk GiB:", "streamed GiB:", "s/it:"]


def launch_figures(out: Path, label: str) -> dict:
    """One launch's raw figures: fullsize.py's JSON, run.json's load summary, the compile lines."""
    figures = json.loads((out / f"{label}.json").read_text(encoding="utf-8"))
    run_json = out / f"{label}.run.json"
    metadata = json.loads(run_json.read_text(encoding="utf-8")) if run_json.is_file() else {}
    figures["load"] = metadata.get("load") or {}
    figures["memory_plan"] = metadata.get("memory_plan") or {}
    log = (out / f"{label}.log").read_text(encoding="utf-8", errors="replace") if (out / f"{label}.log").is_file() else ""
    figures["compiles"] = [{"class": name, "what": what, "seconds": float(seconds)}
                           for name, what, seconds in COMPILED.findall(log)]
    return figures


def row(figures: dict) -> dict:
    phases = figures["load"].get("phases") or {}
    per_class: dict = {}
    for compiled in figures["compiles"]:
        per_class[compiled["class"]] = per_class.get(compiled["class"], 0.0) + compiled["seconds"]
    streamed = figures["memory_plan"].get("streamed_weight_bytes")
    first_step = figures["load"].get("to_first_step_s")
    gib = lambda key: f"{figures[key]:.2f}" if figures.get(key) is not None else ""  # noqa: E731
    seconds = lambda phase: f"{phases[phase]['seconds']:.0f} s" if phase in phases else ""  # noqa: E731
    return {
        "launch": figures["label"],
        "cap:": f"{figures['cap_gib']} ({CARDS.get(figures['cap_gib'], 'uncapped')})",
        "px:": figures["label"].rsplit("_", 1)[-1],
        "to training start:": f"{figures['to_first_step_s']:.0f} s" if figures.get("to_first_step_s") else "",
        "to first step:": f"{first_step:.0f} s" if first_step else "",
        "text phase:": seconds("text"),
        "transformer:": seconds("transformer"),
        "compile per class": ", ".join(f"{name} {total:.0f} s" for name, total in per_class.items()) or "-",
        "peak RSS GiB:": gib("trainer_peak_rss_gib"), "anon GiB:": gib("trainer_peak_anon_gib"),
        "file GiB:": gib("trainer_peak_file_gib"), "RAM disk GiB:": gib("trainer_peak_shmem_gib"),
        "streamed GiB:": "" if streamed is None else f"{streamed / 2**30:.2f}",
        "s/it:": f"{figures['s_per_it']:.3f}" if figures.get("s_per_it") else "",
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the OUT folder of `bench/same_call.sh first`")
    parser.add_argument("--write", action="store_true", help="write results/first_launch.csv and the archive")
    parser.add_argument("--date", help="the measurement's date (YYYY-MM-DD), with --write")
    args = parser.parse_args(argv)
    labels = [path.stem for path in sorted(args.out.glob("*.json"), key=lambda p: p.stat().st_mtime)
              if not path.name.endswith(".run.json") and (args.out / f"{path.stem}.log").is_file()]
    raw = [launch_figures(args.out, label) for label in labels]
    rows = [row(figures) for figures in raw]
    for item in rows:
        print(" | ".join(item.values()))
    if args.write:
        write(raw, rows, args.date)
    return 0


def write(raw: list[dict], rows: list[dict], date: str) -> None:
    """The rows into results/first_launch.csv and the figures into the date's archive file. A launch
    measured again replaces its row where it stood, a new one goes last, and the others stay: a call
    that measures some launches again adds to the table instead of wiping it."""
    archive = HERE / f"archive/first_launch_{date}.jsonl"
    lines = archive.read_text(encoding="utf-8").splitlines() if archive.is_file() else []
    figures = merged([json.loads(line) for line in lines], raw, lambda item: item["label"])
    archive.write_text("".join(json.dumps(item) + "\n" for item in figures), encoding="utf-8")
    table = HERE / "results" / "first_launch.csv"
    old = list(csv.reader(table.read_text(encoding="utf-8").splitlines()))[1:] if table.is_file() else []
    source = archive.relative_to(HERE).as_posix()
    with table.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS + ["date", "source"])
        writer.writerows(merged(old, [[*item.values(), date, source] for item in rows], lambda item: item[0]))


def merged(old: list, new: list, label) -> list:
    """`old` with each item whose label is in `new` replaced by that one, in its place; the rest of
    `new` after it."""
    fresh = {label(item): item for item in new}
    kept = [fresh.pop(label(item), item) for item in old]
    return kept + list(fresh.values())


if __name__ == "__main__":
    raise SystemExit(main())
