"""What `auto` gives each card, worked out before the card is in the machine.

The self-test decides on the user's GPU; this module runs the same decision on paper for the
cards of the card table (`presets/cards.csv`, read by `launcher/card_table.py`). For a card
(architecture, FP8 matrix units by the runtime's rule, HIP or CUDA) and a software state (Triton
importable or not, Inductor compiling or not) it writes the self-test report the runner would
write, with the runner's own candidate list, quality rule and pick, and passes it to the verdict
functions `run` uses. What the paper cannot know is read from the results files in bench/results/
(never typed here): the quality gate's figures (the 8-bit activations' error, the same arithmetic
on every card), and what was measured on the H200: the block-Linear time of each path relative to
bf16, from the self-test's latest call (the order of the FP8 and bf16 paths holds where FP8 runs at
twice the bf16 rate, as on every FP8 card listed), the compiled step's gain and the fallbacks' step
costs. A maintainer's tool, like bench/: `python -m launcher.cards_doc` writes the table
docs/cards.md carries (and is the only module that imports this one; tests/test_layout.py holds
every other module of the launcher to reading nothing under bench/results, which an install need
not have); `python -m launcher.selftest.cards` prints it.
"""

import csv
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from launcher.card_table import Card, read_cards
from launcher.in_trainer.selftest import compiled, kernels, runner
from launcher.runs.memory_plan import streams_on
from launcher.runs.presets import load_preset
from launcher.runs.schema import AUTO
from launcher.selftest import verdict


@cache
def preset_process(preset: str) -> dict:
    """A shipped preset's trainer process, read once."""
    return load_preset(preset).config["config"]["process"][0]


def preset_qtype(card: Card) -> str:
    """The qtype the card's preset names: `auto`, or a qtype the memory plan can stream."""
    return preset_process(card.preset)["model"]["qtype"]


def streams(card: Card) -> bool:
    """The preset's memory plan may stream blocks on this card, so `auto` takes only a streamable qtype."""
    return streams_on(preset_process(card.preset), card.vram_gib)


CARDS = read_cards()
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"

PATH_ROWS = {"int4_fused": "`int4_fused`", "int4_w4a8 fp8 triton": "`int4_w4a8` FP8, Triton GEMM",
             "int4_w4a8 fp8 scaled_mm": "`int4_w4a8` FP8, `torch._scaled_mm`",
             "int4_w4a8 int8 triton": "`int4_w4a8` int8, Triton GEMM"}
"""Each candidate's row in bench/results/selftest_paths.csv."""


def read_results(name: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of bench/results/NAME.csv."""
    with (RESULTS / f"{name}.csv").open(newline="", encoding="utf-8") as handle:
        header, *rows = csv.reader(handle)
    return header, rows


def number(cell: str) -> float | None:
    """A results cell's figure (bold or not; a range's upper end), or None where it holds none."""
    try:
        return float(cell.strip("*").split("-")[-1])
    except ValueError:
        return None


@cache
def quality() -> dict[tuple[str, bool], float]:
    """{(format, outliers): the 8-bit activations' largest relative error against bf16 activations}, the
    check kernels.QUALITY_TOLERANCE bounds: the worst of bench/results/w4a8_quality.csv's output and
    input-gradient ranges over every GEMM of the format (the error is the rounding's, not the card's)."""
    header, rows = read_results("w4a8_quality")
    found: dict[tuple[str, bool], float] = {}
    for row in (dict(zip(header, row)) for row in rows):
        fmt = row["activations"].split(",")[0].split()[0].lower()
        for outliers, inputs in ((False, "N(0, 1)"), (True, "outliers")):
            worst = max(number(row[f"{part}, {inputs}"]) for part in ("y", "dx"))
            found[(fmt, outliers)] = max(found.get((fmt, outliers), 0.0), worst)
    return found


@cache
def compiled_gain() -> tuple[float, float]:
    """The compiled step over the uncompiled one on the H200, lowest and highest: each pair of
    bench/results/same_call_run.csv's rows that ran both (the same weights, px and call)."""
    header, rows = read_results("same_call_run")
    steps = {}
    for row in (dict(zip(header, row)) for row in rows):
        blocks, step = row["blocks"].strip("*"), number(row["s/it:"])
        if blocks in ("compiled", "uncompiled") and step:
            steps[(row["weights / GEMM"], row["px:"], row["source"], blocks)] = step
    ratios = [step / steps[(*key[:3], "uncompiled")] for key, step in steps.items()
              if key[3] == "compiled" and (*key[:3], "uncompiled") in steps]
    return min(ratios), max(ratios)


@cache
def x_bf16() -> dict[str, float]:
    """Block Linears' time against bf16 weights, the self-test on the H200 at 1024 + 512 tokens: the
    latest call of bench/results/selftest_paths.csv. int8 never wins a pick: it fails the outlier gate."""
    header, rows = read_results("selftest_paths")
    column = max(index for index, name in enumerate(header) if name.startswith("block Linears ms")) + 1
    measured = {row[0]: float(row[column]) for row in rows if row[column]}
    return {candidate: measured[row] for candidate, row in PATH_ROWS.items()}


@cache
def fallback_costs() -> dict[str, str]:
    """{qtype `auto` falls back to: what it costs}, the full-width same-call steps of
    bench/results/fallback_cost.csv (x int4_fused, x bf16)."""
    header, rows = read_results("fallback_cost")
    found = {row["qtype"] + (" reference" if "reference" in row["kernel"] else ""): row
             for row in (dict(zip(header, row)) for row in rows)}
    uint4, reference = found[verdict.FALLBACK_QTYPE], found[f"{verdict.STREAMING_FALLBACK} reference"]
    return {verdict.FALLBACK_QTYPE: f"{verdict.FALLBACK_QTYPE} steps {uint4['x int4_fused:']}x the int4_fused time, "
                                    f"{uint4['x bf16:']}x bf16 (H200, full width; bench/RESULTS.md)",
            verdict.STREAMING_FALLBACK: f"the plain-PyTorch path steps {reference['x int4_fused:']}x int4_fused's "
                                        "Triton time (H200, full width; bench/RESULTS.md)"}


def paper_report(card: Card, triton: bool, inductor: bool) -> dict:
    """The self-test report the runner would write on `card`, with or without Triton and Inductor."""
    report = {"created": "on paper", "checks": [], "training": [], "timing": [],
              "environment": {"triton": "3.x" if triton else None, "hip": "7.x" if card.hip else None,
                              "fp8_units": card.fp8_units,
                              "gpu": {"name": card.name, "vram_gib": card.vram_gib, "arch": card.arch}}}
    for (fmt, outliers), error in quality().items():
        tolerance = kernels.QUALITY_TOLERANCE["outliers" if outliers else fmt]
        report["checks"].append({"format": fmt, "outliers": outliers, "max_relative_error": error,
                                 "tolerance": tolerance, "passed": error <= tolerance})
    if not triton:
        report["fastest"] = {"qtype": None, "reason": "Triton does not import; the 4-bit kernels need it"}
    else:
        candidates = kernels.candidates(card.fp8_units, card.hip)
        eligible = {c["name"] for c in candidates if kernels.quality_passed(report["checks"], c)}
        rows = [{"candidate": "bf16", "step_ms": 1.0}]
        rows += [{"candidate": c["name"], "step_ms": x_bf16()[c["name"]]} for c in candidates
                 if c["name"] in x_bf16()]
        report["timing"].append({"results": rows})
        report["fastest"] = runner.pick_fastest(report, candidates, eligible)
    report["streaming"] = {"passed": True, "device": "cuda", "seconds": 60}
    report["compile"] = paper_compile(report, inductor)
    return report


def paper_compile(report: dict, inductor: bool) -> dict:
    """The compile check's outcome: it runs where `compiled.applicable` lets it, and passes where
    Inductor compiles (its gain on full-size blocks was measured on the H200: compiled_gain)."""
    reason = compiled.applicable(report)
    if reason:
        return {"passed": False, "reason": reason}
    if not inductor:
        return {"passed": False, "reason": "the blocks did not compile here (Inductor failed)"}
    return {"passed": True, "x_eager": 1.0, "compile_s": 30}


@dataclass(frozen=True)
class Outcome:
    qtype: str
    candidate: str
    stream_mode: str
    compile_blocks: bool


def outcome(card: Card, triton: bool, inductor: bool) -> Outcome:
    """What the card's preset trains on: `qtype: auto` resolved through `verdict`, or the qtype the
    preset names (on its plain-PyTorch reference path without Triton); `stream_mode` and
    `compile_blocks: auto` through `verdict`."""
    report = paper_report(card, triton, inductor)
    mode, _ = verdict.streaming_from(report)
    compile_blocks, _ = verdict.compile_from(report)
    named = preset_qtype(card)
    if named != AUTO:
        return Outcome(named, named if triton else f"{named} (reference)", mode, compile_blocks)
    choice = verdict.qtype_from(report, streams=streams(card))
    reference = choice.kernel.get("int4_kernel") is False
    candidate = (report["fastest"] or {}).get("candidate") or (f"{choice.qtype} (reference)" if reference
                                                               else choice.qtype)
    return Outcome(choice.qtype, candidate, mode, compile_blocks)


STATES = ((True, True), (True, False), (False, False))
"""Triton and Inductor working, Triton without Inductor, neither."""


def eight_bit_path(card: Card) -> str:
    """Why the card's 8-bit-activation path can or cannot be its pick (bench/RESULTS.md: the
    quality gate, the Hadamard rotation, int4 WMMA)."""
    if card.fp8_units:
        return "FP8: passes the quality gate"
    if card.hip:
        return "int8 at the bf16 rate: no GEMM gain; fails the outlier gate unless rotated (not built)"
    return "int8 faster than bf16 here; fails the outlier gate unless rotated (not built)"


def no_inductor() -> str:
    """What a card that compiles its blocks loses without Inductor."""
    low, high = compiled_gain()
    return f"uncompiled blocks (compiled: {low:.2f}-{high:.2f}x the step on the H200)"


def markdown_table(cards: list[Card] = CARDS) -> str:
    """docs/cards.md's "what runs on your card" table: the pick with Triton and Inductor working,
    then what a missing Inductor or a missing Triton turns it into. Cards of one arch and preset
    whose verdicts agree share a row, and rows that differ only in their preset become one (the
    klein 4B and 9B presets of a card, say)."""
    lines = ["| card | arch | preset | qtype | stream | compiled | 8-bit activations | no Inductor | no Triton |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows: dict[tuple, list[str]] = {}
    for (arch, preset, cells), members in group_cards(cards).items():
        rows.setdefault((", ".join(member.name for member in members), arch, cells), []).append(f"{preset}.yaml")
    for (names, arch, cells), presets in rows.items():
        lines.append(f"| {names} | {arch} | {', '.join(presets)} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def group_cards(cards: list[Card]) -> dict[tuple, list[Card]]:
    """The cards by (arch, preset, verdict cells), in the table's order."""
    groups: dict[tuple, list[Card]] = {}
    for card in cards:
        best, plain, bare = (outcome(card, *state) for state in STATES)
        lost = no_inductor() if best.compile_blocks and not plain.compile_blocks else "-"
        cells = (best.candidate, best.stream_mode, "yes" if best.compile_blocks else "no", eight_bit_path(card), lost,
                 f"{bare.qtype}, uncompiled: {fallback_costs()[bare.qtype]}")
        groups.setdefault((card.arch, card.preset, cells), []).append(card)
    return groups

if __name__ == "__main__":
    print(markdown_table(), end="")
