"""The predicted step against a measured one: the table, its inverse, and the report's use of it."""

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import predict_step
from launcher.card_specs import SPECS
from launcher.runs.folders import RunFolder
from launcher.step_prediction import TABLE as PATH
from launcher.step_prediction import (Prediction, load_table, math_attention_s, measured_step, report, rows_for_gpu,
                                      run_shape)

REPO = Path(__file__).resolve().parents[1]
TABLE = load_table()
XTX_RATES = predict_step.rates("RX 7900 XTX")


BENCH_TABLE = REPO / "bench" / "results" / "prediction.csv"


def bench_rows() -> list[dict]:
    """bench's own table of the prediction (RESULTS.md's), the figures the launcher's rows leave out."""
    with BENCH_TABLE.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_the_shipped_rows_are_what_the_model_writes_now():
    """launcher/step_prediction.csv and bench's table are the model's output for today's card figures
    and measured tables: a change to either without `python bench/predict_step.py` fails here."""
    assert TABLE, "launcher/step_prediction.csv is empty"
    assert predict_step.main(["--check"]) == 0, "run python bench/predict_step.py"


def test_a_changed_card_figure_leaves_the_shipped_rows_stale(monkeypatch):
    spec = SPECS["RTX 4090"]
    monkeypatch.setitem(SPECS, "RTX 4090", replace(spec, bandwidth_gbs=spec.bandwidth_gbs / 2))
    assert set(predict_step.differing(predict_step.outputs(predict_step.rows()))) == {BENCH_TABLE, PATH}


def test_the_shipped_rows_give_bench_s_steps():
    """Every s/it column of bench's table is what the launcher's rows give at the card's rates (within
    the table's rounding: s/it to 0.1, its parts to 0.01 each)."""
    assert len(bench_rows()) == len(TABLE)
    for row, prediction in zip(bench_rows(), TABLE):
        fast, slow = prediction.range_s
        shown = [float(row[column].strip("*")) for column in ("s/it fast:", "s/it central:", "s/it slow:")]
        assert [fast, prediction.step_at(prediction.rates[1]), slow] == pytest.approx(shown, abs=0.08), \
            (row["card"], row["path"])


@settings(max_examples=200, deadline=None)
@given(bound=st.floats(0.1, 50), rest=st.floats(0, 50), rate=st.floats(5, 500))
def test_a_measured_step_gives_its_gemm_rate_back(bound, rest, rate):
    row = Prediction("RX 7900 XTX", "int4_fused", 512, True, XTX_RATES, bound, rest)
    assert row.implied_rate(row.step_at(rate)) == pytest.approx(rate, rel=1e-9)


def test_a_step_slower_than_the_rest_alone_implies_no_rate():
    row = Prediction("RX 7900 XTX", "int4_fused", 512, True, XTX_RATES, 3.0, 2.0)
    assert row.implied_rate(1.5) is None
    assert "slower than the GEMMs alone can explain" in row.verdict(1.5)


def test_the_verdict_places_a_step_against_the_range():
    row = Prediction("RX 7900 XTX", "int4_fused", 512, True, XTX_RATES, 3.43, 2.22)
    low, high = row.range_s
    assert low == pytest.approx(row.step_at(row.rates[2])) and high == pytest.approx(row.step_at(row.rates[0]))
    assert "inside the predicted" in row.verdict((low + high) / 2)
    assert "faster than the predicted" in row.verdict(low * 0.9)
    assert "1.50x the slow end" in row.verdict(high * 1.5)


def test_a_card_is_matched_as_whole_words():
    xtx = {row.card for row in rows_for_gpu(TABLE, "AMD Radeon RX 7900 XTX")}
    xt = {row.card for row in rows_for_gpu(TABLE, "AMD Radeon RX 7900 XT")}
    assert xtx == {"RX 7900 XTX"} and xt == {"RX 7900 XT"}
    assert {row.card for row in rows_for_gpu(TABLE, "NVIDIA GeForce RTX 4090")} == {"RTX 4090"}
    assert rows_for_gpu(TABLE, "NVIDIA GeForce RTX 4060 Ti") == []


def write_run(root, qtype="int4_fused", compiled=True, resolution=(512,), speeds=(6.0, 6.2, 6.1), arch="flux2",
              **kwargs):
    root.mkdir()
    process = {"model": {"arch": arch, "qtype": qtype, "model_kwargs": {"compile_blocks": compiled, **kwargs}},
               "datasets": [{"resolution": list(resolution)}]}
    (root / "config.yaml").write_text(yaml.safe_dump({"job": "extension", "config": {"process": [process]}}),
                                      encoding="utf-8")
    rows = [{"step": i, "s_per_it": None, "event": "first_step"} if i == 0 else {"step": i, "s_per_it": s}
            for i, s in enumerate((None, *speeds))]
    (root / "trainer-telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return RunFolder(root, root.name)


def test_a_run_is_placed_against_its_own_row(tmp_path):
    run = write_run(tmp_path / "r1")
    assert run_shape(run) == ("flux2", "int4_fused", 512, True)
    assert measured_step(run) == pytest.approx(6.1)
    found = report(["AMD Radeon RX 7900 XTX"], [run], TABLE)
    assert {(p["path"], p["px"], p["compiled"]) for p in found["predicted"]} >= {("int4_fused", 512, True)}
    row = next(r for r in TABLE if (r.model, r.card, r.path, r.px, r.compiled)
               == ("flux2", "RX 7900 XTX", "int4_fused", 512, True))
    assert found["runs"] == [{"run": "r1", "s_per_it": pytest.approx(6.1), "verdict": row.verdict(6.1)}]


def test_a_klein_run_is_placed_against_the_klein_row_not_the_dev_one(tmp_path):
    run = write_run(tmp_path / "k", arch="flux2_klein_9b", speeds=(1.0, 1.1, 1.2))
    found = report(["AMD Radeon RX 7900 XTX"], [run], TABLE)
    klein = next(r for r in TABLE if (r.model, r.card, r.path, r.px, r.compiled)
                 == ("flux2_klein_9b", "RX 7900 XTX", "int4_fused", 512, True))
    dev = next(r for r in TABLE if (r.model, r.card, r.path, r.px, r.compiled)
               == ("flux2", "RX 7900 XTX", "int4_fused", 512, True))
    assert klein.range_s[1] < dev.range_s[0]  # a 9B step is a fraction of the 32B one
    assert found["runs"][0]["verdict"] == klein.verdict(1.1)


@pytest.mark.parametrize("config", ["process: 5\n", "[]\n", "config: {process: [{}]}\n", "config: {process: []}\n"])
def test_a_damaged_config_is_no_row(tmp_path, config):
    run = write_run(tmp_path / "r")
    run.config.write_text(config, encoding="utf-8")
    assert run_shape(run) is None
    assert report(["AMD Radeon RX 7900 XTX"], [run], TABLE)["runs"][0]["verdict"] is None


def test_a_qtype_the_table_does_not_predict_is_no_row(tmp_path):
    assert run_shape(write_run(tmp_path / "r", qtype="qfloat8")) is None


def test_an_fp8_run_on_a_geforce_card_is_placed_against_its_fp8_row(tmp_path):
    run = write_run(tmp_path / "g", qtype="int4_w4a8", speeds=(3.0, 3.1, 3.2))
    row = next(r for r in TABLE if (r.model, r.card, r.path, r.px, r.compiled)
               == ("flux2", "RTX 4090", "int4_w4a8 fp8", 512, True))
    assert report(["NVIDIA GeForce RTX 4090"], [run], TABLE)["runs"][0]["verdict"] == row.verdict(3.1)
    assert report(["NVIDIA GeForce RTX 3090"], [run], TABLE)["runs"][0]["verdict"] is None  # no FP8: no such row


def test_an_overlapping_card_may_hide_its_copies_a_serializing_one_may_not():
    """The fast end of a streamed NVIDIA row leaves its copies out; an AMD row's fast end counts them."""
    copies = {(r["model"], r["card"], r["path"], int(r["px:"]), r["compiled"] == "yes"): float(r["copies s:"])
              for r in bench_rows()}
    for row in TABLE:
        hidden = copies[(row.model, row.card, row.path, row.px, row.compiled)] if not SPECS[row.card].hip else 0.0
        assert row.range_s[0] == pytest.approx(row.step_at(row.rates[2]) - hidden)
    assert any(row.hideable_s > 0 for row in TABLE) and any(row.rest_s > row.hideable_s > 0 for row in TABLE)


def test_math_attention_is_memory_traffic_of_the_square_of_the_tokens():
    """Four times the pixels, (4608 / 1536)^2 = 9x the traffic; a slower memory, proportionally longer."""
    xtx = math_attention_s("RX 7900 XTX", 512)
    assert math_attention_s("RX 7900 XTX", 1024) == pytest.approx(xtx * (4608 / 1536) ** 2)
    assert math_attention_s("RX 7800 XT", 512) == pytest.approx(xtx * SPECS["RX 7900 XTX"].bandwidth_gbs / 624.0)
    assert math_attention_s("RX 7900 XTX", 512, batch=2) == pytest.approx(2 * xtx)
    assert math_attention_s("RX 7900 XTX", 512, {"num_heads": 24, "depth": 4, "depth_single_blocks": 24}) == \
        pytest.approx(xtx / 4)


def test_a_run_on_math_attention_is_held_against_its_row_plus_that_traffic(tmp_path):
    run = write_run(tmp_path / "m", sdpa_kernels="math")
    row = next(r for r in TABLE if (r.model, r.card, r.path, r.px, r.compiled)
               == ("flux2", "RX 7900 XTX", "int4_fused", 512, True))
    slower = Prediction(row.card, row.path, row.px, row.compiled, row.rates, row.bound_s,
                        row.rest_s + math_attention_s(row.card, 512), row.model)
    assert report(["AMD Radeon RX 7900 XTX"], [run], TABLE)["runs"][0]["verdict"] == slower.verdict(6.1)
    assert slower.verdict(6.1) != row.verdict(6.1)
