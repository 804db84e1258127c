#!/usr/bin/env python3
"""How close a LoRA trained on a 4-bit base comes to the one the bf16 base trains.

Two launches of `bench/same_call.sh fidelity` share the preset, the seed and the data and differ in
the base weights only. For each LoRA module the two trained deltas dW = B @ A are compared by their
cosine similarity and the ratio of their norms (alpha / rank scales both alike and cancels), and
the two loss curves step by step. A delta is never formed: with r the LoRA rank,
<B1 A1, B2 A2> = sum((B1^T B2) * (A1 A2^T)), two r x r products per module.

A pair of launches that differ in the seed alone (same base) is the yardstick: it says how far
apart two LoRAs are that nobody would call different in quality.

    python3 -m bench.lora_fidelity compare RUNS REF:OTHER [REF:OTHER ...] --out OUT/lora_fidelity.json
    python3 -m bench.lora_fidelity write OUT/lora_fidelity.json --date YYYY-MM-DD [--name lora_fidelity]
    python -m bench.lora_fidelity tiny --workdir W --out OUT [--single-blocks N --gain G --only bf16 int4_fused]

`tiny` runs the same comparison on the embedded tiny FLUX.2 on the CPU (presets/tiny.yaml, 50
steps), over a grid of base precisions, from 2-bit to 8-bit: it says how the cosine follows the
error of the base weights, which one full-width 4-bit run cannot; with --single-blocks and --gain
on a deeper tiny model whose random matrices have the full-size random weights' gain.

`compare` runs where the runs are (RUNS/<label>/, bench/fullsize.py's run folders; it needs torch
and safetensors); `write` turns its JSON into results/lora_fidelity.csv (one row per pair) and
results/lora_fidelity_loss.csv (the loss curves at LOSS_TABLE_STEPS), with the JSON itself under archive/.
"""

import argparse
import csv
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOOD_COSINE = 0.9
"""The per-module cosine a 4-bit LoRA should reach against the bf16 one after 50 steps."""


def final_lora(run: Path) -> Path:
    """The LoRA a launch saved when it finished: `<name>.safetensors`, not a step-numbered save."""
    step_save = lambda stem: len(stem.rsplit("_", 1)[-1]) == 9 and stem[-9:].isdigit()  # noqa: E731 (NAME_000000250)
    found = [path for path in run.glob("*/*/*.safetensors") if not step_save(path.stem)]
    if len(found) != 1:
        raise SystemExit(f"{run}: expected one final LoRA file (*/*/NAME.safetensors), found {len(found)}")
    return found[0]


def loss_curve(run: Path) -> dict[int, float]:
    """Step -> loss from the trainer's telemetry (a row per step where a step outlasts the
    `telemetry: {interval_s: 0.1}` the fidelity launches set)."""
    curve = {}
    for path in run.glob("*/trainer-telemetry.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("step") is not None and row.get("loss") is not None and not row.get("event"):
                curve[row["step"]] = row["loss"]
    return curve


def lora_factors(path: Path) -> dict[str, tuple]:
    """Module name -> (B, A) in float32."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    modules = {}
    for key, tensor in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            modules[module] = (tensors[f"{module}.lora_B.weight"].float(), tensor.float())
    return modules


def delta_inner(first: tuple, second: tuple) -> float:
    """<B1 A1, B2 A2> (Frobenius) from the factors alone."""
    (b1, a1), (b2, a2) = first, second
    return float(((b1.T @ b2) * (a1 @ a2.T)).sum())


def compare_modules(reference: dict, other: dict) -> dict[str, dict]:
    """Per module: the cosine of the two deltas and the other's norm over the reference's."""
    if set(reference) != set(other):
        missing = sorted(set(reference) ^ set(other))[:3]
        raise SystemExit(f"the two LoRAs train different modules (e.g. {missing}): compare launches of one preset")
    result = {}
    for module, factors in reference.items():
        norm_ref = delta_inner(factors, factors) ** 0.5
        norm_other = delta_inner(other[module], other[module]) ** 0.5
        cosine = delta_inner(factors, other[module]) / (norm_ref * norm_other) if norm_ref and norm_other else float("nan")
        result[module] = {"cosine": cosine, "norm_ratio": norm_other / norm_ref if norm_ref else float("nan")}
    return result


def block_class(module: str) -> str:
    """double_blocks / single_blocks / the rest, from a module's name."""
    for name in ("double_blocks", "single_blocks"):
        if f".{name}." in f".{module}":
            return name
    return "other"


def summary(modules: dict[str, dict]) -> dict:
    cosines = sorted(item["cosine"] for item in modules.values())
    ratios = sorted(item["norm_ratio"] for item in modules.values())
    by_class = {}
    for module, item in modules.items():
        by_class.setdefault(block_class(module), []).append(item["cosine"])
    return {"modules": len(cosines), "cosine_min": cosines[0], "cosine_p10": cosines[len(cosines) // 10],
            "cosine_median": statistics.median(cosines), "cosine_mean": statistics.fmean(cosines),
            "share_at_least_good": sum(c >= GOOD_COSINE for c in cosines) / len(cosines),
            "norm_ratio_median": statistics.median(ratios),
            "median_by_class": {name: statistics.median(values) for name, values in sorted(by_class.items())}}


def loss_figures(reference: dict[int, float], other: dict[int, float]) -> dict:
    """The losses over the steps both curves have, and the first step's (the base alone: B is
    zero) where both have a row for it (a row per step needs steps longer than the interval)."""
    steps = sorted(set(reference) & set(other))
    if not steps:
        return {"steps": 0}
    mean = lambda curve: statistics.fmean(curve[s] for s in steps)  # noqa: E731
    first = {"first_step_loss": [reference[steps[0]], other[steps[0]]]} if steps[0] == min(reference) == min(other) else {}
    return {"steps": len(steps), **first, "mean_loss": [mean(reference), mean(other)],
            "mean_abs_difference": statistics.fmean(abs(reference[s] - other[s]) for s in steps)}


def compare(args) -> int:
    runs, loras, curves = args.runs, {}, {}
    pairs = [tuple(pair.split(":", 1)) for pair in args.pairs]
    for label in {label for pair in pairs for label in pair}:
        if not (runs / label).is_dir():
            print(f"{runs / label}: no such run, its pairs are left out")
            continue
        loras[label] = lora_factors(final_lora(runs / label))
        curves[label] = loss_curve(runs / label)
    result = {"pairs": [], "losses": curves}
    for reference, other in pairs:
        if reference in loras and other in loras:
            modules = compare_modules(loras[reference], loras[other])
            item = {"reference": reference, "other": other, **summary(modules),
                    "loss": loss_figures(curves[reference], curves[other]), "per_module": modules}
            result["pairs"].append(item)
            print(f"{reference} vs {other}: cosine median {item['cosine_median']:.3f}, min {item['cosine_min']:.3f}, "
                  f"{item['share_at_least_good']:.0%} of {item['modules']} modules >= {GOOD_COSINE}")
    args.out.write_text(json.dumps(result) + "\n", encoding="utf-8")
    return 0


LOSS_TABLE_STEPS = (1, 2, 3, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50)
"""The steps of the loss table; every step of every curve stays in the archived JSON."""
TINY_GRID = {  # label: (qtype or None for the bf16 base, training seed)
    "bf16": (None, 42), "bf16_rerun": (None, 42), "bf16_seed43": (None, 43), "float8": ("float8", 42), "qint8": ("qint8", 42),
    "uint6": ("uint6", 42), "int4_fused": ("int4_fused", 42), "uint4": ("uint4", 42), "uint3": ("uint3", 42),
    "uint2": ("uint2", 42)}


def tiny(args) -> int:
    """The tiny grid through `python -m launcher run`, each launch against the bf16 one. With
    --single-blocks or --gain the transformer is a variant of the tiny one (more single blocks,
    matrices drawn at the given gain) in OUT/model_s<N>_g<G>, run as a model folder, and the labels
    end in the same _s<N>_g<G>."""
    import shutil
    import subprocess
    import sys

    import yaml

    from launcher.envs.workdir import Workdir, venv_python
    from launcher.runs import tiny as tiny_model
    from launcher.runs.presets import read_preset

    workdir = Workdir(args.workdir.resolve())
    trainer_python = venv_python(workdir.venv)  # torch and safetensors are there
    manifest = tiny_model.ensure_assets(workdir.assets / "tiny", workdir.trainer, trainer_python)
    variant = args.single_blocks is not None or args.gain is not None
    suffix = f"_s{args.single_blocks or 1}_g{args.gain or 0:g}" if variant else ""
    kwargs = dict(manifest["model_kwargs"])
    places = []
    if variant:
        kwargs["flux2_params"] = {**kwargs["flux2_params"], "depth_single_blocks": args.single_blocks or 1}
        model_dir = args.out / f"model{suffix}"
        if not (model_dir / "ae.safetensors").is_file():
            model_dir.mkdir(parents=True, exist_ok=True)
            subprocess.run([str(trainer_python), "-m", "bench.lora_fidelity", "checkpoint", "--trainer", str(workdir.trainer),
                            "--params", json.dumps(kwargs["flux2_params"]), "--gain", str(args.gain or 0),
                            "--out", str(model_dir / "flux2-dev.safetensors")], check=True, cwd=HERE.parent)
            shutil.copyfile(Path(manifest["name_or_path"]) / "ae.safetensors", model_dir / "ae.safetensors")
        places = ["--model-dir", str(model_dir), "--text-encoder", kwargs.pop("text_encoder_path"),
                  "--dataset", manifest["dataset"]]
    runs = args.out / "runs"
    grid = {label: TINY_GRID[label] for label in (args.only or TINY_GRID)}
    for label, (qtype, seed) in grid.items():
        if list((runs / f"{label}{suffix}").glob("*/*/*.safetensors")):
            print(f"=== {label}{suffix}: trained in an earlier call", flush=True)
            continue
        preset = read_preset(str(HERE.parent / "presets" / "tiny.yaml")).data
        process = preset["config"]["process"][0]
        process["training_seed"] = seed
        process["train"]["steps"] = args.steps
        model = process["model"]
        model["quantize"] = qtype is not None
        model["qtype"] = qtype or model["qtype"]
        preset["launcher"]["telemetry"] = {"interval_s": 0.1}
        if variant:
            preset["launcher"]["tiny"] = False
            model["model_kwargs"] = kwargs
        path = args.out / "presets" / f"{label}{suffix}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(preset, sort_keys=False), encoding="utf-8")
        print(f"=== {label}{suffix}", flush=True)
        subprocess.run([sys.executable, "-m", "launcher", "run", str(path), "--workdir", str(args.workdir),
                        "--output", str(runs / f"{label}{suffix}"), *places], check=True, cwd=HERE.parent)
    pairs = [f"bf16{suffix}:{label}{suffix}" for label in grid if label != "bf16"]
    return subprocess.run([str(trainer_python), "-m", "bench.lora_fidelity", "compare", str(runs), *pairs,
                           "--out", str(args.out / f"lora_fidelity_tiny{suffix}.json")], cwd=HERE.parent).returncode


def checkpoint(args) -> int:
    """A FLUX.2 transformer file of the given shape (the fork's class, seed 0); with a gain, its
    matrices drawn from N(0, gain^2 / fan_in), the gain each full-size random Linear has
    (0.02 * sqrt(6144) = 1.57 for bench/fullsize.py's N(0, 0.02) at width 6144)."""
    import math
    import sys

    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(args.trainer))
    from extensions_built_in.diffusion_models.flux2.src.model import Flux2, Flux2Params

    torch.manual_seed(0)
    state = Flux2(Flux2Params(**json.loads(args.params))).state_dict()
    generator = torch.Generator().manual_seed(0)
    for name, tensor in state.items():
        if args.gain and tensor.dim() >= 2:
            state[name] = torch.randn(tensor.shape, generator=generator) * (args.gain / math.sqrt(tensor.shape[1]))
    save_file({name: tensor.to(torch.bfloat16).contiguous() for name, tensor in state.items()}, str(args.out))
    return 0


PAIR_COLUMNS = ["reference", "other", "steps:", "modules:", "cosine min:", "p10:", "median:", "mean:",
                f">= {GOOD_COSINE}:", "double median:", "single median:", "norm ratio median:",
                "first-step loss:", "mean loss:", "mean abs loss difference:"]


def pair_row(item: dict) -> list[str]:
    loss = item["loss"]
    classes = item["median_by_class"]
    pair = lambda values: " / ".join(f"{value:.4f}" for value in values)  # noqa: E731
    return [item["reference"], item["other"], str(loss["steps"]), str(item["modules"]),
            *(f"{item[key]:.3f}" for key in ("cosine_min", "cosine_p10", "cosine_median", "cosine_mean")),
            f"{item['share_at_least_good']:.0%}", f"{classes.get('double_blocks', float('nan')):.3f}",
            f"{classes.get('single_blocks', float('nan')):.3f}", f"{item['norm_ratio_median']:.3f}",
            pair(loss.get("first_step_loss", [])), pair(loss.get("mean_loss", [])),
            f"{loss['mean_abs_difference']:.4f}" if "mean_abs_difference" in loss else ""]


def write(args) -> int:
    data = {"pairs": [], "losses": {}}
    for path in args.json:  # several compare results make one table
        part = json.loads(path.read_text(encoding="utf-8"))
        data["pairs"] += part["pairs"]
        data["losses"].update(part["losses"])
    archive = f"archive/{args.name}_{args.date}.json"
    (HERE / archive).write_text(json.dumps(data) + "\n", encoding="utf-8")
    with (HERE / "results" / f"{args.name}.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(PAIR_COLUMNS + ["date", "source"])
        for item in data["pairs"]:
            cells = pair_row(item)
            writer.writerow(cells + [args.date, archive])
            print(" | ".join(cells))
    labels = sorted(data["losses"])
    steps = sorted({int(step) for curve in data["losses"].values() for step in curve} & set(LOSS_TABLE_STEPS))
    if not all(str(step) in curve for curve in data["losses"].values() for step in steps):
        print("no loss table: not every curve has a row at each of its steps (steps shorter than the telemetry interval)")
        return 0
    with (HERE / "results" / f"{args.name}_loss.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step:", *(f"{label}:" for label in labels), "date", "source"])
        for step in steps:
            writer.writerow([step, *(f"{data['losses'][label][str(step)]:.4f}" for label in labels), args.date, archive])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("compare", help="compare the LoRAs and loss curves of finished launches")
    run.add_argument("runs", type=Path, help="the folder of the launches' run folders (R/runs)")
    run.add_argument("pairs", nargs="+", metavar="REF:OTHER", help="two launch labels: the reference and the one compared")
    run.add_argument("--out", type=Path, required=True, help="the JSON to write")
    table = commands.add_parser("write", help="the results tables from compare's JSON")
    table.add_argument("json", type=Path, nargs="+", help="compare's JSON; several make one table")
    table.add_argument("--date", required=True, help="the measurement's date (YYYY-MM-DD)")
    table.add_argument("--name", default="lora_fidelity", help="the results' name: results/NAME.csv, results/NAME_loss.csv")
    grid = commands.add_parser("tiny", help="the grid of base precisions on the tiny FLUX.2, on the CPU")
    grid.add_argument("--workdir", type=Path, required=True, help="a workdir that `python -m launcher setup` made")
    grid.add_argument("--out", type=Path, required=True, help="a folder for the runs and lora_fidelity_tiny.json")
    grid.add_argument("--steps", type=int, default=50)
    grid.add_argument("--only", nargs="+", choices=list(TINY_GRID), help="these launches of the grid (bf16 among them)")
    grid.add_argument("--single-blocks", type=int, help="a transformer with this many single blocks (the tiny one has 1)")
    grid.add_argument("--gain", type=float, help="matrices drawn at this gain (1.57: bench/fullsize.py's random weights)")
    made = commands.add_parser("checkpoint", help="(under the trainer's python) a transformer file for `tiny`")
    made.add_argument("--trainer", type=Path, required=True)
    made.add_argument("--params", required=True, help="Flux2Params as JSON")
    made.add_argument("--gain", type=float, default=0)
    made.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return {"compare": compare, "write": write, "tiny": tiny, "checkpoint": checkpoint}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
