"""The FLUX.2 blocks compiled (toolkit/block_compile.py, model_kwargs compile_blocks) on the CPU: the
fused blocks against the unfused ones with the trainer's own LoRA network, a 4-bit block compiled
whole around its 4-bit matmul operators, one compiled forward for every block of a class (streamed
or resident: the same graphs), streamed blocks, a line per compile with its seconds, lines while one
lasts, the bound past which no graph is compiled, and the fallback when compiling fails. Inductor
compiles in one test (about a minute on two cores); the others use the aot_eager backend, which
traces the same graphs without generating kernels, so its results are the uncompiled ones bit for
bit."""

import re
import threading
import time

import pytest
import torch
from test_int4_trainer import make_network

from launcher.in_trainer.selftest import compiled, training
from launcher.in_trainer.tiny_assets import FLUX2_PARAMS

pytestmark = pytest.mark.patch("compile-the-transformer-blocks")


@pytest.fixture
def toolkit(trainer_on_path, flux2_src):
    from toolkit import block_compile, block_streaming, int4_linear
    from flux2_contract import memory_plan, qtypes

    yield block_compile, block_streaming, int4_linear, memory_plan, qtypes
    # compiling patches classes: put every forward back for the tests that follow
    block_compile.uncompile([flux2_src.DoubleStreamBlock, flux2_src.SingleStreamBlock])
    torch._dynamo.reset()


def tiny_flux2(flux2_src, toolkit, depth=1, single=1, qtype=None):
    """The tiny FLUX.2 in bf16 (4-bit block Linears for a qtype), the trainer's LoRA network on it,
    gradient checkpointing on; returns (model, the network, one batch and its target). The network
    must be held: its modules know it only through a weak reference."""
    _, _, int4_linear, _, qtypes = toolkit
    params = tiny_params(flux2_src, depth, single)
    torch.manual_seed(0)
    model = flux2_src.Flux2(params).to(torch.bfloat16)
    if qtype:
        int4_linear.quantize_linears(model, lambda name, _: name.split(".")[0] in ("double_blocks", "single_blocks"))
    return trainable(model, params, int4_linear, qtype)


def tiny_params(flux2_src, depth=1, single=1):
    return flux2_src.Flux2Params(**{**FLUX2_PARAMS, "depth": depth, "depth_single_blocks": single})


def trainable(model, params, int4_linear, qtype=None):
    """The model frozen under the trainer's LoRA network, checkpointed, with one batch (see tiny_flux2)."""
    model.requires_grad_(False)
    if qtype:
        int4_linear.configure_linears(model, qtype, {"w4a8_activations": "fp8"}, "cpu")
    network = make_network(None, model)
    model.gradient_checkpointing = True
    batch, target = training.tiny_batch(torch, torch.device("cpu"), 4, 8, params.in_channels, params.context_in_dim)
    return model, network, batch, target


def compiles_over(lines):
    """The log lines but those of a compile still under way (a busy machine gets them past a minute)."""
    return [line for line in lines if "still compiling after" not in line]


def one_step(model, network, batch, target):
    loss, grads = compiled.step(torch, model, list(network.parameters()), batch, target)
    return [loss, *grads]


def test_compiled_blocks_match_the_uncompiled_ones(flux2_src, toolkit, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # compiled here, not found in an old cache
    block_compile = toolkit[0]
    model, network, batch, target = tiny_flux2(flux2_src, toolkit)
    model.gradient_checkpointing = False  # one graph per class to generate (the other tests checkpoint)
    want = one_step(model, network, batch, target)
    lines = []
    classes = block_compile.compile_blocks(model, log=lines.append)
    assert [cls.__name__ for cls in classes] == ["DoubleStreamBlock", "SingleStreamBlock"]
    for _ in range(2):  # the first step compiles, the second runs the compiled kernels
        got = one_step(model, network, batch, target)
        assert all(cls.forward.failure is None for cls in classes)
        # fused kernels keep fp32 between ops the uncompiled blocks round to bf16 (measured 0.011-0.016)
        assert compiled.relative_difference(got, want) < 0.05
        assert all(bool(g.abs().sum() > 0) for g in got[1:])
    # each class's forward and backward, each compiled into the empty cache
    done = compiles_over(lines)
    assert len(done) == 4 and all("compiled in" in line and "(Inductor cache: compiled anew)" in line
                                  for line in done), lines


def test_a_4bit_block_compiles_whole_around_its_4bit_matmuls(flux2_src, toolkit, monkeypatch):
    from toolkit import int4_w4a8

    block_compile, _, int4_linear, _, _ = toolkit
    model, network, batch, target = tiny_flux2(flux2_src, toolkit, qtype="int4_w4a8")
    calls = []
    real_matmul = int4_w4a8.w4a8_matmul

    def counted(*args, **kwargs):
        calls.append(1)
        return real_matmul(*args, **kwargs)

    monkeypatch.setattr(int4_w4a8, "w4a8_matmul", counted)  # the operator looks it up per call
    want = one_step(model, network, batch, target)
    per_step = len(calls)
    # forward, recompute, and the input gradient of (nearly) every Linear
    assert per_step > 2 * sum(isinstance(m, int4_linear.Int4Linear) for m in model.modules())
    torch._dynamo.utils.counters.clear()
    block_compile.compile_blocks(model, log=lambda line: None, backend="aot_eager")
    for _ in range(3):
        calls.clear()
        got = one_step(model, network, batch, target)
        # traced Python would run once, at tracing; the operator runs on every call
        assert len(calls) == per_step
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # one graph per block variant, as in bf16: the 4-bit matmul is a node of it, not a graph break
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 6


def test_a_4bit_model_from_the_quantized_cache_keeps_its_scales_when_compiled(flux2_src, toolkit, tmp_path,
                                                                             scale_derivations):
    """The cache loads each tensor as one of its own, not as a view of the bytes read: a compiled
    block gets a new view object of such a buffer on every call, and the 8-bit weight scales kept
    on the weight tensor would be derived again on every call."""
    from toolkit import quantized_cache

    block_compile, _, int4_linear, _, qtypes = toolkit
    quantized, *_ = tiny_flux2(flux2_src, toolkit, qtype="int4_w4a8")
    source = tmp_path / "flux2-tiny.safetensors"
    source.write_bytes(b"stands in for the source checkpoint")
    cache = quantized_cache.QuantizedCache(tmp_path, source, "int4_fused", "tiny")
    assert cache.save(quantized)
    params = tiny_params(flux2_src)
    with torch.device("meta"):
        model = flux2_src.Flux2(params)
    assert cache.load_into(model, torch.device("cpu"))
    assert all(t._base is None for t in model.buffers())
    model, network, batch, target = trainable(model, params, int4_linear, "int4_w4a8")
    linears = sum(isinstance(m, int4_linear.Int4Linear) for m in model.modules())
    one_step(model, network, batch, target)
    assert len(scale_derivations) == linears  # once per weight, on first use
    block_compile.compile_blocks(model, log=lambda line: None, backend="aot_eager")
    for _ in range(2):
        one_step(model, network, batch, target)
    assert len(scale_derivations) == linears


def unique_graphs(flux2_src, toolkit, depth: int) -> int:
    block_compile, _, int4_linear, _, _ = toolkit
    model, network, batch, target = tiny_flux2(flux2_src, toolkit, depth=depth, single=depth)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    classes = block_compile.compile_blocks(model, log=lambda line: None,
                                           backend="aot_eager")
    one_step(model, network, batch, target)
    block_compile.uncompile(classes)
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_one_compiled_forward_serves_every_block_of_a_class(flux2_src, toolkit):
    # per class: with grad (the recompute), without (reentrant checkpointing's first pass), and on
    # upstream once more for the first block, whose input needs no gradient; never one per block
    assert unique_graphs(flux2_src, toolkit, depth=2) == unique_graphs(flux2_src, toolkit, depth=5) <= 6


def graphs_per_class(flux2_src, toolkit, weights=None) -> dict:
    """Dynamo's graphs per block class after two steps of a 4-bit tiny FLUX.2 with 3 blocks per
    class, compiled, each block placed as `weights` says ({block: RESIDENT or STREAMED}; None: no
    memory plan), every block recomputed as the trainer's plan has them."""
    block_compile, block_streaming, _, memory_plan, _ = toolkit
    model, network, batch, target = tiny_flux2(flux2_src, toolkit, depth=3, single=3, qtype="int4_w4a8")
    if weights:
        blocks = [memory_plan.BlockPlan(name, where, memory_plan.RECOMPUTED) for name, where in weights.items()]
        block_streaming.BlockStreamer(model, memory_plan.MemoryPlan(budget_bytes=0, blocks=blocks), "cpu")
    torch._dynamo.reset()
    classes = block_compile.compile_blocks(model, log=lambda line: None, backend="aot_eager")
    for _ in range(2):
        one_step(model, network, batch, target)
    graphs = block_compile.compiled_graphs(classes)
    block_compile.uncompile(classes)
    return graphs


def test_streamed_and_resident_blocks_of_a_class_share_its_graphs(flux2_src, toolkit):
    S, R = toolkit[3].STREAMED, toolkit[3].RESIDENT
    weights = {"double_blocks.0": R, "double_blocks.1": S, "double_blocks.2": R,
               "single_blocks.0": S, "single_blocks.1": R, "single_blocks.2": S}
    # per class, with grad and, under reentrant checkpointing (the fork), without grad for its first
    # pass (and one more where the forward leaves the first block's input without a gradient); a
    # streamed block's class once doubled them
    resident = graphs_per_class(flux2_src, toolkit)
    assert 1 <= resident["SingleStreamBlock"] <= 2 and resident["DoubleStreamBlock"] <= 3
    assert graphs_per_class(flux2_src, toolkit, weights) == resident


def test_streamed_blocks_compile_between_their_fetch_and_release(flux2_src, toolkit):
    block_compile, block_streaming, int4_linear, memory_plan, _ = toolkit
    want = one_step(*tiny_flux2(flux2_src, toolkit, depth=2, single=2, qtype="int4_w4a8"))
    model, network, batch, target = tiny_flux2(flux2_src, toolkit, depth=2, single=2, qtype="int4_w4a8")
    S, R, C = memory_plan.STREAMED, memory_plan.RESIDENT, memory_plan.RECOMPUTED
    layout = {"double_blocks.0": S, "double_blocks.1": R, "single_blocks.0": R, "single_blocks.1": S}
    plan = memory_plan.MemoryPlan(budget_bytes=0, blocks=[memory_plan.BlockPlan(n, w, C) for n, w in layout.items()])
    streamer = block_streaming.BlockStreamer(model, plan, "cpu", block_streaming.SERIALIZED, record=True)
    classes = block_compile.compile_blocks(model, log=lambda line: None,
                                           backend="aot_eager")
    assert [cls.__name__ for cls in classes] == ["DoubleStreamBlock", "SingleStreamBlock"]  # not the wrappers
    for _ in range(2):
        streamer.stats.events.clear()
        got = one_step(model, network, batch, target)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert {("fetch", "double_blocks.0"), ("recompute", "single_blocks.1")} <= set(streamer.stats.events)
    assert all(cls.forward.failure is None for cls in classes)


def test_compiled_streamed_blocks_derive_each_weight_scale_once(flux2_src, toolkit, scale_derivations):
    """A streamed block's tensors reach its compiled forward as tensors of their own at every turn:
    views into one buffer reached it as new view objects at every call, and int4_w4a8 derived each
    weight's 8-bit scales again (an 8 GB card's compiled step 2.4x slower)."""
    block_compile, block_streaming, int4_linear, memory_plan, _ = toolkit
    model, network, batch, target = tiny_flux2(flux2_src, toolkit, depth=2, single=2, qtype="int4_w4a8")
    S, C = memory_plan.STREAMED, memory_plan.RECOMPUTED
    names = ["double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1"]
    plan = memory_plan.MemoryPlan(budget_bytes=0, blocks=[memory_plan.BlockPlan(n, S, C) for n in names])
    block_streaming.BlockStreamer(model, plan, "cpu", block_streaming.OVERLAPPED)
    block_compile.compile_blocks(model, log=lambda line: None, backend="aot_eager")
    linears = sum(isinstance(m, int4_linear.Int4Linear) for n in names for m in model.get_submodule(n).modules())
    for _ in range(3):
        one_step(model, network, batch, target)
    assert len(scale_derivations) == linears


def test_each_compile_gets_a_line_with_its_seconds_and_past_the_bound_none_is_compiled(flux2_src, toolkit,
                                                                                    monkeypatch):
    block_compile = toolkit[0]
    model, network, batch, target = tiny_flux2(flux2_src, toolkit)
    want = one_step(model, network, batch, target)
    monkeypatch.setattr(block_compile, "COMPILE_BOUND_S", 0.0)  # the first compile passes it
    logged = []
    classes = block_compile.compile_blocks(model, log=logged.append, backend="aot_eager")
    for _ in range(2):
        got = one_step(model, network, batch, target)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    lines = compiles_over(logged)
    # the first graph (the double block's first forward: without grad under reentrant checkpointing,
    # with grad otherwise) stays in use, and so does its backward
    assert block_compile.compiled_graphs(classes) == {"DoubleStreamBlock": 1, "SingleStreamBlock": 0}
    assert re.fullmatch(r"compile_blocks: DoubleStreamBlock forward with(out)? grad compiled in \d+\.\d s; "
                        r"\d+\.\d s compiling DoubleStreamBlock so far", lines[0]), lines
    assert re.fullmatch(r"compile_blocks: \d+ s of compiling, past its bound of 0 s: the graphs compiled so far "
                        r"stay in use, calls they do not fit run uncompiled from now on", lines[1]), lines
    assert all(re.match(r"compile_blocks: DoubleStreamBlock backward compiled in", line) for line in lines[2:]), lines
    assert len(lines) <= 3, lines


def test_a_compile_that_lasts_gets_lines_while_it_lasts_and_the_stacks_once(flux2_src, toolkit, monkeypatch,
                                                                           capfd):
    block_compile = toolkit[0]
    model, network, batch, target = tiny_flux2(flux2_src, toolkit)
    want = one_step(model, network, batch, target)
    monkeypatch.setattr(block_compile, "STALL_LINE_S", 0.1)

    def slow_compiler_here(graph, example_inputs):
        time.sleep(2.0)  # 20 intervals: lines come even on a busy machine
        return graph.forward

    lines = []
    block_compile.compile_blocks(model, log=lines.append, backend=slow_compiler_here)
    got = one_step(model, network, batch, target)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    stalled = [line for line in lines if "still compiling after" in line]
    assert all(re.fullmatch(r"compile_blocks: (Double|Single)StreamBlock forward with(out)? grad still compiling "
                            r"after \d+ s(; the stacks of every thread follow on stderr, for a bug report)?", line)
               for line in stalled), lines
    with_stacks = [line.split(" still compiling")[0] for line in stalled if "stacks" in line]
    compiled = [line.split(" compiled in")[0] for line in lines if " compiled in " in line]
    assert len(compiled) >= 2 and set(compiled) <= set(with_stacks), lines  # each compile, one stacks line
    assert len(stalled) > len(with_stacks) == len(set(with_stacks)), lines  # then lines without them
    stderr = capfd.readouterr().err
    assert stderr.count("Current thread") == len(with_stacks), stderr
    assert "torch/_dynamo/" in stderr.replace("\\", "/")  # where the compile is
    after_step = len(lines)
    time.sleep(0.3)
    assert len(lines) == after_step, lines[after_step:]  # no line once the compiles are over
    assert not any(thread.name == "compile_blocks watch" for thread in threading.enumerate())


@pytest.fixture(params=[False, True], ids=["dynamo-default", "suppress-errors-as-k-diffusion-sets"])
def dynamo_suppress_errors(request):
    """Dynamo's suppress_errors off, then on: k-diffusion turns it on as the trainer imports it."""
    with torch._dynamo.config.patch(suppress_errors=request.param):
        yield request.param


def test_a_block_class_that_cannot_compile_runs_uncompiled_after_one_line(flux2_src, toolkit, dynamo_suppress_errors):
    block_compile, _, int4_linear, _, _ = toolkit
    model, network, batch, target = tiny_flux2(flux2_src, toolkit)
    want = one_step(model, network, batch, target)

    def no_compiler_here(graph, example_inputs):
        raise RuntimeError("no C compiler found")

    lines = []
    classes = block_compile.compile_blocks(model, log=lines.append,
                                           backend=no_compiler_here)
    for _ in range(2):
        got = one_step(model, network, batch, target)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    failed = [line for line in lines if "could not be compiled" in line]
    assert len(failed) == 2 and all("no C compiler found" in line for line in failed), lines
    assert all("runs uncompiled for the rest of this run" in line for line in failed)
    assert all("no C compiler found" in cls.forward.failure for cls in classes)


@pytest.mark.parametrize("value, compiles", [(None, False), (False, False), (True, True)])
def test_the_setting(toolkit, value, compiles):
    block_compile = toolkit[0]
    assert block_compile.requested({} if value is None else {"compile_blocks": value}) is compiles


def test_a_bad_setting_says_what_is_allowed(toolkit):
    """`auto` is resolved by `run` from the self-test: the trainer handed one refuses it."""
    with pytest.raises(ValueError, match="compile_blocks: 'yes' is not true/false; allowed: true or false"):
        toolkit[0].requested({"compile_blocks": "yes"})
    with pytest.raises(ValueError, match="compile_blocks: auto is resolved by `python -m launcher run`"):
        toolkit[0].requested({"compile_blocks": "auto"})


def test_the_selftest_child_compares_compiled_with_uncompiled(trainer_checkout, toolkit):
    report = compiled.child(trainer_checkout, None, "aot_eager")
    assert report["compiled"] and report["failures"] == [] and report["device"] == "cpu"
    assert report["max_relative_difference"] == 0.0  # aot_eager: the same kernels
    assert report["eager_ms"] > 0 and report["compiled_ms"] > 0


def carried_compiled_plan(toolkit, model, activation=1000):
    """A memory plan for compiled blocks carried out on the tiny model (memory_budget.after_load, as
    the trainer does once loaded): every block resident and kept at KEPT_COMPILED, with room for
    only the first two kept at the uncompiled KEPT_MEASURED."""
    from types import SimpleNamespace

    from toolkit import memory_budget

    memory_plan = toolkit[3]
    names = [f"{prefix}.{index}" for prefix in ("double_blocks", "single_blocks") for index in range(2)]
    stand_in = SimpleNamespace(blocks=[SimpleNamespace(name=name) for name in names])
    weights, outside = memory_budget.measured(model, stand_in)
    blocks = tuple(memory_plan.BlockSize(name, weights[name], activation) for name in names)
    budget = outside + 2 * activation + sum(weights.values()) + 4 * int(activation * memory_plan.KEPT_COMPILED)
    plan = memory_plan.make_plan(memory_plan.PlanInputs(budget, blocks, outside, 0, 0, compiled=True))
    assert plan.kept() == names and plan.fallback_kept == names[:2]
    base_model = SimpleNamespace(model_config=SimpleNamespace(model_kwargs={"memory_plan": "auto"}, qtype="bf16"),
                                 device_torch=torch.device("cpu"), memory_plan_budget=(budget, {}))
    assert memory_budget.after_load(base_model, model, None, plan) is plan
    return names


@pytest.mark.patch("memory-plan")
@pytest.mark.parametrize("cause", ["compile fails", "bound passed", "compiles"])
def test_kept_blocks_past_the_plans_fallback_recompute_once_the_blocks_run_uncompiled(flux2_src, toolkit, monkeypatch,
                                                                                     capsys, cause):
    """A plan for compiled blocks keeps more of them than fit uncompiled: where a class cannot compile,
    or the compile bound passes before the single blocks' class compiled its forward with grad (the
    one kept blocks run), the kept blocks past the plan's fallback_kept recompute from then on, with a
    line; the step's result is the same. Where the blocks compile, every kept block stays kept."""
    block_compile = toolkit[0]
    model, network, batch, target = tiny_flux2(flux2_src, toolkit, depth=2, single=2)
    want = one_step(model, network, batch, target)
    names = carried_compiled_plan(toolkit, model)
    capsys.readouterr()

    def no_compiler_here(graph, example_inputs):
        raise RuntimeError("no C compiler found")

    if cause == "bound passed":
        monkeypatch.setattr(block_compile, "COMPILE_BOUND_S", 0.0)  # passed as the double blocks' first compile ends
    block_compile.compile_blocks(model, log=lambda line: None,
                                 backend=no_compiler_here if cause == "compile fails" else "aot_eager")
    for _ in range(2):
        got = one_step(model, network, batch, target)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    out = capsys.readouterr().out
    checkpointed = [model.get_submodule(name).checkpointed for name in names]
    if cause == "compiles":
        assert checkpointed == [False] * 4 and "memory plan" not in out
        return
    assert checkpointed == [False, False, True, True]
    why = ("DoubleStreamBlock could not be compiled" if cause == "compile fails" else
           "past the compile bound before SingleStreamBlock compiled its forward with grad")
    assert out.count("memory plan: the blocks run uncompiled") == 1, out
    assert (f"memory plan: the blocks run uncompiled ({why}) and hold more each: 2 of the 4 kept blocks keep their "
            "activations, single_blocks.0-1 recompute them from now on") in out
