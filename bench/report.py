#!/usr/bin/env python3
"""Generate every table of RESULTS.md from bench/results/, the machine-readable results.

One CSV per table, `results/NAME.csv`, one row per measurement; its last two columns are `date`
(when it was measured) and `source` (the raw file(s) under archive/ the row's figures come from,
space-separated; empty where none was kept). In RESULTS.md a table sits between
`<!-- results: NAME -->` and `<!-- end results -->` and is rewritten from `results/NAME.csv`; the
prose around it stays hand-written.

Most tables show their other columns as they are: the column's name is its title, and a name
ending in `:` is right-aligned (markdown's `---:`); a table of SOURCE_SHOWN ends with a column that
links each row's raw file. A table with a renderer of its own (RENDERERS) keeps its figures in
separate columns and builds the cells from them.

    python bench/report.py            # rewrite the tables in RESULTS.md
    python bench/report.py --check    # exit 1 if RESULTS.md and results/ disagree
"""

import argparse
import csv
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = re.compile(r"(<!-- results: (\w+) -->\n)(.*?)(<!-- end results -->)", re.S)
META = ["date", "source"]


class ResultsError(ValueError):
    """The results folder and the document cannot be matched; the message says how to fix it."""


def markdown_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def step_row(row: dict) -> str:
    """One LoRA training step (figures 3 and 4): an OOM row shows where it stopped."""
    pair = " / ".join(v for v in (row["peak_alloc_gib"], row["peak_reserved_gib"]) if v)
    cells = [row["weights"], row["cap"], row["shape"]]
    if row["note"]:
        cells += [f"**{row['note']}**", "", f"{pair} at the OOM", "", "", ""]
    else:
        cells += [row["s_per_step"], f"{row['fwd_s']} / {row['bwd_opt_s']}", pair, row["tflops"],
                  f"{row['mfu_pct']} %", row["x_bf16"]]
    return markdown_row(cells + [f"[raw]({row['source']})"])


SOURCE_SHOWN = {"klein"}
"""Tables whose rows come from several machines, each figure compared only with its own machine's:
the raw file a row links names its batch."""

RENDERERS = {
    "step": ("| weights | cap | shape | s/step | fwd / bwd+opt s | peak alloc / reserved GiB | TFLOP/s | MFU | x bf16 | raw |\n"
             "| --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: | --- |", step_row),
}


def read_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """The columns and rows of one results CSV, checked: the meta columns last, every row full."""
    with path.open(newline="", encoding="utf-8") as handle:
        header, *rows = list(csv.reader(handle))
    if header[-len(META):] != META:
        raise ResultsError(f"{path}: the last columns must be {', '.join(META)} (found {header[-2:]})")
    for number, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise ResultsError(f"{path}, line {number}: {len(row)} cells for {len(header)} columns")
        for source in row[-1].split():
            if not (path.parent.parent / source).is_file():
                raise ResultsError(f"{path}, line {number}: source {source} is not a file of bench/: "
                                   "archive the raw output there or empty the cell")
    return header, rows


def render(path: Path) -> str:
    header, rows = read_table(path)
    if path.stem in RENDERERS:
        head, row_text = RENDERERS[path.stem]
        return "\n".join([head, *(row_text(dict(zip(header, row))) for row in rows)]) + "\n"
    shown = header[:-len(META)]
    titles = [name[:-1] if name.endswith(":") else name for name in shown]
    align = ["---:" if name.endswith(":") else "---" for name in shown]
    linked = path.stem in SOURCE_SHOWN
    lines = [markdown_row(titles + ["raw"] * linked), markdown_row(align + ["---"] * linked)]
    lines += [markdown_row(row[:-len(META)] + [source_links(row[-1])] * linked) for row in rows]
    return "\n".join(lines) + "\n"


def source_links(source: str) -> str:
    """A row's raw files as links named by their stems."""
    return " ".join(f"[{Path(name).stem}]({name})" for name in source.split())


def generated(results: Path, document: str) -> str:
    """The document with every marked table rewritten; every results file must be shown once."""
    names = TABLE.findall(document)
    used = [name for _, name, _, _ in names]
    missing = [name for name in used if not (results / f"{name}.csv").is_file()]
    if missing:
        raise ResultsError(f"no {results}/NAME.csv for the table(s) {', '.join(missing)} of the document")
    unused = sorted(path.stem for path in results.glob("*.csv") if path.stem not in used)
    if unused:
        raise ResultsError(f"{results}: {', '.join(unused)} not shown in the document: add a "
                           "`<!-- results: NAME -->` table there or remove the file")
    twice = sorted({name for name in used if used.count(name) > 1})
    if twice:
        raise ResultsError(f"the table(s) {', '.join(twice)} are marked more than once in the document")
    return TABLE.sub(lambda m: m.group(1) + render(results / f"{m.group(2)}.csv") + m.group(4), document)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when RESULTS.md is stale")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--document", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args(argv)
    document = args.document.read_text(encoding="utf-8")
    try:
        new = generated(args.results, document)
    except ResultsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.check:
        if new != document:
            print(f"{args.document} does not match {args.results}: run python bench/report.py", file=sys.stderr)
            return 1
        return 0
    args.document.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
