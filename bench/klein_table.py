#!/usr/bin/env python3
"""The launches of `bench/klein_run.sh` as one results table (results/klein.csv).

Reads each OUT folder that script filled (a launch's `<label>.json`, `.run.json` and `.log`,
read as bench/first_launch.py reads them) and prints one row per launch: the card whose free VRAM
the cap is, seconds to the training loop and to the first step, the load phases, the trainer's
peak host RSS and its parts, the bytes the memory plan streamed, host memory beyond them (peak
anonymous plus file-mapped, less streamed: what the run holds besides the streamed blocks, the
RAM disk where the benchmark keeps its caches left out), s/it, and s/it against the same model's
relaunch at the 24 GB card's cap at that size, compiled alike (_c), neither profiled (_pN) nor
given another margin (_mN). Give the OUT folders of one machine: machines differ more than the
caps do. With --write the rows are added to results/klein.csv (earlier machines' rows stay) and
the raw figures go to archive/klein_[TAG_]<date>.jsonl (a new file: an existing one is not replaced).

    python3 -m bench.klein_table OUT [OUT2 ...] [--write --date YYYY-MM-DD [--tag WORD]]
"""

import argparse
import csv
import json
from pathlib import Path

from bench.first_launch import launch_figures, row

HERE = Path(__file__).resolve().parent
CARDS = {22.0: "24 GB card", 15.0: "16 GB card", 11.0: "12 GB card", 7.0: "8 GB card"}  # klein_run.sh's caps
COLUMNS = ["model", "launch", "rc:", "cap:", "px:", "to training start:", "to first step:", "text phase:", "transformer:",
           "peak RSS GiB:", "anon GiB:", "file GiB:", "RAM disk GiB:", "streamed GiB:", "beyond streamed GiB:",
           "s/it:", "x 24 GB:"]


def klein_row(figures: dict, reference: dict) -> dict:
    """first_launch's row with the model, the card's name, host memory beyond the streamed bytes and
    the step against `reference` ({reference_key: s/it})."""
    base = row(figures)
    model = Path(figures["preset"]).stem.removesuffix("_512")
    px = label_parts(figures["label"])[2]
    cap = figures["cap_gib"]
    streamed = (figures["memory_plan"].get("streamed_weight_bytes") or 0) / 2**30
    beyond = (figures.get("trainer_peak_anon_gib") or 0) + (figures.get("trainer_peak_file_gib") or 0) - streamed
    ref = reference.get(reference_key(figures))
    step = figures.get("s_per_it")
    return {"model": model, "launch": base["launch"], "rc:": str(figures["rc"]),
            "cap:": f"{cap} ({CARDS.get(float(cap), 'card free VRAM')})" if cap else "uncapped", "px:": px,
            **{key: base[key] for key in COLUMNS[5:9]}, **{key: base[key] for key in COLUMNS[9:14]},
            "beyond streamed GiB:": f"{beyond:.2f}", "s/it:": base["s/it:"],
            "x 24 GB:": f"{step / ref:.2f}" if step and ref else ""}


def label_parts(label: str) -> tuple[str, str, str, list[str]]:
    """(kind, cap, px, suffixes) of a klein_run.sh label: first_CAP_PX[_SUFFIX...],
    relaunch_CAP_PX[_SUFFIX...], bf16_PX[_SUFFIX...] (cap "" for bf16)."""
    parts = label.split("_")
    return (parts[0], "", parts[1], parts[2:]) if parts[0] == "bf16" else (parts[0], parts[1], parts[2], parts[3:])


def reference_key(figures: dict) -> tuple:
    """What a launch's 24 GB reference shares with it: model, size, and compiled blocks (_c) or not."""
    *_, px, suffixes = label_parts(figures["label"])
    return Path(figures["preset"]).stem, px, "c" in suffixes


def is_reference(figures: dict) -> bool:
    """A plain relaunch at the 24 GB card's cap (the preset's margin, not profiled) with a step."""
    kind, cap, _, suffixes = label_parts(figures["label"])
    return (kind == "relaunch" and cap == "22" and bool(figures.get("s_per_it"))
            and not any(suffix[0] == "p" or (suffix[0] == "m" and suffix != "m1") for suffix in suffixes))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outs", type=Path, nargs="+", help="OUT folders of `bench/klein_run.sh`")
    parser.add_argument("--write", action="store_true", help="write results/klein.csv and the archive")
    parser.add_argument("--date", help="the measurement's date (YYYY-MM-DD), with --write")
    parser.add_argument("--tag", help="with --write: a word in the archive's name, klein_TAG_DATE.jsonl")
    args = parser.parse_args(argv)
    raw = []
    for out in args.outs:
        labels = [path.stem for path in sorted(out.glob("*.json"), key=lambda p: p.stat().st_mtime)
                  if not path.name.endswith(".run.json")]
        raw += [{**launch_figures(out, label), "out": out.name} for label in labels]
    reference = {}
    for item in raw:
        if is_reference(item):
            reference.setdefault(reference_key(item), item["s_per_it"])
    rows = [klein_row(item, reference) for item in raw]
    for item in rows:
        print(" | ".join(item.values()))
    if args.write:
        name = f"klein_{args.tag}_{args.date}.jsonl" if args.tag else f"klein_{args.date}.jsonl"
        archive = HERE / "archive" / name
        if archive.exists():
            raise SystemExit(f"{archive} exists: archived figures are not replaced; give another --date or --tag")
        archive.write_text("".join(json.dumps(item) + "\n" for item in raw), encoding="utf-8")
        table = HERE / "results" / "klein.csv"
        earlier = []
        if table.is_file():
            with table.open(newline="", encoding="utf-8") as handle:
                earlier = list(csv.reader(handle))[1:]
        with table.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(COLUMNS + ["date", "source"])
            writer.writerows(earlier)
            writer.writerows([*item.values(), args.date, archive.relative_to(HERE).as_posix()] for item in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
