"""The card figures the step prediction scales by, and what the prediction does with them."""

import itertools

import pytest

from bench import predict_step
from flux2_contract import memory_plan, qtypes
from launcher.card_specs import SPECS
from launcher.card_table import read_cards
from launcher.selftest import cards as paper

NVIDIA = [name for name, spec in SPECS.items() if not spec.hip]


def test_a_card_of_both_tables_has_one_arch_and_one_memory():
    """The figures here and the card table's row name the same card: its arch, its memory, and the stream
    mode its self-test gives on paper (with Triton and Inductor working)."""
    rows = {row.name: row for row in read_cards()}
    both = [name for name in SPECS if name in rows]
    assert {"RX 7900 XTX", "RTX 4090", "RTX 3090", "RTX 4080", "RTX 4070 Ti Super"} <= set(both)
    for name in both:
        spec, row = SPECS[name], rows[name]
        assert (spec.arch, spec.memory_gb, predict_step.stream_mode(name)) == \
            (row.arch, row.vram_gib, paper.outcome(row, True, True).stream_mode)


def test_an_fp8_rate_exactly_where_the_runtime_finds_fp8_units():
    has_fp8 = qtypes.arch_has_fp8_units
    assert {name: spec.fp8_tflops is not None for name, spec in SPECS.items()} == \
        {name: has_fp8(spec.arch) for name, spec in SPECS.items()}


def test_the_3090_trains_without_fp8_and_its_int8_path_runs_at_its_int8_rate():
    assert "int4_w4a8 fp8" not in predict_step.paths("RTX 3090")
    assert predict_step.paths("RTX 3090")[0] == "int4_fused"
    with pytest.raises(ValueError, match="no fp8 tensor rate"):
        predict_step.gemm_factor("RTX 3090", "fp8")
    spec = SPECS["RTX 3090"]
    assert predict_step.gemm_factor("RTX 3090", "int8") == pytest.approx(
        predict_step.gemm_factor("RTX 4090", "fp8") * spec.bf16_tflops / spec.int8_tops
        * SPECS["RTX 4090"].fp8_tflops / SPECS["RTX 4090"].bf16_tflops)
    assert all(predict_step.paths(name)[0] == "int4_w4a8 fp8" for name in NVIDIA if name != "RTX 3090")


def test_an_nvidia_cards_rate_range_is_its_clock_range():
    for name in NVIDIA:
        slow, central, fast = predict_step.rates(name)
        base, boost = SPECS[name].clocks_mhz
        assert slow / fast == pytest.approx(base / boost) and slow < central < fast < SPECS[name].bf16_tflops


def dominates(a: str, b: str) -> bool:
    """Card `a` is at least card `b` in every figure the model scales by, and above it in one."""
    figures = [(predict_step.rates(name)[1], SPECS[name].peak("fp8"), SPECS[name].bandwidth_gbs, SPECS[name].memory_gb,
                SPECS[name].pcie_gbs) for name in (a, b)]
    return all(x >= y for x, y in zip(*figures)) and figures[0] != figures[1]


@pytest.mark.parametrize("px", [512, 1024])
def test_a_card_faster_in_every_figure_is_predicted_faster(px):
    """The ranking follows compute, bandwidth and memory: never the reverse, at either end of the range."""
    plan = memory_plan
    fp8_cards = [name for name in NVIDIA if SPECS[name].fp8_tflops]
    pairs = [(a, b) for a, b in itertools.permutations(fp8_cards, 2) if dominates(a, b)]
    assert ("RTX 5090", "RTX 4090") in pairs and ("RTX 4080", "RTX 4070 Ti Super") in pairs
    for a, b in pairs:
        for compiled in (False, True):
            faster, slower = (predict_step.predict(card, "int4_w4a8 fp8", px, compiled, plan) for card in (a, b))
            for column in ("s/it fast:", "s/it slow:"):
                assert float(faster[column]) <= float(slower[column]), (a, b, px, compiled, column)


def test_more_bandwidth_alone_shortens_only_the_memory_bound_parts(monkeypatch):
    """Doubling a card's bandwidth halves its elementwise and 4-bit overhead seconds; its GEMMs stay."""
    from dataclasses import replace

    plan = memory_plan
    before = predict_step.predict("RTX 4090", "int4_w4a8 fp8", 512, True, plan)
    spec = SPECS["RTX 4090"]
    monkeypatch.setitem(SPECS, "RTX 4090", replace(spec, bandwidth_gbs=2 * spec.bandwidth_gbs))
    after = predict_step.predict("RTX 4090", "int4_w4a8 fp8", 512, True, plan)
    assert after["GEMMs + attention s at central:"] == before["GEMMs + attention s at central:"]
    for column in ("elementwise s:", "4-bit overhead s:"):
        assert float(after[column]) == pytest.approx(float(before[column]) / 2, abs=0.01)


def test_the_h200_rate_is_read_from_the_bf16_row_at_512_px(tmp_path, monkeypatch):
    """The one measured figure of the rate ranges: block_linear_time.csv's first TFLOP/s column (512 px),
    not the 1024 px column of the same name."""
    from launcher.card_specs import H200_BF16_TFLOPS

    (tmp_path / "block_linear_time.csv").write_text(
        "path,512 px ms:,TFLOP/s:,1024 px ms:,TFLOP/s:\n`int4_fused`,1.0,500,2.0,600\nbf16 weights,1.0,700,2.0,650\n",
        encoding="utf-8")
    monkeypatch.setattr(predict_step, "RESULTS", tmp_path)
    predict_step.h200_gemm_tflops.cache_clear()
    try:
        assert predict_step.h200_gemm_tflops() == 700.0
        assert predict_step.rates("RTX 4090")[2] == pytest.approx(SPECS["RTX 4090"].bf16_tflops * 700 / H200_BF16_TFLOPS)
    finally:
        predict_step.h200_gemm_tflops.cache_clear()
