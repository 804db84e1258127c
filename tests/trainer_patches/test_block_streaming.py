"""Streamed blocks (toolkit/block_streaming.py) on the CPU, where the "device" copy is a separate
tensor copy so the mechanics run: the order of copies and computations over a step (forward, then
recompute + backward in reverse), the same outputs and gradients as the resident blocks, and
tensors that stay in host memory whatever the trainer moves."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def block_tensor_bytes(int4_linear, memory_plan, shape, double: bool) -> list:
    """The frozen tensors of one 4-bit FLUX.2 block in module order: each Linear's buffers (an
    Int4Linear on the meta device), then the bf16 q/k norms (two per stream)."""
    linears = memory_plan.block_linears(shape)[0 if double else 1]
    head = shape.hidden // shape.heads
    return ([t.numel() * t.element_size() for i, o in linears
             for t in int4_linear.Int4Linear(i, o, device="meta").buffers()]
            + [head * 2] * (4 if double else 2))


@pytest.mark.parametrize("arch", ["flux2", "flux2_klein_4b", "flux2_klein_9b"])
def test_streamed_blocks_pack_into_power_of_two_chunks_with_little_left_over(toolkit, arch):
    """PyTorch's pinned allocator rounds a request up to a power of two; one request per tensor cost
    51-59 % more pinned memory than the streamed bytes at the 12 and 8 GB caps. Packed in order into
    power-of-two chunks, the blocks an 8 GB card streams (every double block but one, every single
    one) and every block of the model take at most 2 % more (a last chunk rounds up)."""
    from flux2_contract.families import FAMILIES

    block_streaming, int4_linear, memory_plan = toolkit
    shape = memory_plan.Flux2Shape.from_params(FAMILIES[arch].shape)
    double, single = (block_tensor_bytes(int4_linear, memory_plan, shape, kind) for kind in (True, False))
    for doubles in (max(1, shape.depth - 1), shape.depth):
        sizes = double * doubles + single * shape.depth_single
        chunks, places = block_streaming.chunk_layout(sizes, block_streaming.CHUNK)
        assert all(chunk & (chunk - 1) == 0 for chunk in chunks)
        assert sum(chunks) <= 1.02 * sum(sizes), (arch, doubles, chunks)
        assert len(places) == len(sizes)


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=40), st.sampled_from([1024, 4096, 1 << 16]))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_chunk_layout_places_every_tensor_in_order_inside_a_power_of_two_chunk(toolkit, sizes, largest):
    block_streaming = toolkit[0]
    chunks, places = block_streaming.chunk_layout(sizes, largest)
    assert all(chunk & (chunk - 1) == 0 for chunk in chunks)
    spans = [(chunk, offset, offset + size) for (chunk, offset), size in zip(places, sizes)]
    assert spans == sorted(spans)  # in order: a block's tensors are consecutive in its chunks
    for (chunk, start, end), (next_chunk, next_start, _) in zip(spans, spans[1:] + [(len(chunks), 0, 0)]):
        assert start % block_streaming.ALIGN == 0 and end <= chunks[chunk]
        assert next_chunk > chunk or end <= next_start  # no overlap
    aligned = lambda size: -(-size // block_streaming.ALIGN) * block_streaming.ALIGN  # noqa: E731
    for (chunk, _, end), (next_chunk, _, next_end) in zip(spans, spans[1:]):
        if next_chunk != chunk:  # a chunk is opened only for a tensor the open one could not take
            assert next_chunk == chunk + 1 and aligned(end) + aligned(next_end) > chunks[chunk]


@pytest.mark.parametrize("mode", ["serialized", "overlapped"])
def test_blocks_across_chunks_stream_as_tensors_of_their_own(toolkit, mode, monkeypatch):
    """With chunks smaller than a block, its host copies sit in two chunks; whatever the chunks, each
    tensor a block computes with is its own copy, not a view into a shared buffer (a compiled block
    would see a new view object at every call: test_block_compile.py)."""
    block_streaming, int4_linear, memory_plan = toolkit
    torch.manual_seed(0)
    resident = Stack(int4_linear).to(torch.bfloat16)
    streamed = copy.deepcopy(resident)
    monkeypatch.setattr(block_streaming, "CHUNK", 4096)
    R, S, C = memory_plan.RESIDENT, memory_plan.STREAMED, memory_plan.RECOMPUTED
    streamer = block_streaming.BlockStreamer(streamed, plan_of(memory_plan, [(R, C), (S, C), (R, C), (S, C)]),
                                             "cpu", mode)
    storages = {name: {slot.host.untyped_storage().data_ptr() for slot in slots}
                for name, slots in streamer.slots.items()}
    assert max(len(chunks) for chunks in storages.values()) == 2
    assert all(chunk.numel() <= 4096 for chunk in streamer.chunks)
    streamer.enter("blocks.1")
    computing = [slot.current() for slot in streamer.slots["blocks.1"]]
    assert all(tensor._base is None for tensor in computing)
    assert len({tensor.untyped_storage().data_ptr() for tensor in computing}) == len(computing)
    streamer.leave("blocks.1")
    x = torch.randn(2, 8, WIDTH, dtype=torch.bfloat16)
    for _ in range(2):
        want, want_grad = step(resident, x)
        got, got_grad = step(streamed, x)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


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
