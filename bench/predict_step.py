#!/usr/bin/env python3
"""A prediction the first run on a card can check: seconds per step per path and preset.

No AMD card and none of the consumer NVIDIA cards has run the project yet. This scales the H200's
measured step breakdown (the uncompiled bf16 step of the same-call runs, results/step_profile.csv,
44 of 56 blocks) to each card part by part, by what bounds each part; the card's figures are the
public ones of `launcher/card_specs.py` (dense tensor rates, bandwidth, memory, PCIe link, each
with its source):
- block GEMMs and attention: compute; scaled by the measured bf16 GEMM rates: the H200's block
  Linears at 512 px (results/block_linear_time.csv, `h200_gemm_tflops`) against the card's rate at FLUX.2's block
  shapes, the named assumption, taken as a range (`card_specs.gemm_rates`). The 7900 XTX's rate
  through hipBLAS: 46.3 TFLOP/s low (the lowest published bf16 2048^2 figure, torch 2.10 + ROCm
  7.10: https://github.com/zzc0721/torch-performance-test-data/issues/103), 77 central (the
  6144x6144 @ 6144x18432 burst of the recipe's write-up:
  github.com/drhawktopus/flux2-32b-qlora-rocm-windows), 99.4 high (the highest published bf16
  4096^2 figure, torch 2.7.1 + ROCm 6.3: https://github.com/zzc0721/torch-performance-test-data/issues/58);
  the other RDNA3 cards by their published FP16 peak relative to the 7900 XTX's. An NVIDIA card
  reaches the share of its dense bf16 peak the H200 reached, at its base clock (slow
  end), midway to its rated boost (central), at its rated boost (fast end): a power-limited card
  holds its base clock, GPU Boost runs above the rated boost where power allows. A measured step
  gives the rate back (`launcher/step_prediction.py`, in the report);
- a path whose GEMMs take 8-bit (or 4-bit) activations: the bf16 GEMM time times the card's bf16
  peak over its peak in that format, times the H200's measured FP8 GEMM time against bf16 over its
  own peak ratio (compiled blocks, 512 px, both calls of results/compiled_step_profile.csv: 0.57 of
  the bf16 time at twice the rate). FP8 where the arch has FP8 units (sm_89 and newer, the
  runtime's rule), so the RTX 3090 (sm_86) gets `int4_fused`, its preset's pick, and the int8
  path (4x its bf16 rate; passes the quality gate only rotated, not built) beside it;
- elementwise chains, LoRA matmuls, the optimizer and copies: memory bandwidth (H200 4.8 TB/s);
- GPU idle time (the host launching kernels): unchanged;
- each 4-bit path adds what it adds on the H200, taken as memory traffic and scaled by bandwidth:
  int4_fused's dequantize (block Linears 1.37x bf16, results/selftest_paths.csv's latest call),
  int4_w4a8's requantization (results/step_profile.csv), uint4's torchao dequantize (2.33x the bf16
  step, results/step.csv);
- compiled blocks: the elementwise part at 0.53x (compiled int4_w4a8 vs uncompiled bf16 at
  1024 px, results/step_profile.csv);
- streamed blocks: the memory plan's streamed bytes at the card's memory less 1.5 GiB for the
  desktop (in flight: one block serialized, two overlapped), copied twice per step (forward;
  recompute + backward) at 79 % of the card's raw PCIe rate (25 GB/s of PCIe 4.0 x16's 31.5). AMD
  cards serialize copy and compute: the copy is never hidden. NVIDIA cards overlap them: the fast
  end of the range takes the copy as hidden, the slow end as serialized.
All figures scale by 56/44 to the full model. Each row keeps its compute-bound seconds at the card's
central rate and the rest apart, so s/it = compute * central / R + rest for any rate R.
FLUX.2 klein 9B (its preset klein9b_amd_512, 512 px) is predicted the same way from its own H200
profiles at full width (all 32 blocks, so no scaling): the bf16 step with the plan off, and the
requantization of its int4_w4a8 step at the 8 GB cap, where every block is recomputed as in a
plan-off step (results/step_profile.csv, the "klein 9B" rows). The recipe reports ~20 s/step at 512 px (9-10 s/it
with its stall watchdog) on uint4.

    python bench/predict_step.py          # writes results/prediction.csv and the launcher's rows; then python bench/report.py
    python bench/predict_step.py --check  # exit 1 where either differs from what the model gives now

The launcher's rows (`launcher/step_prediction.csv`: each row's key and seconds, what `launcher
report` and the page's ETA hold a run against) are a projection of the same rows, so the model runs
here only and the launcher reads no bench/ file.
"""

import argparse
import csv
import io
import sys
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from flux2_contract import memory_plan, qtypes  # noqa: E402 (the repository, put on the path above)
from launcher.card_specs import H200_BANDWIDTH_GBS, H200_BF16_TFLOPS, H200_FP8_TFLOPS, SPECS, gemm_rates  # noqa: E402
from launcher.card_table import read_cards  # noqa: E402
from launcher.runs.presets import load_preset  # noqa: E402
from launcher.selftest.cards import x_bf16  # noqa: E402 (the self-test's block times, as docs/cards.md reads them)
from launcher.step_prediction import COLUMNS, TABLE, Prediction  # noqa: E402
from launcher.writer import differing, replace_own  # noqa: E402

RESULTS = HERE / "results"
FULL = 56 / 44
MODELS = {  # preset arch: (its bf16 profile row, the start of its requantization row, blocks scale, preset)
    "flux2": ("bf16 weights, plan off (same calls)", "`int4_w4a8` FP8 Triton, 256 MiB slices", FULL, None),
    "flux2_klein_9b": ("klein 9B: bf16 weights, plan off", "klein 9B: `int4_w4a8` FP8 `torch._scaled_mm`, 8 GB",
                       1.0, "klein9b_amd_512.yaml"),
}
COPIES_PER_STEP = 2
ELEMENTWISE = "elementwise (norms, modulation, RoPE, activations, casts):"
PATHS = {  # path: (the GEMMs' input format, extra that is memory traffic, what it is)
    "int4_fused": ("bf16", "fused", "the pick without FP8 (Triton dequantize, bf16 GEMM)"),
    "int4_w4a8 fp8": ("fp8", "requant", "the pick with FP8 units (`torch._scaled_mm` or Triton)"),
    "uint4": ("bf16", "uint4", "no Triton: torchao's dequantize"),
    "int4_w4a8 int8 rotated": ("int8", "requant", "int8 GEMMs; passes the gate only rotated (not built)"),
    "W4A4": ("int4", "requant", "int4 GEMMs; fails the quality gate (not built)"),
}
WHAT_IFS = {"RX 7900 XTX": ("uint4", "int4_w4a8 int8 rotated", "W4A4"), "RTX 3090": ("int4_w4a8 int8 rotated",)}
"""Paths beside the card's pick: what the card would train at without Triton or with a path not built."""


def paths(card: str) -> tuple[str, ...]:
    """The card's pick by the runtime's FP8 rule (RDNA3 and Ampere have no FP8 units), then its what-ifs."""
    pick = "int4_w4a8 fp8" if qtypes.arch_has_fp8_units(SPECS[card].arch) else "int4_fused"
    return (pick, *WHAT_IFS.get(card, ()))


def read(name: str) -> list[dict]:
    with (RESULTS / f"{name}.csv").open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


@cache
def h200_gemm_tflops() -> float:
    """What the H200's bf16 block Linears reached at 512 px, TFLOP/s (results/block_linear_time.csv;
    its first TFLOP/s column is 512 px's)."""
    with (RESULTS / "block_linear_time.csv").open(newline="", encoding="utf-8") as handle:
        header, *table = csv.reader(handle)
    row = next(row for row in table if row[0] == "bf16 weights")
    return float(row[header.index("TFLOP/s:")])


def rates(card: str) -> tuple[float, float, float]:
    """The card's bf16 GEMM rate range, TFLOP/s (card_specs.gemm_rates at the H200's measured rate)."""
    return gemm_rates(card, h200_gemm_tflops())


def figure(cell: str) -> float:
    return float(cell.strip("*"))


@cache
def compiled_elementwise() -> float:
    """The elementwise part of a compiled step over an uncompiled one: compiled int4_w4a8 against
    uncompiled bf16 at 1024 px, the same calls (results/step_profile.csv)."""
    rows = [row for row in read("step_profile") if row["px:"] == "1024"]
    compiled = next(row for row in rows if row["run"].endswith("**blocks compiled**"))
    plain = next(row for row in rows if row["run"] == "bf16 weights, plan off, uncompiled (same calls)")
    return figure(compiled[ELEMENTWISE]) / figure(plain[ELEMENTWISE])


def fused_extra() -> float:
    """What int4_fused's dequantize adds to the block Linears, a share of their bf16 time (the
    self-test's latest call, results/selftest_paths.csv)."""
    return x_bf16()["int4_fused"] - 1


@cache
def uint4_step_x() -> float:
    """The uint4 step over the bf16 one, 512 px, uncapped (results/step.csv)."""
    return next(figure(row["x_bf16"]) for row in read("step")
                if (row["weights"], row["cap"], row["shape"]) == ("uint4 (fork)", "none", "512"))


def h200_breakdown(model: str, px: int) -> dict:
    """The uncompiled bf16 step's parts in seconds, full width (the profile row of that model and px)."""
    bf16_run, requant_run, scale, _ = MODELS[model]
    row = next(r for r in read("step_profile") if r["run"] == bf16_run and r["px:"] == str(px))
    part = {key: float(row[column]) / 1000 * scale for key, column in (
        ("gemm", "block GEMMs:"), ("attention", "attention:"),
        ("elementwise", ELEMENTWISE), ("lora", "LoRA matmuls:"),
        ("optimizer", "optimizer:"), ("copies", "copies:"), ("idle", "GPU idle:"))}
    requant = next(r for r in read("step_profile") if r["run"].startswith(requant_run) and r["px:"] == str(px))
    part["requant"] = float(requant["requantization (incl. activation quantization):"]) / 1000 * scale
    return part


def h200_low_precision_x() -> float:
    """The H200's FP8 block GEMMs' time over bf16's, per unit of its FP8-over-bf16 peak: 1.0 where
    an 8-bit GEMM kept the bf16 one's share of its peak (compiled, 512 px, both calls of
    results/compiled_step_profile.csv)."""
    gemms = {row["run (blocks compiled)"]: float(row["block GEMMs:"]) for row in read("compiled_step_profile")}
    fp8 = sum(gemms[f"call {call}: `int4_w4a8` FP8, `torch._scaled_mm`, 256 MiB slices"] for call in (1, 2))
    bf16 = sum(gemms[f"call {call}: bf16 weights"] for call in (1, 2))
    return fp8 / bf16 * H200_FP8_TFLOPS / H200_BF16_TFLOPS


def gemm_factor(card: str, fmt: str) -> float:
    """The block GEMMs' time with `fmt` inputs over their bf16 time on `card`."""
    spec = SPECS[card]
    return 1.0 if fmt == "bf16" else spec.peak("bf16") / spec.peak(fmt) * h200_low_precision_x()


def stream_mode(card: str) -> str:
    """AMD cards copy and compute in turn on every driver (docs/amd.md); NVIDIA cards overlap them."""
    return "serialized" if SPECS[card].hip else "overlapped"


@cache
def dev_preset(card: str) -> str:
    """The card table's FLUX.2 [dev] preset for `card`; a card the table has no row for has none."""
    for row in read_cards():
        if row.name == card and load_preset(row.preset).config["config"]["process"][0]["model"]["arch"] == "flux2":
            return f"{row.preset}.yaml"
    return "none (no row in presets/cards.csv)"


def shape_of(plan, preset: str | None):
    """The transformer shape a preset plans with (its family's, or its own flux2_params; none: FLUX.2 [dev])."""
    if preset is None:
        return plan.Flux2Shape()
    kwargs = load_preset(str(HERE.parent / "presets" / preset)).config["config"]["process"][0]["model"]["model_kwargs"]
    return plan.Flux2Shape.from_params(kwargs["flux2_params"]) if "flux2_params" in kwargs else plan.Flux2Shape()


def streamed_gib(plan, memory_gib: int, px: int, shape, in_flight: int) -> float:
    from launcher.runs.memory_plan import DESKTOP_GIB

    budget = int((memory_gib - DESKTOP_GIB - plan.DEFAULT_MARGIN_GIB) * plan.GIB)
    made = plan.make_plan(plan.flux2_inputs(shape, budget, px, in_flight=in_flight))
    return made.streamed_weight_bytes / plan.GIB


def predict(card: str, path: str, px: int, compiled: bool, plan, model: str = "flux2") -> dict:
    spec = SPECS[card]
    preset = MODELS[model][3] or dev_preset(card)
    slow, central, fast = rates(card)
    compute = h200_gemm_tflops() / central
    memory = H200_BANDWIDTH_GBS / spec.bandwidth_gbs
    h = h200_breakdown(model, px)
    fmt, extra, _ = PATHS[path]
    gemm = h["gemm"] * compute * gemm_factor(card, fmt)
    if extra == "fused":
        overhead = h["gemm"] * fused_extra() * memory
    elif extra == "uint4":
        overhead = sum(h.values()) * (uint4_step_x() - 1) * memory
    else:
        overhead = h["requant"] * memory
    elementwise = h["elementwise"] * memory * (compiled_elementwise() if compiled else 1.0)
    other = (h["lora"] + h["optimizer"] + h["copies"]) * memory + h["idle"]
    mode = stream_mode(card)
    streamed = streamed_gib(plan, spec.memory_gb, px, shape_of(plan, MODELS[model][3]), 2 if mode == "overlapped" else 1)
    stream = streamed * plan.GIB / 1e9 * COPIES_PER_STEP / spec.pcie_gbs
    bound = gemm + h["attention"] * compute
    rest = overhead + elementwise + other + stream
    row = Prediction(card, path, px, compiled, (slow, central, fast), bound, rest, model,
                     stream if mode == "overlapped" else 0.0)
    fast_s, slow_s = row.range_s
    return {"model": model, "card": card, "preset": preset, "path": path, "px:": px, "compiled": "yes" if compiled else "no",
            "stream": mode, "bf16 GEMM TFLOP/s slow / central / fast:": f"{slow:.1f} / {central:.1f} / {fast:.1f}",
            "GEMMs + attention s at central:": f"{bound:.2f}", "4-bit overhead s:": f"{overhead:.2f}",
            "elementwise s:": f"{elementwise:.2f}", "LoRA + optimizer + idle s:": f"{other:.2f}",
            "streamed GiB:": f"{streamed:.1f}", "copies s:": f"{stream:.2f}", "rest s:": f"{rest:.2f}",
            "s/it fast:": f"{fast_s:.1f}", "s/it central:": f"**{row.step_at(central):.1f}**", "s/it slow:": f"{slow_s:.1f}"}


def rows() -> list[dict]:
    """Every predicted row: each card's paths at 512 and 1024 px, compiled and not; klein 9B on AMD."""
    found = []
    for card in SPECS:
        for px in (512, 1024):
            for path in paths(card):
                for compiled in ((False, True) if path != "uint4" else (False,)):
                    found.append(predict(card, path, px, compiled, memory_plan))
    for card in ("RX 7900 XTX", "RX 7800 XT"):  # klein 9B's AMD preset is for 16 to 24 GB cards
        for compiled in (False, True):
            found.append(predict(card, "int4_fused", 512, compiled, memory_plan, "flux2_klein_9b"))
    return found


def launcher_row(row: dict) -> dict:
    """The launcher's columns of a row (step_prediction.COLUMNS), its seconds as the table rounds them."""
    hideable = row["copies s:"] if row["stream"] == "overlapped" else "0.00"
    card_rates = [f"{rate:.3f}" for rate in rates(row["card"])]
    return dict(zip(COLUMNS, (row["model"], row["card"], row["path"], row["px:"], row["compiled"], *card_rates,
                              row["GEMMs + attention s at central:"], row["rest s:"], hideable)))


def csv_text(found: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, list(found[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(found)
    return out.getvalue()


def outputs(found: list[dict]) -> dict[Path, str]:
    """{file: its text}: bench's table (RESULTS.md's) and the launcher's rows, both from `found`."""
    return {RESULTS / "prediction.csv": csv_text([{**row, "date": "2026-12-06", "source": ""} for row in found]),
            TABLE: csv_text([launcher_row(row) for row in found])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a file differs from what the model gives")
    args = parser.parse_args(argv)
    found = rows()
    targets = outputs(found)
    behind = differing(targets)
    for path in behind:
        if args.check:
            print(f"{path} differs from what the model gives now: run python bench/predict_step.py", file=sys.stderr)
        else:
            replace_own(path, targets[path])
            print(f"wrote {path} ({len(found)} rows)")
    return 1 if args.check and behind else 0


if __name__ == "__main__":
    raise SystemExit(main())
