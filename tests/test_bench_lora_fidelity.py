"""bench/lora_fidelity.py: the comparison of two trained LoRAs and the tables made of it.

The bookkeeping (which file is the final LoRA, the loss curves, the summary, the tables) runs
here; the factor arithmetic needs torch, so it runs under the trainer's interpreter, on LoRAs the
trainer saved."""

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from bench import lora_fidelity
from launcher.envs.workdir import venv_python

REPO = Path(__file__).resolve().parents[1]


def write_run(run: Path, losses: list[float]) -> None:
    """A run folder as bench/fullsize.py leaves it: a step-numbered save beside the final one."""
    folder = run / "flux2_512" / "flux2_512"
    folder.mkdir(parents=True)
    (folder / "flux2_512.safetensors").write_bytes(b"final")
    (folder / "flux2_512_000000010.safetensors").write_bytes(b"a step save")
    rows = [{"event": "start", "step": 0, "loss": None}] + [{"step": step, "loss": loss} for step, loss in enumerate(losses, 1)]
    (run / "flux2_512" / "trainer-telemetry.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def test_the_final_lora_is_picked_and_a_step_save_left_out(tmp_path):
    write_run(tmp_path / "run", [1.0])
    assert lora_fidelity.final_lora(tmp_path / "run").name == "flux2_512.safetensors"  # "_512" is no step number
    (tmp_path / "run" / "flux2_512" / "flux2_512" / "flux2_512.safetensors").unlink()
    with pytest.raises(SystemExit, match="found 0"):
        lora_fidelity.final_lora(tmp_path / "run")


def test_loss_figures_over_the_common_steps(tmp_path):
    write_run(tmp_path / "a", [1.0, 0.9, 0.8])
    write_run(tmp_path / "b", [1.1, 0.9])
    a, b = lora_fidelity.loss_curve(tmp_path / "a"), lora_fidelity.loss_curve(tmp_path / "b")
    assert a == {1: 1.0, 2: 0.9, 3: 0.8}  # the event row is no step
    figures = lora_fidelity.loss_figures(a, b)
    assert figures["steps"] == 2 and figures["first_step_loss"] == [1.0, 1.1]
    assert figures["mean_abs_difference"] == pytest.approx(0.05)
    assert "first_step_loss" not in lora_fidelity.loss_figures(a, {2: 0.9})  # no row for step 1: not claimed


def test_summary_by_block_class():
    modules = {"m.double_blocks.0.qkv": {"cosine": 1.0, "norm_ratio": 2.0},
               "m.single_blocks.0.linear1": {"cosine": 0.5, "norm_ratio": 1.0},
               "m.single_blocks.1.linear1": {"cosine": 0.7, "norm_ratio": 1.0}}
    stats = lora_fidelity.summary(modules)
    assert stats["modules"] == 3 and stats["cosine_min"] == 0.5 and stats["cosine_median"] == 0.7
    assert stats["share_at_least_good"] == pytest.approx(1 / 3)
    assert stats["median_by_class"] == {"double_blocks": 1.0, "single_blocks": pytest.approx(0.6)}


def test_write_makes_both_tables_and_skips_a_loss_table_with_gaps(tmp_path, monkeypatch):
    pair = {"reference": "bf16", "other": "w4", **lora_fidelity.summary({"m": {"cosine": 0.8, "norm_ratio": 1.0}}),
            "loss": {"steps": 2, "first_step_loss": [1.0, 1.1], "mean_loss": [0.9, 1.0], "mean_abs_difference": 0.05}}
    data = {"pairs": [pair], "losses": {"bf16": {"1": 1.0, "2": 0.8}, "w4": {"1": 1.1, "2": 0.7}}}
    source = tmp_path / "fidelity.json"
    source.write_text(json.dumps(data))
    monkeypatch.setattr(lora_fidelity, "HERE", tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "archive").mkdir()
    assert lora_fidelity.main(["write", str(source), "--date", "2026-01-01"]) == 0
    rows = (tmp_path / "results" / "lora_fidelity.csv").read_text().splitlines()
    assert rows[1].startswith("bf16,w4,2,1,0.800,") and rows[1].endswith(",2026-01-01,archive/lora_fidelity_2026-01-01.json")
    loss = (tmp_path / "results" / "lora_fidelity_loss.csv").read_text().splitlines()
    assert loss[0].startswith("step:,bf16:,w4:") and loss[2].startswith("2,0.8000,0.7000,")
    data["losses"]["w4"].pop("2")
    source.write_text(json.dumps(data))
    assert lora_fidelity.main(["write", str(source), "--date", "2026-01-02", "--name", "gaps"]) == 0
    assert (tmp_path / "results" / "gaps.csv").is_file() and not (tmp_path / "results" / "gaps_loss.csv").exists()


FACTOR_CHECKS = textwrap.dedent("""
    import json, sys, torch
    from bench import lora_fidelity as lf
    g = torch.Generator().manual_seed(0)
    b1, a1, b2, a2 = (torch.randn(shape, generator=g) for shape in ((48, 4), (4, 40), (48, 4), (4, 40)))
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=g))
    same = lf.compare_modules({"m": (b1, a1)}, {"m": (b1 @ q, q.T @ a1)})["m"]
    other = lf.compare_modules({"m": (b1, a1)}, {"m": (-2 * b1, a1)})["m"]
    try:
        lf.compare_modules({"m": (b1, a1)}, {"n": (b1, a1)})
        refused = None
    except SystemExit as stop:
        refused = str(stop)
    saved = lf.lora_factors(lf.final_lora(__import__("pathlib").Path(sys.argv[1])))
    itself = lf.summary(lf.compare_modules(saved, saved))
    print(json.dumps({"inner": lf.delta_inner((b1, a1), (b2, a2)), "formed": float(((b1 @ a1) * (b2 @ a2)).sum()),
                      "rotated": same, "negated": other, "refused": refused, "saved_modules": len(saved),
                      "itself": itself["cosine_min"]}))
""")


@pytest.mark.trainer
def test_the_comparison_from_factors_under_the_trainers_torch(trained_tiny_run):
    """<B1 A1, B2 A2> from the rank-r factors equals the formed deltas' inner product; a rotated
    factor pair is the same delta; a trained LoRA's modules are all read and match themselves."""
    run, workdir = trained_tiny_run
    result = subprocess.run([str(venv_python(workdir.venv)), "-c", FACTOR_CHECKS, str(run.root.parent)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["inner"] == pytest.approx(figures["formed"], rel=1e-4)
    assert figures["rotated"]["cosine"] == pytest.approx(1.0, abs=1e-4)
    assert figures["negated"]["cosine"] == pytest.approx(-1.0, abs=1e-5) and figures["negated"]["norm_ratio"] == pytest.approx(2.0)
    assert "different modules" in figures["refused"]
    assert figures["saved_modules"] >= 1 and figures["itself"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.trainer
def test_a_variant_transformer_has_the_shape_and_gain_asked_for(trainer_workdir, tmp_path):
    """`lora_fidelity checkpoint`: more single blocks than the tiny model, matrices at the gain."""
    from launcher.in_trainer.tiny_assets import FLUX2_PARAMS

    params = {**FLUX2_PARAMS, "depth_single_blocks": 3}
    out = tmp_path / "flux2-dev.safetensors"
    python = str(venv_python(trainer_workdir.venv))
    made = subprocess.run([python, "-m", "bench.lora_fidelity", "checkpoint", "--trainer", str(trainer_workdir.trainer),
                           "--params", json.dumps(params), "--gain", "1.57", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    read = ("import json, sys; from safetensors.torch import load_file; t = load_file(sys.argv[1]); "
            "print(json.dumps({'singles': len({k.split('.')[1] for k in t if k.startswith('single_blocks.')}), "
            "'gain': float(t['single_blocks.2.linear1.weight'].float().std() * t['single_blocks.2.linear1.weight'].shape[1] ** 0.5)}))")
    figures = json.loads(subprocess.run([python, "-c", read, str(out)], capture_output=True, text=True, timeout=300).stdout)
    assert figures["singles"] == 3
    assert figures["gain"] == pytest.approx(1.57, rel=0.05)
