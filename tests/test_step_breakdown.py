"""The step breakdown of `run --profile N`: every GPU kernel of a trace charged to one category.

The module runs inside the trainer, stdlib only, so it is loaded here from the overlay by path
and fed a synthetic Chrome trace shaped like torch.profiler's (cpu_op / kernel events linked by
"External id", the optimizer and the autograd engine as enclosing operators).
"""

import importlib.util
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parent.parent / "overlay" / "toolkit" / "step_breakdown.py"


@pytest.fixture(scope="module")
def step_breakdown():
    spec = importlib.util.spec_from_file_location("step_breakdown", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def op(name, ts, dur, external=None, dims=None, tid=1):
    args = {} if external is None else {"External id": external}
    if dims is not None:
        args["Input Dims"] = dims
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def kernel(name, ts, dur, external, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"External id": external}}


def synthetic_step():
    """One 10 ms step (times in microseconds): forward, backward on the engine's thread, optimizer."""
    return [
        # forward: a block Linear, a LoRA factor, a modulation GEMV, attention, a norm, a Triton requantization
        op("aten::mm", 0, 100, external=1, dims=[[1536, 6144], [6144, 18432]]),
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 10, 2000, 1),
        op("aten::mm", 200, 50, external=2, dims=[[1536, 6144], [6144, 32]]),
        kernel("sm90_xmma_gemm_small", 2010, 100, 2),
        op("aten::addmm", 300, 50, external=3, dims=[[36864], [1, 6144], [6144, 36864]]),
        kernel("gemv2T_kernel", 2110, 90, 3),
        op("aten::_scaled_dot_product_flash_attention", 400, 50, external=4),
        kernel("flash_fwd_kernel", 2200, 800, 4),
        op("aten::native_layer_norm", 500, 20, external=5),
        kernel("vectorized_layer_norm_kernel", 3000, 100, 5),
        op("Int4W4A8Function", 600, 100, external=6),
        kernel("_requantize_kernel", 3100, 300, 6),
        # backward, on the autograd engine's thread
        op("autograd::engine::evaluate_function: MmBackward0", 1000, 500, tid=2),
        op("aten::mm", 1010, 100, external=7, dims=[[1536, 18432], [18432, 6144]], tid=2),
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 3400, 2000, 7),
        # optimizer, enclosing its own elementwise kernels
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW8bit.step", "pid": 1, "tid": 1,
         "ts": 6000, "dur": 400, "args": {"External id": 8}},
        op("aten::add_", 6010, 10, external=9),
        kernel("vectorized_elementwise_kernel", 6000, 200, 9),
        op("aten::copy_", 6100, 10, external=10),
        kernel("Memcpy HtoD (Pinned -> Device)", 6300, 100, 10, cat="gpu_memcpy"),
        {"ph": "X", "cat": "user_annotation", "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
         "pid": 1, "tid": 1, "ts": 7000, "dur": 1500, "args": {}},
    ]


def test_each_kernel_is_charged_to_its_category(step_breakdown):
    result = step_breakdown.breakdown(synthetic_step(), wall_s=0.010, steps=1)
    assert result["category_ms"] == {
        "block GEMMs": 4.09,  # two block Linears (2 + 2 ms) and the batch-1 modulation GEMV
        "requantization": 0.3,
        "attention": 0.8,
        "elementwise": 0.1,
        "LoRA matmuls": 0.1,
        "optimizer": 0.2,
        "copies": 0.1,
    }
    assert result["phase_ms"] == {"forward": 3.39, "backward": 2.0, "optimizer": 0.3}


def test_busy_idle_and_data_wait(step_breakdown):
    result = step_breakdown.breakdown(synthetic_step(), wall_s=0.010, steps=1)
    assert result["gpu_busy_ms"] == 5.69  # the union of the kernel intervals, overlaps counted once
    assert result["gpu_idle_ms"] == 4.31
    assert result["data_wait_ms"] == 1.5
    assert result["step_ms"] == 10.0


def test_figures_are_per_step(step_breakdown):
    two = synthetic_step() + [dict(e, ts=e["ts"] + 10000) for e in synthetic_step()]
    result = step_breakdown.breakdown(two, wall_s=0.020, steps=2)
    assert result == step_breakdown.breakdown(synthetic_step(), wall_s=0.010, steps=1) | {"steps": 2}


def test_the_table_names_every_category(step_breakdown):
    table = step_breakdown.format_table(step_breakdown.breakdown(synthetic_step(), 0.010, 1))
    assert all(name in table for name in step_breakdown.CATEGORIES)
    assert "GPU idle" in table and "data loader" in table


def test_the_summary_line_reads_busy_time_from_the_breakdown(step_breakdown):
    """The printed summary and breakdown.json give one GPU busy time: the kernels' union (the
    profiler's per-operator totals had read 251 % busy for a compiled H100 step)."""
    two = synthetic_step() + [dict(e, ts=e["ts"] + 10000) for e in synthetic_step()]
    result = step_breakdown.breakdown(two, wall_s=0.020, steps=2)
    assert step_breakdown.format_summary(result, gpu=True) == (
        "2 steps in 0.020 s wall (0.010 s/step), GPU busy 0.011 s (57 %), "
        "not busy 0.009 s: host work, syncs and data loading")
    assert step_breakdown.format_summary(result, gpu=False) == "2 steps in 0.020 s wall (0.010 s/step)"
