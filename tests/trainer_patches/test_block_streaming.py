"""Streamed blocks (toolkit/block_streaming.py) on the CPU, where the "device" copy is a separate
tensor copy so the mechanics run: the order of copies and computations over a step (forward, then
recompute + backward in reverse), the same outputs and gradients as the resident blocks, and
tensors that stay in host memory whatever the trainer moves."""

import copy

import pytest
import torch

from launcher.in_trainer.selftest.streaming import block_stack
from launcher.in_trainer.selftest.streaming import one_step as step

pytestmark = pytest.mark.patch("memory-plan")
WIDTH = 64


@pytest.fixture(scope="module")
def toolkit(trainer_on_path):
    from toolkit import block_streaming, int4_linear
    from flux2_contract import memory_plan

    return block_streaming, int4_linear, memory_plan


def Stack(int4_linear, depth=4):
    """The self-test's block stack: the FLUX.2 forward's loop over frozen 4-bit blocks."""
    return block_stack(torch, int4_linear, WIDTH, depth)


def plan_of(memory_plan, layout):
    """layout: one (weights, activations) per block."""
    blocks = [memory_plan.BlockPlan(f"blocks.{i}", w, a) for i, (w, a) in enumerate(layout)]
    return memory_plan.MemoryPlan(budget_bytes=0, blocks=blocks)


@pytest.mark.parametrize("mode", ["serialized", "overlapped"])
def test_stream_order_outputs_and_gradients(toolkit, mode):
    block_streaming, int4_linear, memory_plan = toolkit
    torch.manual_seed(0)
    resident = Stack(int4_linear).to(torch.bfloat16)
    streamed = copy.deepcopy(resident)
    keys = list(streamed.state_dict())
    R, S, K, C = memory_plan.RESIDENT, memory_plan.STREAMED, memory_plan.KEPT, memory_plan.RECOMPUTED
    plan = plan_of(memory_plan, [(R, K), (S, C), (R, C), (S, C)])
    streamer = block_streaming.BlockStreamer(streamed, plan, "cpu", mode, record=True)
    x = torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)

    for _ in range(2):
        streamer.stats.events.clear()
        want, want_grad = step(resident, x)
        got, got_grad = step(streamed, x)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    # the second step: block 1 is still held from the first step's last backward
    if mode == "serialized":
        expected = [("forward", "blocks.1"), ("fetch", "blocks.3"), ("forward", "blocks.3"),
                    ("recompute", "blocks.3"), ("backward", "blocks.3"),
                    ("fetch", "blocks.1"), ("recompute", "blocks.1"), ("backward", "blocks.1")]
    else:  # the next block's copy starts before the current one computes
        expected = [("forward", "blocks.1"), ("fetch", "blocks.3"), ("forward", "blocks.3"),
                    ("recompute", "blocks.3"), ("fetch", "blocks.1"), ("backward", "blocks.3"),
                    ("recompute", "blocks.1"), ("backward", "blocks.1")]
    assert streamer.stats.events == expected
    one_block = sum(t.numel() * t.element_size() for t in resident.blocks[1].state_dict().values())
    assert streamer.stats.bytes_this_step == 2 * one_block  # block 3 once, block 1 once
    assert list(streamed.state_dict()) == keys  # the same names: the LoRA keys do not change
    assert streamed.blocks[0].checkpointed is False and streamed.blocks[2].checkpointed is True


@pytest.mark.parametrize("mode", ["serialized", "overlapped"])
def test_int4_w4a8_scales_are_derived_once_per_weight_not_once_per_copy(toolkit, mode, scale_derivations):
    """A streamed block's weight arrives as a new tensor at every turn; the 8-bit scales derived
    from it (a pass over the whole weight) travel with it instead of being derived again."""

    block_streaming, int4_linear, memory_plan = toolkit
    torch.manual_seed(0)
    model = Stack(int4_linear).to(torch.bfloat16)
    int4_linear.configure_linears(model, "int4_w4a8", {"w4a8_activations": "fp8"}, "cpu")
    R, S, C = memory_plan.RESIDENT, memory_plan.STREAMED, memory_plan.RECOMPUTED
    block_streaming.BlockStreamer(model, plan_of(memory_plan, [(R, C), (S, C), (R, C), (S, C)]), "cpu", mode)
    x = torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)
    for _ in range(3):
        step(model, x)
    assert len(scale_derivations) == 4  # one per Linear, streamed or resident, over three steps


def test_streamed_tensors_stay_on_the_host_when_the_model_moves(toolkit):
    block_streaming, int4_linear, memory_plan = toolkit
    model = Stack(int4_linear, depth=2).to(torch.bfloat16)
    R, S, C = memory_plan.RESIDENT, memory_plan.STREAMED, memory_plan.RECOMPUTED
    streamer = block_streaming.BlockStreamer(model, plan_of(memory_plan, [(R, C), (S, C)]), "cpu")
    host = model.blocks[1].linear.qweight
    model.to(torch.float32)  # a cast reaches every tensor the trainer owns, none the streamer holds
    assert model.blocks[1].linear.qweight is host
    assert model.blocks[1].linear.scale.dtype == torch.bfloat16
    assert model.blocks[0].linear.scale.dtype == torch.float32
    assert model.blocks[1].norm.weight.dtype == torch.bfloat16
    assert streamer.streamed_bytes() == sum(t.numel() * t.element_size() for t in model.blocks[1].state_dict().values())


def test_a_quantized_tensor_subclass_is_refused_by_name(toolkit):
    block_streaming, _, memory_plan = toolkit

    class Odd(torch.Tensor):
        pass

    block = torch.nn.Linear(4, 4).requires_grad_(False)
    block.weight = torch.nn.Parameter(torch.zeros(4, 4).as_subclass(Odd), requires_grad=False)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([block])
    plan = plan_of(memory_plan, [(memory_plan.STREAMED, memory_plan.RECOMPUTED)])
    with pytest.raises(ValueError, match="blocks.0: Linear.weight is a Odd.*int4_fused"):
        block_streaming.BlockStreamer(model, plan, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["serialized", "overlapped"])
def test_streaming_on_the_gpu(toolkit, mode):
    """The same on CUDA/HIP: pinned host copies, copies on a side stream when overlapped, the
    resident model's outputs and gradients (kernels may sum in another order: 1 % of their size)."""
    block_streaming, int4_linear, memory_plan = toolkit
    torch.manual_seed(0)
    resident = Stack(int4_linear, depth=6).to(torch.bfloat16).cuda()
    streamed = copy.deepcopy(resident)
    R, S, C = memory_plan.RESIDENT, memory_plan.STREAMED, memory_plan.RECOMPUTED
    streamer = block_streaming.BlockStreamer(streamed, plan_of(memory_plan, [(R, C), (S, C)] * 3), "cuda", mode)
    assert all(slot.host.is_pinned() and slot.host.device.type == "cpu"
               for slots in streamer.slots.values() for slot in slots)
    x = torch.randn(2, 256, WIDTH, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        for want, got in zip(step(resident, x), step(streamed, x)):
            assert float((want.float() - got.float()).abs().max()) <= 0.01 * float(want.float().abs().max())
    assert streamer.stats.bytes_last_step > 0
