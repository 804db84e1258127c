#!/usr/bin/env python3
"""The launches of `bench/klein_run.sh` as one results table (results/klein.csv).

Reads each OUT folder that script filled (a launch's `<label>.json`, `.run.json` and `.log`,
read as bench/first_launch.py reads them) and prints one row per launch: the card whose free VRAM
the cap is, seconds to the training loop and to the first step, the load phases, the trainer's
peak host RSS and its parts, the bytes the memory plan streamed, host memory beyond them (peak
anonymous plus file-mapped, less streamed: what the run holds besides the streamed blocks, the
RAM disk where the benchmark keeps its caches left out), s/it, and s/it against the same model's
relaunch at the 24 GB card's cap at that size. With --write the rows go to results/klein.csv and
the raw figures to archive/klein_<date>.jsonl (a new file: an existing one is not replaced).

    python3 -m bench.klein_table OUT [OUT2 ...] [--write --date YYYY-MM-DD]
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
    the step against `reference` ({(model, px): s/it})."""
    base = row(figures)
    model = Path(figures["preset"]).stem.removesuffix("_512")
    px = pixels(figures["label"])
    cap = figures["cap_gib"]
    streamed = (figures["memory_plan"].get("streamed_weight_bytes") or 0) / 2**30
    beyond = (figures.get("trainer_peak_anon_gib") or 0) + (figures.get("trainer_peak_file_gib") or 0) - streamed
    ref = reference.get((model, px))
    step = figures.get("s_per_it")
    return {"model": model, "launch": base["launch"], "rc:": str(figures["rc"]),
            "cap:": f"{cap} ({CARDS.get(float(cap), 'card free VRAM')})" if cap else "uncapped", "px:": px,
            **{key: base[key] for key in COLUMNS[5:9]}, **{key: base[key] for key in COLUMNS[9:14]},
            "beyond streamed GiB:": f"{beyond:.2f}", "s/it:": base["s/it:"],
            "x 24 GB:": f"{step / ref:.2f}" if step and ref else ""}


def pixels(label: str) -> str:
    """The size a klein_run.sh label names: first_CAP_PX[_mN], relaunch_CAP_PX[_mN], bf16_PX[_mN]."""
    parts = label.split("_")
    return parts[1] if parts[0] == "bf16" else parts[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outs", type=Path, nargs="+", help="OUT folders of `bench/klein_run.sh`")
    parser.add_argument("--write", action="store_true", help="write results/klein.csv and the archive")
    parser.add_argument("--date", help="the measurement's date (YYYY-MM-DD), with --write")
    args = parser.parse_args(argv)
    raw = []
    for out in args.outs:
        labels = [path.stem for path in sorted(out.glob("*.json"), key=lambda p: p.stat().st_mtime)
                  if not path.name.endswith(".run.json") and (out / f"{path.stem}.log").is_file()]
        raw += [{**launch_figures(out, label), "out": out.name} for label in labels]
    reference = {(Path(item["preset"]).stem.removesuffix("_512"), pixels(item["label"])): item["s_per_it"]
                 for item in raw if item["label"].startswith("relaunch_22_") and item.get("s_per_it")}
    rows = [klein_row(item, reference) for item in raw]
    for item in rows:
        print(" | ".join(item.values()))
    if args.write:
        archive = HERE / f"archive/klein_{args.date}.jsonl"
        if archive.exists():
            raise SystemExit(f"{archive} exists: archived figures are not replaced; give another --date or move it")
        archive.write_text("".join(json.dumps(item) + "\n" for item in raw), encoding="utf-8")
        with (HERE / "results" / "klein.csv").open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(COLUMNS + ["date", "source"])
            writer.writerows([*item.values(), args.date, archive.relative_to(HERE).as_posix()] for item in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
