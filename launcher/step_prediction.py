"""The predicted step of a card against the step a run measured, for the field report and the ETA.

`bench/predict_step.py` predicts the cards' s/it from the H200's measured step, with the card's
bf16 GEMM rate at FLUX.2's block shapes as the one named assumption (a range per card,
`card_specs.gemm_rates`, carried by each row; bench/RESULTS.md "Predicted steps"). Each row keeps the compute-bound
seconds at the card's central rate apart from the rest, so a measured step gives the rate back: the
first owner's s/it either lands inside the range (and says which rate it implies) or misses it by a
stated amount. A card that overlaps streaming with compute may hide its copies: its fast end leaves
them out, its slow end counts them. A run whose GPU has only PyTorch's math attention
(`sdpa_kernels: math`, the self-test's verdict) is held against its row plus that attention's memory
traffic (math_attention_s).

The rows ship with the launcher (TABLE, step_prediction.csv beside this module): written by
`python bench/predict_step.py`, the one model, with its own fuller table for bench/RESULTS.md, from
the measured tables of bench/results and `card_specs`; tests/test_step_prediction.py holds them to
what the model writes now. An install need not have bench/, so nothing here reads it.
"""

import csv
import re
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from flux2_contract import memory_plan
from flux2_contract.families import DEFAULT_ARCH
from launcher.card_specs import SPECS
from launcher.errors import LauncherError
from launcher.runs.folders import RunFolder
from launcher.runs.yaml_files import load_yaml
from launcher.user_files import last_rows

TABLE = Path(__file__).resolve().parent / "step_prediction.csv"
COLUMNS = ("model", "card", "path", "px", "compiled", "rate_slow", "rate_central", "rate_fast", "bound_s", "rest_s",
           "hideable_s")
"""TABLE's columns: a row's key, then its seconds (Prediction's fields); `compiled` is yes or no."""
PATHS_OF_QTYPES = {"int4_fused": "int4_fused", "uint4": "uint4", "int4_w4a8": "int4_w4a8 fp8"}
"""The qtypes the table predicts, by the table's path name (`int4_w4a8` as the FP8 cards run it)."""
MATH_PASSES = 15
"""Passes over one block's attention matrix the math backend makes in a step with checkpointing:
the forward writes the scores, the softmax reads them and writes the probabilities, the product
with V reads those (4), twice (the recompute); the backward writes dP, the softmax's backward reads
P and dP and writes dS (4), the gradients of Q and K read dS and that of V reads P (3): 8 + 7."""


@dataclass(frozen=True)
class Prediction:
    card: str
    path: str
    px: int
    compiled: bool
    rates: tuple[float, float, float]
    """The card's bf16 GEMM rate, TFLOP/s: slow end, central, fast end (card_specs.gemm_rates)."""
    bound_s: float  # GEMMs + attention at the card's central rate
    rest_s: float  # everything else, the streamed copies included
    model: str = DEFAULT_ARCH  # the preset's model arch (flux2_contract/families.py), the table's key
    hideable_s: float = 0.0  # the streamed copies' seconds a card that overlaps them may hide

    def step_at(self, rate: float) -> float:
        """The step at bf16 GEMM rate `rate`, the streamed copies counted in full."""
        return self.bound_s * self.rates[1] / rate + self.rest_s

    @property
    def range_s(self) -> tuple[float, float]:
        """Fast end: the fast rate, the copies hidden where they can be; slow end: the slow rate, counted."""
        slow, _, fast = self.rates
        return self.step_at(fast) - self.hideable_s, self.step_at(slow)

    def implied_rate(self, s_per_it: float) -> float | None:
        """The GEMM rate (TFLOP/s) that makes this row's step equal `s_per_it`, the copies counted;
        None when the rest alone is slower."""
        spare = s_per_it - self.rest_s
        return self.bound_s * self.rates[1] / spare if spare > 0 else None

    def verdict(self, s_per_it: float) -> str:
        low, high = self.range_s
        rate = self.implied_rate(s_per_it)
        implied = f"a bf16 GEMM rate of {rate:.0f} TFLOP/s" if rate else "slower than the GEMMs alone can explain"
        if s_per_it < low:
            where = f"faster than the predicted {low:.1f}-{high:.1f} s/it"
        elif s_per_it <= high:
            where = f"inside the predicted {low:.1f}-{high:.1f} s/it"
        else:
            where = f"{s_per_it / high:.2f}x the slow end of the predicted {low:.1f}-{high:.1f} s/it"
        slow, _, fast = self.rates
        return f"{s_per_it:.2f} s/it: {where} ({implied}; assumed {slow:.1f}-{fast:.1f})"


def load_table(path: Path = TABLE) -> list[Prediction]:
    """The shipped prediction's rows."""
    with path.open(newline="", encoding="utf-8") as handle:
        return [Prediction(row["card"], row["path"], int(row["px"]), row["compiled"] == "yes",
                           (float(row["rate_slow"]), float(row["rate_central"]), float(row["rate_fast"])),
                           float(row["bound_s"]), float(row["rest_s"]), row["model"], float(row["hideable_s"]))
                for row in csv.DictReader(handle)]


def math_attention_s(card: str, px: int, flux2_params: dict | None = None, batch: int = 1) -> float:
    """Seconds the math attention adds to a step of `card` over a fused kernel (the FLOPs are the
    same, already in bound_s): MATH_PASSES passes over every block's fp32 matrix at the card's
    bandwidth. FLUX.2 [dev] on an RX 7900 XTX: 15 x 56 blocks x 48 x 4608^2 x 4 B = 3.4 TB / 960 GB/s
    = 3.6 s at 1024 px; 15 x 56 x 48 x 1536^2 x 4 B = 0.38 TB, 0.40 s at 512 px."""
    shape = memory_plan.Flux2Shape.from_params(flux2_params or {})
    matrix = batch * shape.heads * memory_plan.tokens(px) ** 2 * memory_plan.FP32
    return MATH_PASSES * (shape.depth + shape.depth_single) * matrix / (SPECS[card].bandwidth_gbs * 1e9)


def rows_for_gpu(table: list[Prediction], gpu_name: str) -> list[Prediction]:
    """The rows of the card `gpu_name` names ("AMD Radeon RX 7900 XTX"), matched as whole words."""
    return [row for row in table if re.search(r"(?<!\w)" + re.escape(row.card) + r"(?!\w)", gpu_name, re.IGNORECASE)]


def run_shape(run: RunFolder) -> tuple[str, str, int, bool] | None:
    """(model arch, table path, px, compiled) of a run's rendered config; None where the table has no
    such row."""
    try:
        process = load_yaml(run.config)["config"]["process"][0]
        model = process["model"]
        kwargs = model.get("model_kwargs") or {}
        resolution = process["datasets"][0]["resolution"]
        px = max(resolution) if isinstance(resolution, list) else int(resolution)
    except (LauncherError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    path = PATHS_OF_QTYPES.get(str(model.get("qtype")))
    return (str(model.get("arch", DEFAULT_ARCH)), path, px, kwargs.get("compile_blocks") is True) if path else None


def with_attention(row: Prediction, run: RunFolder) -> Prediction:
    """The row for a run: plus the math attention's seconds where its config says sdpa_kernels: math."""
    try:
        process = load_yaml(run.config)["config"]["process"][0]
        kwargs = process["model"].get("model_kwargs") or {}
        batch = int((process.get("train") or {}).get("batch_size", 1))
    except (LauncherError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return row
    if kwargs.get("sdpa_kernels") != "math":
        return row
    return replace(row, rest_s=row.rest_s + math_attention_s(row.card, row.px, kwargs.get("flux2_params"), batch))


def measured_step(run: RunFolder) -> float | None:
    """The median s/it of the trainer's rows (a run's own timing, load and first step left out)."""
    speeds = [row["s_per_it"] for row in last_rows(run.trainer_telemetry, within=run.root)
              if isinstance(row.get("s_per_it"), (int, float)) and row["s_per_it"] > 0]
    return statistics.median(speeds) if speeds else None


def report(gpu_names: list[str], runs: list[RunFolder], table: list[Prediction] | None = None) -> dict:
    """What the field report carries: the card's predicted ranges, and each recent run against its row."""
    table = load_table() if table is None else table
    rows = [row for name in gpu_names for row in rows_for_gpu(table, name)]
    found = {"assumption": "the card's bf16 GEMM rate at FLUX.2 block shapes, a range (bf16_gemm_tflops: slow "
                           "end, central, fast end); a card that overlaps streaming may hide its copies (fast end)",
             "predicted": [{"model": r.model, "path": r.path, "px": r.px, "compiled": r.compiled,
                            "bf16_gemm_tflops": [round(rate, 1) for rate in r.rates],
                            "s_per_it": [round(s, 2) for s in r.range_s]} for r in rows],
             "runs": []}
    for run in runs:
        shape, step = run_shape(run), measured_step(run)
        match = next((with_attention(r, run) for r in rows if (r.model, r.path, r.px, r.compiled) == shape), None)
        found["runs"].append({"run": run.root.name, "s_per_it": step,
                              "verdict": match.verdict(step) if match and step else None})
    return found
