#!/usr/bin/env python3
"""Generate RESULTS.md's tables from bench/results.csv, the machine-readable results table.

Each row of results.csv is one measurement (its table, date, configuration, figures and the
archived raw file it came from). A table in RESULTS.md sits between two markers,
`<!-- results.csv: NAME -->` and `<!-- end results.csv -->`, and is rewritten from the rows of
table NAME; the prose around it stays hand-written. Add a measurement by adding rows (and its raw
output to archive/), then:

    python bench/report.py            # rewrite the tables in RESULTS.md
    python bench/report.py --check    # exit 1 if RESULTS.md does not match results.csv
"""

import argparse
import csv
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = re.compile(r"(<!-- results\.csv: (\w+) -->\n)(.*?)(<!-- end results\.csv -->)", re.S)


def step_row(row: dict) -> str:
    """One LoRA training step (figures 3 and 4): an OOM row shows where it stopped."""
    pair = " / ".join(v for v in (row["peak_alloc_gib"], row["peak_reserved_gib"]) if v)
    cells = [row["weights"], row["cap"], row["shape"]]
    if row["note"]:
        cells += [f"**{row['note']}**", "", f"{pair} at the OOM", "", "", ""]
    else:
        cells += [row["s_per_step"], f"{row['fwd_s']} / {row['bwd_opt_s']}", pair, row["tflops"],
                  f"{row['mfu_pct']} %", row["x_bf16"]]
    return "| " + " | ".join(cells + [f"[raw]({row['source']})"]) + " |"


RENDERERS = {
    "step": ("| weights | cap | shape | s/step | fwd / bwd+opt s | peak alloc / reserved GiB | TFLOP/s | MFU | x bf16 | raw |\n"
             "| --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: | --- |", step_row),
}


def render(rows: list[dict], name: str) -> str:
    header, row_text = RENDERERS[name]
    return "\n".join([header, *(row_text(row) for row in rows if row["table"] == name)]) + "\n"


def generated(results: Path, document: str) -> str:
    with results.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return TABLE.sub(lambda m: m.group(1) + render(rows, m.group(2)) + m.group(4), document)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when RESULTS.md is stale")
    parser.add_argument("--results", type=Path, default=HERE / "results.csv")
    parser.add_argument("--document", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args(argv)
    document = args.document.read_text(encoding="utf-8")
    new = generated(args.results, document)
    if args.check:
        if new != document:
            print(f"{args.document} does not match {args.results}: run python bench/report.py", file=sys.stderr)
            return 1
        return 0
    args.document.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
