"""The longest GPU dispatch of a step on an AMD card against Windows' 2 s GPU timeout
(bench/longest_kernel.py): the H200's figures scaled by each card's rate and bandwidth, and the
table docs/amd.md carries is the one the module computes."""

from pathlib import Path

import pytest

from bench import longest_kernel
from bench.predict_step import h200_gemm_tflops, rates
from launcher.card_specs import SPECS

REPO = Path(__file__).resolve().parents[1]


def test_a_dispatch_scales_by_the_cards_rate_and_bandwidth():
    xtx = longest_kernel.longest_s("RX 7900 XTX", 1024, h200_gemm_ms=4.5, h200_attention_s=0.2)
    assert xtx["gemm"] == pytest.approx(4.5e-3 * h200_gemm_tflops() / rates("RX 7900 XTX")[0])
    assert xtx["attention backward"] == pytest.approx(0.2 / 56 * 2.5 / 4.5 * h200_gemm_tflops() / rates("RX 7900 XTX")[0])
    slower = longest_kernel.longest_s("RX 7800 XT", 1024, h200_gemm_ms=4.5, h200_attention_s=0.2)
    rate = SPECS["RX 7800 XT"].bf16_tflops / SPECS["RX 7900 XTX"].bf16_tflops
    assert slower["gemm"] == pytest.approx(xtx["gemm"] / rate)
    assert slower["math softmax"] == pytest.approx(
        xtx["math softmax"] * SPECS["RX 7900 XTX"].bandwidth_gbs / SPECS["RX 7800 XT"].bandwidth_gbs)
    small = longest_kernel.longest_s("RX 7900 XTX", 512, h200_gemm_ms=4.5, h200_attention_s=0.2)
    assert xtx["math softmax"] == pytest.approx(small["math softmax"] * (4608 / 1536) ** 2)


def test_the_largest_gemm_is_the_slowest_linear_call_of_its_size():
    assert longest_kernel.h200_largest_gemm_ms(1024) > longest_kernel.h200_largest_gemm_ms(512) > 0


def test_docs_carry_the_computed_table():
    assert longest_kernel.markdown_table() in (REPO / "docs" / "amd.md").read_text(encoding="utf-8")
