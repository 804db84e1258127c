"""The card table (presets/cards.csv): what `auto` gives each card, the self-test's verdict on paper
row by row, and what the table writes elsewhere (preset labels, README tables)."""

import csv
import re
from pathlib import Path

import pytest

from launcher import card_table, cards_doc, trainer_rules
from launcher.errors import LauncherError
from launcher.runs.presets import load_preset
from launcher.selftest import cards, verdict

REPO = Path(__file__).resolve().parent.parent
FP8_TRITON, FP8_SCALED = "int4_w4a8 fp8 triton", "int4_w4a8 fp8 scaled_mm"
SER = "serialized"
HEADER = ",".join(card_table.COLUMNS)


@pytest.mark.parametrize("triton,inductor", cards.STATES, ids=["triton+inductor", "triton", "neither"])
@pytest.mark.parametrize("card", cards.CARDS, ids=[card.name for card in cards.CARDS])
def test_what_each_card_trains_on(card, triton, inductor):
    """The row's verdict columns are what the self-test's rules give; every card compiles with
    Inductor and none without it."""
    result = cards.outcome(card, triton, inductor)
    assert result.candidate == (card.with_triton if triton else card.without_triton)
    assert result.qtype == result.candidate.split()[0]
    assert result.stream_mode == card.stream_mode
    assert result.compile_blocks == (triton and inductor)


def test_the_fp8_rule_is_the_runtime_s_for_every_arch_spelling():
    """One rule for the table and the runtime; an arch with a feature suffix (sm_90a) or RDNA4's
    gfx12xx reads as the compilers name them."""
    rule = trainer_rules.qtypes().arch_has_fp8_units
    facts = {"sm_86": False, "sm_89": True, "sm_90a": True, "sm_100a": True, "sm_120": True,
             "gfx1100": False, "gfx1101": False, "gfx1200": True, "gfx1201": True}
    assert {arch: card_table.Card("x", arch, 16, "rtx16gb_512").fp8_units for arch in facts} == facts
    assert all(card.fp8_units == rule(card.arch) for card in cards.CARDS)


def test_each_card_preset_is_labelled_with_its_rows():
    assert {preset: load_preset(preset).settings["card"] for preset in card_table.labels(cards.CARDS)} == \
        card_table.labels(cards.CARDS)


def test_the_generated_files_are_current():
    assert cards_doc.main(["--check"]) == 0, "run python -m launcher.cards_doc"


def test_a_card_is_one_row(tmp_path):
    """A throwaway row in a copy of the table reaches its preset's label, docs/cards.md's card table
    and the verdict check; the shipped files then read as stale."""
    table = tmp_path / "cards.csv"
    row = f"RTX Test 16 GB,sm_100a,16,rtx16gb_512,{FP8_SCALED},int4_fused (reference),overlapped"
    table.write_text(card_table.TABLE.read_text(encoding="utf-8") + row + "\n", encoding="utf-8")
    rows = card_table.read_cards(table)
    assert rows[-1].name == "RTX Test 16 GB" and len(rows) == len(cards.CARDS) + 1
    assert card_table.labels(rows)["rtx16gb_512"].endswith(", RTX Test 16 GB (16 GB)")
    assert f"| RTX Test 16 GB | sm_100a | rtx16gb_512.yaml | {FP8_SCALED} | overlapped | yes |" in cards.markdown_table(rows)
    assert cards.wrong_verdicts(rows) == []
    preset = card_table.PRESETS_DIR / "rtx16gb_512.yaml"
    assert cards_doc.stale(cards_doc.preset_files(rows)) == [preset]
    assert cards_doc.stale(cards_doc.documents(rows)) == [cards_doc.CARDS_DOC]


def test_a_row_whose_verdict_is_not_the_rules_is_named(tmp_path):
    table = tmp_path / "cards.csv"
    table.write_text(f"{HEADER}\nRTX Test,sm_86,24,rtx4090_512,{FP8_SCALED},uint4,overlapped\n", encoding="utf-8")
    assert cards.wrong_verdicts(card_table.read_cards(table)) == [
        f"RTX Test: with_triton is {FP8_SCALED!r}, the self-test's rules give 'int4_fused'"]


@pytest.mark.parametrize("row,says", [
    ("RTX Test,sm89,24,rtx4090_512,a,b,overlapped", "arch 'sm89' is neither"),
    ("RTX Test,sm_89,24 GB,rtx4090_512,a,b,overlapped", "vram_gb '24 GB' is not a whole number"),
    ("RTX Test,sm_89,24,rtx4090_512.yaml,a,b,overlapped", "preset 'rtx4090_512.yaml' is not a file of presets/"),
    ("RTX Test,sm_89,24,rtx4090_512,a,b,fast", "stream_mode 'fast' is none of serialized, overlapped"),
    ("RTX Test,sm_89,24,rtx4090_512", "4 cells, the table has 7"),
])
def test_a_bad_row_is_refused_with_its_line(tmp_path, row, says):
    table = tmp_path / "cards.csv"
    table.write_text(f"{HEADER}\n{row}\n", encoding="utf-8")
    with pytest.raises(LauncherError, match=re.escape(f"{table}, line 2: {says}")):
        card_table.read_cards(table)


def test_a_table_without_its_header_is_refused(tmp_path):
    table = tmp_path / "cards.csv"
    table.write_text("RTX Test,sm_89,24,rtx4090_512,a,b,overlapped\n", encoding="utf-8")
    with pytest.raises(LauncherError, match=re.escape(f"{table}, line 1: the header must be {HEADER}")):
        card_table.read_cards(table)


def test_no_8bit_path_on_cards_without_fp8_units():
    """int8 activations fail the outlier gate, so RDNA3 and Ampere never pick int4_w4a8."""
    for card in cards.CARDS:
        report = cards.paper_report(card, triton=True, inductor=True)
        assert (report["fastest"]["qtype"] == "int4_w4a8") == card.fp8_units, card.name


def test_a_fallback_says_why_and_what_it_costs():
    report = cards.paper_report(cards.CARDS[0], triton=False, inductor=False)
    line = verdict.qtype_from(report).line
    assert "Triton does not import" in line and verdict.FALLBACK_COST in line


def test_amd_cards_stream_serialized_even_when_the_check_passed():
    report = cards.paper_report(cards.CARDS[0], triton=True, inductor=True)
    assert report["streaming"]["passed"]
    mode, why = verdict.streaming_from(report)
    assert mode == SER and "wall 5" in why


def test_block_times_are_the_measured_ones():
    """PAPER_FACTS' block-Linear times are the H200 self-test's latest call, as the results table says."""
    with (REPO / "bench" / "results" / "selftest_paths.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    column = next(i for i, name in enumerate(rows[0]) if name.startswith("block Linears ms, call 9")) + 1
    measured = {row[0]: float(row[column]) for row in rows[1:] if row[column]}
    names = {"int4_fused": "`int4_fused`", FP8_TRITON: "`int4_w4a8` FP8, Triton GEMM",
             FP8_SCALED: "`int4_w4a8` FP8, `torch._scaled_mm`", "int4_w4a8 int8 triton": "`int4_w4a8` int8, Triton GEMM"}
    assert {name: measured[row] for name, row in names.items()} == cards.PAPER_FACTS["x_bf16"]


def test_the_fallback_costs_are_the_measured_ones():
    """The costs the table and `run` print are the full-width same-call figures (x int4_fused)."""
    with (REPO / "bench" / "results" / "fallback_cost.csv").open(newline="", encoding="utf-8") as handle:
        rows = {row["qtype"] + (" reference" if "reference" in row["kernel"] else ""): row for row in csv.DictReader(handle)}
    assert f"{rows['uint4']['x int4_fused:']}x the int4_fused time, {rows['uint4']['x bf16:']}x bf16" in verdict.FALLBACK_COST
    assert f"{rows['int4_fused reference']['x int4_fused:']}x int4_fused's Triton time" in verdict.REFERENCE_COST
    assert verdict.REFERENCE_COST in cards.NO_TRITON["int4_fused"]
