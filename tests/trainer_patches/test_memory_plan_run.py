"""`python -m launcher run` of the tiny FLUX.2 under a memory plan, on the CPU: a budget that
keeps every block resident, then one so small both blocks are streamed from host memory. The streamed run's loss matches the resident
run's step for step; the plan lands in run.json and the telemetry rows carry the bytes streamed. The
trainer carries out the plan `run` hands it (model_kwargs launch_plan) before the load: on the CPU it
finds the budget and run shape `run` planned for."""

import json
import re

import pytest
import yaml
from conftest import launch_env, launcher_python
from tiny_run import RUN_NAME, run_tiny, tiny_preset


pytestmark = pytest.mark.patch("memory-plan")
STEPS = 3
GIB = 1024 ** 3
LOSS = re.compile(r"loss: ([0-9.eE+-]+)\]")


def losses(log) -> list[float]:
    values = [float(v) for v in LOSS.findall(log.read_text(errors="replace"))]
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def run(workdir, tmp, budget_gib):
    # a budget below the smallest vram_budget_gib the settings take: that cap, less a margin
    cap = max(budget_gib, 0.25)
    kwargs = {"memory_plan": "auto", "stream_mode": "serialized", "vram_budget_gib": cap,
              "vram_margin_gib": cap - budget_gib}
    path = tiny_preset(tmp / "tiny.yaml", steps=STEPS, model={"qtype": "int4_fused", "model_kwargs": kwargs},
                       launcher={"telemetry": {"interval_s": 0.1}})
    result = run_tiny(workdir, path, tmp / "out", python=launcher_python(), env=launch_env(tmp / "caches"))
    assert result.returncode == 0, result.stdout[-8000:]
    folder = tmp / "out" / RUN_NAME
    kwargs = yaml.safe_load((folder / "config.yaml").read_text())["config"]["process"][0]["model"]["model_kwargs"]
    assert kwargs["launch_plan"].startswith('{"ask":')
    assert "`run` planned for" not in (folder / "train.log").read_text(errors="replace")
    metadata = json.loads((folder / RUN_NAME / "run.json").read_text())
    rows = [json.loads(line) for line in (folder / "trainer-telemetry.jsonl").read_text().splitlines()]
    return folder, metadata["memory_plan"], rows


def test_streamed_run_matches_the_resident_run(trainer_checkout, tmp_path):
    workdir = trainer_checkout.parent
    resident, plan, _ = run(workdir, tmp_path / "resident", 1.0)
    assert [b["weights"] for b in plan["blocks"]] == ["resident", "resident"]
    assert [b["activations"] for b in plan["blocks"]] == ["kept", "kept"]

    double, single = (b["weight_bytes"] for b in plan["blocks"])
    assert double > single
    # the fixed part and one block in flight (serialized), short of both blocks resident: with two
    # blocks, a plan that streams streams both
    budget = sum(plan["fixed_bytes"].values()) + double + 0.5 * single
    streamed, plan, rows = run(workdir, tmp_path / "streamed", budget / GIB)
    assert [(b["weights"], b["activations"]) for b in plan["blocks"]] == [("streamed", "recomputed")] * 2
    log = (streamed / "train.log").read_text(errors="replace")
    assert "0 of 2 blocks resident" in log and "stream mode: serialized" in log

    want, got = losses(resident / "train.log"), losses(streamed / "train.log")
    assert len(want) >= STEPS - 1 and got == want
    per_step = [row["streamed_bytes_step"] for row in rows if row.get("streamed_bytes_step")]
    # the last block forward is held into its recompute, and the first block recomputed into the
    # next step's forward: the first step copies the double block twice, later steps each block once
    assert per_step and set(per_step) <= {2 * double + single, double + single}
    assert per_step[-1] == double + single
