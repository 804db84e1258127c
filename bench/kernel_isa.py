#!/usr/bin/env python3
"""Every Triton kernel of the 4-bit Linear compiled for the consumer GPUs on the CPU: the table
`kernel_isa` of RESULTS.md (launcher/in_trainer/kernel_isa.py compiles and reads the code).

    python bench/kernel_isa.py [--trainer DIR] [--targets gfx1100,sm_89]   # the trainer venv's python

DIR holds the `toolkit` package (default: this repository's overlay/). Writes
bench/results/kernel_isa.csv (one row per target, kernel, variant and config) and exits 1 when a
kernel fails to compile, spills, overflows shared memory or uses the wrong matrix units.
"""

import argparse
import csv
import datetime
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from launcher.in_trainer import kernel_isa  # noqa: E402

COLUMNS = ["target", "kernel", "variant", "config", "matrix instructions", "registers:", "spill B:", "shared KiB:",
           "limit KiB:", "occupancy:", "verdict", "date", "source"]


def instruction_text(counts: dict[str, int]) -> str:
    return " ".join(f"{name} x{count}" for name, count in sorted(counts.items())) or "none"


def csv_row(row: dict, date: str) -> list[str]:
    verdict = "; ".join(kernel_isa.problems(row)) or "ok"
    head = [row["target"], f"`{row['kernel']}`", row["variant"], row["config"]]
    limit = str(row["shared_limit"] // kernel_isa.KIB)
    if row["error"]:
        return head + ["", "", "", "", limit, "", verdict, date, ""]
    unit = "waves/SIMD" if row["target"].startswith("gfx") else "warps/SM"
    registers = f"{row['registers']} v / {row['sgprs']} s" if row["sgprs"] is not None else str(row["registers"])
    return head + [instruction_text(row["instructions"]), registers, str(row["scratch_bytes"] + row["spilled"]),
                   f"{round(row['shared_bytes'] / kernel_isa.KIB, 2):g}", limit, f"{row['occupancy']} {unit}",
                   verdict, date, ""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=Path, default=HERE.parent / "overlay",
                        help="a folder holding the toolkit package (default: the repository's overlay)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "kernel_isa.csv")
    parser.add_argument("--targets", default=",".join(kernel_isa.TARGETS))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.trainer.resolve()))
    date = datetime.date.today().isoformat()
    table = [csv_row(row, date) for row in kernel_isa.measure_all(tuple(args.targets.split(",")))]
    with args.out.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(table)
    bad = [row for row in table if row[COLUMNS.index("verdict")] != "ok"]
    for row in bad:
        print(f"{row[0]} {row[1]} {row[2]} {row[3]}: {row[COLUMNS.index('verdict')]}", file=sys.stderr)
    print(f"{len(table)} kernels compiled, {len(bad)} with problems -> {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
