#!/usr/bin/env python3
"""A prediction the first run on an RX 7900 XTX can check: seconds per step per path and preset.

No AMD card has run the project yet. This scales the H200's measured step breakdown (the
uncompiled bf16 step of the same-call runs, results/step_profile.csv, 44 of 56 blocks) to the
RDNA3 cards part by part, by what bounds each part:
- block GEMMs and attention: compute; scaled by the measured bf16 GEMM rates: the H200's block
  Linears at 776 TFLOP/s (results/block_linear_time.csv). The 7900 XTX's rate through hipBLAS at
  FLUX.2's block shapes is the named assumption, taken as a range (RATES): 46.3 TFLOP/s low (the
  lowest published bf16 2048^2 figure, torch 2.10 + ROCm 7.10:
  https://github.com/zzc0721/torch-performance-test-data/issues/103), 77 central (the 6144x6144 @
  6144x18432 burst of the recipe's write-up: github.com/drhawktopus/flux2-32b-qlora-rocm-windows),
  99.4 high (the highest published bf16 4096^2 figure, torch 2.7.1 + ROCm 6.3:
  https://github.com/zzc0721/torch-performance-test-data/issues/58); the other RDNA3 cards by their
  published FP16 peak relative to the 7900 XTX's (AMD product pages). A measured step gives the rate
  back (`launcher/step_prediction.py`, in the report): the first owner's s/it confirms the range or
  says by how much the GEMMs miss it;
- elementwise chains, LoRA matmuls, the optimizer and copies: memory bandwidth (H200 4.8 TB/s;
  7900 XTX 960 GB/s, 7900 XT 800, 7800 XT 624: AMD product pages);
- GPU idle time (the host launching kernels): unchanged;
- each 4-bit path adds what it adds on the H200, taken as memory traffic and scaled by bandwidth:
  int4_fused's dequantize (block Linears 1.37x bf16, results/selftest_paths.csv call 9),
  int4_w4a8's requantization (results/step_profile.csv), uint4's torchao dequantize (2.33x the bf16
  step, results/step.csv); int8 WMMA runs at the bf16 rate on RDNA3, int4 WMMA at twice it;
- compiled blocks: the elementwise part at 0.53x (compiled int4_w4a8 vs uncompiled bf16 at
  1024 px, results/step_profile.csv);
- streamed blocks (serialized: the copy is never hidden): the memory plan's streamed bytes,
  copied twice per step (forward; recompute + backward), at 25 GB/s (PCIe 4.0 x16, 31.5 GB/s
  raw), the plan's budget the card's memory less 1.5 GiB for the desktop.
All figures scale by 56/44 to the full model. Each row keeps its compute-bound seconds at the
central rate and the rest apart, so s/it = compute * 77 / R + rest for any rate R.
FLUX.2 klein 9B (its preset klein9b_amd_512, 512 px) is predicted the same way from its own H200
profiles at full width (all 32 blocks, so no scaling): the bf16 step with the plan off, and the
requantization of its int4_w4a8 step at the 8 GB cap, where every block is recomputed as in a
plan-off step (results/step_profile.csv, the "klein 9B" rows). The recipe reports ~20 s/step at 512 px (9-10 s/it
with its stall watchdog) on uint4.

    python bench/predict_step.py     # writes results/prediction.csv; then python bench/report.py
"""

import csv
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from launcher.step_prediction import BANDWIDTH_GBS, CENTRAL_RATE, RATE_RANGE, Prediction  # noqa: E402 (the repository, put on the path above)

RESULTS = HERE / "results"
FULL = 56 / 44
H200 = {"gemm_tflops": 776.0, "bandwidth_gbs": 4800.0}
RATES = {"low": RATE_RANGE[0], "central": CENTRAL_RATE, "high": RATE_RANGE[1]}  # the 7900 XTX's bf16 GEMM TFLOP/s (docstring)
CARDS = {  # name: (bf16 GEMM rate relative to the 7900 XTX's, bandwidth GB/s, memory GiB, preset)
    "RX 7900 XTX": (1.0, BANDWIDTH_GBS["RX 7900 XTX"], 24, "7900xtx_512.yaml"),
    "RX 7900 XT": (103.0 / 122.8, BANDWIDTH_GBS["RX 7900 XT"], 20, "7900xt_512.yaml"),
    "RX 7800 XT": (74.6 / 122.8, BANDWIDTH_GBS["RX 7800 XT"], 16, "rx16gb_512.yaml"),
}
MODELS = {  # preset arch: (its bf16 profile row, the start of its requantization row, blocks scale, preset)
    "flux2": ("bf16 weights, plan off (same calls)", "`int4_w4a8` FP8 Triton, 256 MiB slices", FULL, None),
    "flux2_klein_9b": ("klein 9B: bf16 weights, plan off", "klein 9B: `int4_w4a8` FP8 `torch._scaled_mm`, 8 GB",
                       1.0, "klein9b_amd_512.yaml"),
}
PCIE_GBS, COPIES_PER_STEP = 25.0, 2
COMPILED_ELEMENTWISE = 469.3 / 881.2
FUSED_EXTRA, UINT4_STEP_X = 0.37, 2.33
PATHS = {  # path: (GEMM time factor at the bf16 rate, extra that is memory traffic, what it is)
    "int4_fused": (1.0, "fused", "the preset's pick (Triton dequantize, bf16 WMMA)"),
    "uint4": (1.0, "uint4", "no Triton: torchao's dequantize"),
    "int4_w4a8 int8 rotated": (1.0, "requant", "int8 WMMA at the bf16 rate; passes the gate only rotated (not built)"),
    "W4A4": (0.5, "requant", "int4 WMMA at twice the rate; fails the quality gate (not built)"),
}


def read(name: str) -> list[dict]:
    with (RESULTS / f"{name}.csv").open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def h200_breakdown(model: str, px: int) -> dict:
    """The uncompiled bf16 step's parts in seconds, full width (the profile row of that model and px)."""
    bf16_run, requant_run, scale, _ = MODELS[model]
    row = next(r for r in read("step_profile") if r["run"] == bf16_run and r["px:"] == str(px))
    part = {key: float(row[column]) / 1000 * scale for key, column in (
        ("gemm", "block GEMMs:"), ("attention", "attention:"),
        ("elementwise", "elementwise (norms, modulation, RoPE, activations, casts):"), ("lora", "LoRA matmuls:"),
        ("optimizer", "optimizer:"), ("copies", "copies:"), ("idle", "GPU idle:"))}
    requant = next(r for r in read("step_profile") if r["run"].startswith(requant_run) and r["px:"] == str(px))
    part["requant"] = float(requant["requantization (incl. activation quantization):"]) / 1000 * scale
    return part


def memory_plan():
    from launcher import trainer_rules

    return trainer_rules.memory_plan()


def shape_of(plan, preset: str | None):
    """The transformer shape a preset plans with (its flux2_params; none: FLUX.2 [dev])."""
    if preset is None:
        return plan.Flux2Shape()
    from launcher.runs.presets import read_preset

    kwargs = read_preset(str(HERE.parent / "presets" / preset)).data["config"]["process"][0]["model"]["model_kwargs"]
    return plan.Flux2Shape.from_params(kwargs["flux2_params"])


def streamed_gib(plan, memory_gib: int, px: int, shape) -> float:
    from launcher.runs.memory_plan import DESKTOP_GIB

    budget = int((memory_gib - DESKTOP_GIB - plan.DEFAULT_MARGIN_GIB) * plan.GIB)
    made = plan.make_plan(plan.flux2_inputs(shape, budget, px, in_flight=1))
    return made.streamed_weight_bytes / plan.GIB


def predict(card: str, path: str, px: int, compiled: bool, plan, model: str = "flux2") -> dict:
    relative_rate, bandwidth, memory_gib, preset = CARDS[card]
    preset = MODELS[model][3] or preset
    compute = H200["gemm_tflops"] / (RATES["central"] * relative_rate)
    memory = H200["bandwidth_gbs"] / bandwidth
    h = h200_breakdown(model, px)
    factor, extra, _ = PATHS[path]
    gemm = h["gemm"] * compute * factor
    if extra == "fused":
        overhead = h["gemm"] * FUSED_EXTRA * memory
    elif extra == "uint4":
        overhead = sum(h.values()) * (UINT4_STEP_X - 1) * memory
    else:
        overhead = h["requant"] * memory
    elementwise = h["elementwise"] * memory * (COMPILED_ELEMENTWISE if compiled else 1.0)
    other = (h["lora"] + h["optimizer"] + h["copies"]) * memory + h["idle"]
    streamed = streamed_gib(plan, memory_gib, px, shape_of(plan, MODELS[model][3]))
    stream = streamed * plan.GIB / 1e9 * COPIES_PER_STEP / PCIE_GBS
    bound = gemm + h["attention"] * compute
    rest = overhead + elementwise + other + stream
    at = {name: Prediction(card, path, px, compiled, bound, rest, model).step_at(rate) for name, rate in RATES.items()}
    return {"model": model, "card": card, "preset": preset, "path": path, "px:": px, "compiled": "yes" if compiled else "no",
            "GEMMs + attention s at 77:": f"{bound:.2f}", "4-bit overhead s:": f"{overhead:.2f}",
            "elementwise s:": f"{elementwise:.2f}", "LoRA + optimizer + idle s:": f"{other:.2f}",
            "streamed GiB:": f"{streamed:.1f}", "copies s:": f"{stream:.2f}", "rest s:": f"{rest:.2f}",
            "s/it at 99.4:": f"{at['high']:.1f}", "s/it at 77:": f"**{at['central']:.1f}**", "s/it at 46.3:": f"{at['low']:.1f}"}


def main() -> int:
    plan = memory_plan()
    rows = []
    for card in CARDS:
        for px in (512, 1024):
            for path in PATHS if card == "RX 7900 XTX" else ("int4_fused",):
                for compiled in ((False, True) if path != "uint4" else (False,)):
                    rows.append(predict(card, path, px, compiled, plan))
    for card in ("RX 7900 XTX", "RX 7800 XT"):  # klein 9B's AMD preset is for 16 to 24 GB cards
        for compiled in (False, True):
            rows.append(predict(card, "int4_fused", 512, compiled, plan, "flux2_klein_9b"))
    with (RESULTS / "prediction.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, [*rows[0], "date", "source"], lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "date": "2026-12-04", "source": ""})
    print(f"wrote {RESULTS / 'prediction.csv'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
