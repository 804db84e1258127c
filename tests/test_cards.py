"""The card table (presets/cards.csv): what `auto` gives each card, the self-test's verdict on paper
row by row, worked out, never typed; what the table writes elsewhere (docs/cards.md, the listing);
the measured figures the docs show, read from bench/results."""

import csv
import re
from pathlib import Path

import pytest

from flux2_contract import qtypes
from launcher import card_table, cards_doc
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
    """With Triton a card trains on a Triton path, FP8's where it has FP8 units; without it on the
    fallback the memory plan allows (the reference path where its preset may stream blocks). AMD
    cards stream serialized, NVIDIA's overlapped; every card compiles with Inductor, none without."""
    result = cards.outcome(card, triton, inductor)
    assert result.qtype == result.candidate.split()[0]
    if triton:
        assert result.candidate.startswith("int4_w4a8 fp8") == card.fp8_units
        assert "reference" not in result.candidate
    else:
        streams = cards.streams(card)
        assert result.qtype == (verdict.STREAMING_FALLBACK if streams else verdict.FALLBACK_QTYPE)
        assert result.candidate.endswith("(reference)") == streams
    assert result.stream_mode == (SER if card.hip else "overlapped")
    assert result.compile_blocks == (triton and inductor)


def test_the_fp8_rule_is_the_runtime_s_for_every_arch_spelling():
    """One rule for the table and the runtime; an arch with a feature suffix (sm_90a) or RDNA4's
    gfx12xx reads as the compilers name them."""
    rule = qtypes.arch_has_fp8_units
    facts = {"sm_86": False, "sm_89": True, "sm_90a": True, "sm_100a": True, "sm_120": True,
             "gfx1100": False, "gfx1101": False, "gfx1200": True, "gfx1201": True}
    assert {arch: card_table.Card("x", arch, 16, "base_512").fp8_units for arch in facts} == facts
    assert all(card.fp8_units == rule(card.arch) for card in cards.CARDS)


def test_no_shipped_preset_names_its_cards():
    """The card table is the only card -> preset map: a card preset says nothing of its cards."""
    assert all(not load_preset(preset).settings["card"] for preset in card_table.labels(cards.CARDS))


def test_the_old_card_presets_are_the_ones_they_copied():
    """Each old name of the table reads its preset, in the run folder it always had."""
    moved = card_table.old_names(cards.CARDS)
    assert {old: card.preset for old, card in moved.items()} == {
        "7900xt_512": "7900xtx_512", "rx16gb_512": "7900xtx_512", "rtx4090_512": "base_512",
        "rtx16gb_512": "base_512", "rtx12gb_512": "base_512", "rtx8gb_512": "base_512"}
    for old, card in moved.items():
        renamed, preset = load_preset(old), load_preset(card.preset)
        assert renamed.path == preset.path and renamed.name == f"flux2_{old}"
        assert {**renamed.config, "config": {**renamed.config["config"], "name": preset.name}} == preset.config


def test_the_generated_files_are_current():
    assert cards_doc.main(["--check"]) == 0, "run python -m launcher.cards_doc"


def test_a_card_is_one_row(tmp_path):
    """A throwaway row in a copy of the table reaches its preset's cards, docs/cards.md's card table
    with its verdicts worked out, and docs/presets.md's listing; only those docs then read as stale."""
    table = tmp_path / "cards.csv"
    table.write_text(card_table.TABLE.read_text(encoding="utf-8") + "RTX Test 16 GB,sm_100a,16,base_512,\n",
                     encoding="utf-8")
    rows = card_table.read_cards(table)
    assert rows[-1].name == "RTX Test 16 GB" and len(rows) == len(cards.CARDS) + 1
    assert card_table.labels(rows)["base_512"].startswith("RTX 4090, ") and "RTX Test 16 GB" in card_table.labels(rows)["base_512"]
    assert f"| RTX Test 16 GB | sm_100a | base_512.yaml | {FP8_SCALED} | overlapped | yes |" in cards.markdown_table(rows)
    assert cards_doc.differing(cards_doc.documents(rows)) == [cards_doc.CARDS_DOC]


def test_an_old_name_with_two_presets_is_refused(tmp_path):
    table = tmp_path / "cards.csv"
    table.write_text(f"{HEADER}\nA,sm_89,24,base_512,old_512\nB,gfx1100,24,7900xtx_512,old_512\n", encoding="utf-8")
    with pytest.raises(LauncherError, match=re.escape(f"{table}, line 3: old_name 'old_512' is preset base_512 on line 2")):
        card_table.read_cards(table)


@pytest.mark.parametrize("row,says", [
    ("RTX Test,sm89,24,base_512,", "arch 'sm89' is neither"),
    ("RTX Test,sm_89,24 GB,base_512,", "vram_gb '24 GB' is not a whole number"),
    ("RTX Test,sm_89,24,base_512.yaml,", "preset 'base_512.yaml' is not a file of presets/"),
    ("RTX Test,sm_89,24,base_512,tiny", "old_name 'tiny' is a shipped preset's file"),
    ("RTX Test,sm_89,24,base_512", "4 cells, the table has 5"),
])
def test_a_bad_row_is_refused_with_its_line(tmp_path, row, says):
    table = tmp_path / "cards.csv"
    table.write_text(f"{HEADER}\n{row}\n", encoding="utf-8")
    with pytest.raises(LauncherError, match=re.escape(f"{table}, line 2: {says}")):
        card_table.read_cards(table)


def test_a_table_without_its_header_is_refused(tmp_path):
    table = tmp_path / "cards.csv"
    table.write_text("RTX Test,sm_89,24,base_512,\n", encoding="utf-8")
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


def test_block_times_are_the_latest_call_of_the_results_file():
    """The paper verdicts' block-Linear times come from selftest_paths.csv's last call column."""
    assert cards.x_bf16() == {"int4_fused": 1.37, FP8_TRITON: 1.10, FP8_SCALED: 1.00, "int4_w4a8 int8 triton": 1.06}


def test_the_fallback_costs_in_the_docs_are_the_results_file_s():
    """docs/cards.md shows the full-width same-call figures of fallback_cost.csv (x int4_fused)."""
    with (REPO / "bench" / "results" / "fallback_cost.csv").open(newline="", encoding="utf-8") as handle:
        rows = {row["qtype"] + (" reference" if "reference" in row["kernel"] else ""): row for row in csv.DictReader(handle)}
    costs, page = cards.fallback_costs(), cards_doc.CARDS_DOC.read_text(encoding="utf-8")
    assert f"{rows['uint4']['x int4_fused:']}x the int4_fused time, {rows['uint4']['x bf16:']}x bf16" in costs["uint4"]
    assert f"{rows['int4_fused reference']['x int4_fused:']}x int4_fused's Triton time" in costs["int4_fused"]
    assert all(f"{qtype}, uncompiled: {cost}" in page for qtype, cost in costs.items())


def test_setup_takes_an_amd_card_s_gfx_target_from_its_row():
    """Windows names the adapter; a card of the table gets its row's arch, whole words only (the
    RX 7900 XT is not taken for the XTX)."""
    from launcher.envs import amdgpu

    amd = [card for card in cards.CARDS if card.hip]
    assert {card.name for card in amd} >= {"RX 7900 XTX", "RX 7900 XT", "RX 9070 XT"}
    assert all(amdgpu.target_of(f"AMD Radeon {card.name}") == card.arch for card in amd)
    assert amdgpu.target_of("AMD Radeon(TM) Graphics") is None


@pytest.fixture
def results_folder(tmp_path, monkeypatch):
    """A throwaway bench/results/ for the paper verdicts' readers; their cached figures forgotten around it."""
    readers = (cards.quality, cards.compiled_gain)
    for reader in readers:
        reader.cache_clear()
    monkeypatch.setattr(cards, "RESULTS", tmp_path)
    yield tmp_path
    for reader in readers:
        reader.cache_clear()


def test_the_compiled_gain_is_the_range_of_the_pairs_one_call_ran(results_folder):
    """Compiled over uncompiled, for the same weights, px and call; a row without its pair or without a
    step is left out."""
    (results_folder / "same_call_run.csv").write_text(
        "weights / GEMM,blocks,px:,s/it:,source\n"
        "bf16,uncompiled,512,1.000,a\nbf16,**compiled**,512,**0.700**,a\n"
        "int4,uncompiled,512,2.0,a\nint4,compiled,512,1.5,a\n"
        "int4,compiled,512,0.1,b\nbf16,uncompiled,1024,out of its limit,a\nbf16,compiled,1024,0.2,a\n",
        encoding="utf-8")
    assert cards.compiled_gain() == pytest.approx((0.70, 0.75))
    assert cards.no_inductor() == "uncompiled blocks (compiled: 0.70-0.75x the step on the H200)"


def test_the_quality_figures_are_each_format_s_worst_range_end(results_folder):
    (results_folder / "w4a8_quality.csv").write_text(
        'activations,"y, N(0, 1)","dx, N(0, 1)","y, outliers","dx, outliers"\n'
        '"FP8 e4m3, Triton GEMM",0.030-0.031,0.032,0.040,0.033\n"FP8 e4m3, cuBLAS",0.031,0.035,0.041,0.030\n'
        '"int8, Triton GEMM",0.010-0.012,0.011,**0.100-0.200**,0.012\n', encoding="utf-8")
    assert cards.quality() == {("fp8", False): 0.035, ("fp8", True): 0.041, ("int8", False): 0.012, ("int8", True): 0.2}
    checks = cards.paper_report(cards.CARDS[0], triton=True, inductor=True)["checks"]
    assert [(c["format"], c["outliers"]) for c in checks if not c["passed"]] == [("int8", True)]


def test_the_shipped_quality_figures_fail_int8_alone_and_only_with_outliers():
    """bench/RESULTS.md's finding the verdicts rest on: int8 activations pass unless outlier channels stretch them."""
    checks = cards.paper_report(cards.CARDS[0], triton=True, inductor=True)["checks"]
    assert {(c["format"], c["outliers"]) for c in checks} == {("int8", False), ("fp8", False), ("int8", True), ("fp8", True)}
    assert [(c["format"], c["outliers"]) for c in checks if not c["passed"]] == [("int8", True)]
