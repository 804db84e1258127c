"""What `auto` gives each card, worked out before the card is in the machine.

The self-test decides on the user's GPU; this module runs the same decision on paper for the
cards of the card table (`presets/cards.csv`, read by `launcher/card_table.py`). For a card
(architecture, FP8 matrix units by the runtime's rule, HIP or CUDA) and a software state (Triton
importable or not, Inductor compiling or not) it writes the self-test report the runner would
write, with the runner's own candidate list, quality rule and pick, and passes it to the verdict
functions `run` uses. What the paper cannot know is stated in `PAPER_FACTS`: the quality gate's
figures (measured on the CPU reference path, the same on every card) and the block-Linear time of
each path relative to bf16 (measured on the H200; the order of the FP8 and bf16 paths holds where
FP8 runs at twice the bf16 rate, as on every FP8 card listed). `python -m launcher.cards_doc`
writes the table docs/cards.md carries; `python -m launcher.selftest.cards` prints it.
"""

from dataclasses import dataclass
from functools import cache

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

PAPER_FACTS = {
    # the 8-bit-activation error against bf16 activations (QUALITY_TOLERANCE's measurements)
    "quality": {("int8", False): 0.010, ("fp8", False): 0.037, ("int8", True): 0.126, ("fp8", True): 0.031},
    # block Linears' time against bf16 weights, the self-test on the H200 at 1024 + 512 tokens
    # (bench/results/selftest_paths.csv, call 9); int8 never wins a pick: it fails the outlier gate.
    # A path with no figure here (gemm in_register, not yet timed on a GPU) is not timed on paper, so
    # the paper never picks it; the self-test times it on the card
    "x_bf16": {"int4_fused": 1.37, "int4_w4a8 fp8 triton": 1.10, "int4_w4a8 fp8 scaled_mm": 1.00,
               "int4_w4a8 int8 triton": 1.06},
}


def paper_report(card: Card, triton: bool, inductor: bool) -> dict:
    """The self-test report the runner would write on `card`, with or without Triton and Inductor."""
    report = {"created": "on paper", "checks": [], "training": [], "timing": [],
              "environment": {"triton": "3.x" if triton else None, "hip": "7.x" if card.hip else None,
                              "fp8_units": card.fp8_units,
                              "gpu": {"name": card.name, "vram_gib": card.vram_gib, "arch": card.arch}}}
    for (fmt, outliers), error in PAPER_FACTS["quality"].items():
        tolerance = kernels.QUALITY_TOLERANCE["outliers" if outliers else fmt]
        report["checks"].append({"format": fmt, "outliers": outliers, "max_relative_error": error,
                                 "tolerance": tolerance, "passed": error <= tolerance})
    if not triton:
        report["fastest"] = {"qtype": None, "reason": "Triton does not import; the 4-bit kernels need it"}
    else:
        candidates = kernels.candidates(card.fp8_units, card.hip)
        eligible = {c["name"] for c in candidates if kernels.quality_passed(report["checks"], c)}
        rows = [{"candidate": "bf16", "step_ms": 1.0}]
        rows += [{"candidate": c["name"], "step_ms": PAPER_FACTS["x_bf16"][c["name"]]} for c in candidates
                 if c["name"] in PAPER_FACTS["x_bf16"]]
        report["timing"].append({"results": rows})
        report["fastest"] = runner.pick_fastest(report, candidates, eligible)
    report["streaming"] = {"passed": True, "device": "cuda", "seconds": 60}
    report["compile"] = paper_compile(report, inductor)
    return report


def paper_compile(report: dict, inductor: bool) -> dict:
    """The compile check's outcome: it runs where `compiled.applicable` lets it, and passes where
    Inductor compiles (its gain on full-size blocks was measured on the H200: 0.68-0.92x)."""
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


def wrong_verdicts(cards: list[Card]) -> list[str]:
    """Where a row's verdict columns (`with_triton`, `without_triton`, `stream_mode`) are not what
    the self-test's rules give its card: one line a card, with the value to write."""
    problems = []
    for card in cards:
        best, _, bare = (outcome(card, *state) for state in STATES)
        for column, written, derived in (("with_triton", card.with_triton, best.candidate),
                                         ("without_triton", card.without_triton, bare.candidate),
                                         ("stream_mode", card.stream_mode, best.stream_mode)):
            if written != derived:
                problems.append(f"{card.name}: {column} is {written!r}, the self-test's rules give {derived!r}")
    return problems


def eight_bit_path(card: Card) -> str:
    """Why the card's 8-bit-activation path can or cannot be its pick (bench/RESULTS.md: the
    quality gate, the Hadamard rotation, int4 WMMA)."""
    if card.fp8_units:
        return "FP8: passes the quality gate"
    if card.hip:
        return "int8 at the bf16 rate: no GEMM gain; fails the outlier gate unless rotated (not built)"
    return "int8 faster than bf16 here; fails the outlier gate unless rotated (not built)"


NO_INDUCTOR = "uncompiled blocks (compiled: 0.68-0.92x the step on the H200)"
NO_TRITON = {verdict.FALLBACK_QTYPE: f"{verdict.FALLBACK_QTYPE}, uncompiled: {verdict.FALLBACK_COST}",
             "int4_fused": f"int4_fused, uncompiled: {verdict.REFERENCE_COST}"}


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
        lost = NO_INDUCTOR if best.compile_blocks and not plain.compile_blocks else "-"
        cells = (best.candidate, best.stream_mode, "yes" if best.compile_blocks else "no", eight_bit_path(card), lost,
                 NO_TRITON[bare.qtype])
        groups.setdefault((card.arch, card.preset, cells), []).append(card)
    return groups

if __name__ == "__main__":
    print(markdown_table(), end="")
