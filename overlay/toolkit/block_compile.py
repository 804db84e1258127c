"""Regional torch.compile of the FLUX.2 transformer blocks (model_kwargs compile_blocks: true).

Why: between a block's GEMMs run chains of small elementwise kernels (LayerNorm, modulation,
QK RMSNorm, RoPE in fp32, SwiGLU, gates and residuals, the LoRA scale-and-add), each reading and
writing whole activations. At 1024 px they are the largest share of a step, in bf16 and in every
4-bit path alike. Inductor fuses each chain into a few kernels.

What is compiled: the forward of each block class, once, not each block. Dynamo treats a
module's parameters as inputs and its guards hold for every block of a class, so the 8 double and
48 single blocks share two compiled forwards. Each is compiled in a few variants, one per set of
guards that differ: without grad (the first pass of reentrant checkpointing, and sampling) and
with grad (the recompute, and blocks whose activations are kept); a block whose input needs no
gradient (the first double block where the memory plan keeps its activations, or where the
trainer's forward does not ask for one) adds one. `compiled_graphs` counts them. On the CPU, 3
4-bit blocks per class under a memory plan that streams some of them: 2 per class, as for 3
resident blocks (a streamed block's own class once made it 4: toolkit/block_streaming.py). The
LoRA adapters the trainer attaches later are traced with their block. A streamed block's fetch
and release stay outside: its class calls the compiled forward in between.

The 4-bit Linear's matmul is one node of that graph: an operator of its own
(toolkit/int4_linear.py), opaque to the compiler, so a 4-bit block compiles whole (no graph break
per Linear) while its Triton kernels and torch._scaled_mm run as they do uncompiled.

A graph's forward compiles on the first call that needs it, its backward on the first backward
through it. Each compile gets one line once it is over (at the next compiled call, for a
backward): the seconds it took, and whether Inductor found it in its FX graph cache (later
launches do). A compile still under way after STALL_LINE_S gets a line every STALL_LINE_S, and the
stacks of every thread go to stderr once: where it waits. Past COMPILE_BOUND_S of compiling, no
new graph is compiled: the ones compiled by then stay in use, the calls they do not fit run
uncompiled. If compiling fails (no Triton, no C compiler, an Inductor error), the class runs
uncompiled for the rest of the run, after one line that says why: its calls compile with Dynamo's
suppress_errors off, which k-diffusion turns on for the whole process as the trainer imports it
(k_diffusion/models/axial_rope.py); Dynamo would otherwise run a failed graph eagerly without a
word, and the compile line would say it compiled. A failure while compiling the
backward is not caught: `python -m launcher selftest` compiles a small FLUX.2 on the GPU, forward
and backward, and compares it with the uncompiled one; `compile_blocks: auto` in a preset
compiles only where that check passed.

An uncompiled block that keeps its activations holds more than a compiled one, and the memory plan
counts what compiled ones hold: `when_uncompiled` tells it (toolkit/memory_budget.py) the first time
a class falls back, or the bound passes before a class has compiled its forward with grad (the one
kept blocks run).
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch._functorch.config

from toolkit.block_streaming import StreamedBlock
from flux2_contract.settings import read

BLOCK_LISTS = ("double_blocks", "single_blocks")
_COMPILED_MARK = "_flux2_compiled_from"
COMPILE_BOUND_S = 300.0
"""Seconds of compiling, all block classes together, after which no new graph is compiled.
Compiled blocks save 0.17-0.23 s a step at 512 px (bench/RESULTS.md: 0.482 s/it against
0.655-0.711 uncompiled), so 300 s of compiling pays for itself only after 1300-1800 steps, most of
a 2000-step preset; compiling longer costs the run more than it gives back. A compile under way
runs to its end (nothing cuts into Inductor from another thread): the bound is checked as each
compile ends, and holds from the next call on."""
STALL_LINE_S = 60.0
"""A compile under way this long gets a line, and one more each further STALL_LINE_S. A class
compiles in 8-30 s cold at full width (bench/RESULTS.md), but a first launch once went silent for
minutes inside one compile: the line says so while it lasts, and the stacks under it say where."""


def compile_errors() -> tuple:
    """Exceptions that mean "this could not be compiled here", not "the step itself failed"."""
    errors = [torch._dynamo.exc.TorchDynamoException]
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:  # older torch: Inductor errors arrive as BackendCompilerFailed
        pass
    return tuple(errors)


def root_cause(error: BaseException) -> str:
    """The innermost cause of a compile error, in one line: Dynamo wraps the compiler's own error."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
        error = inner
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first_line}"


def block_classes(transformer: torch.nn.Module) -> list:
    """The classes that define the blocks' forward (a streamed block's base class, not its wrapper)."""
    found = []
    for name in BLOCK_LISTS:
        for block in getattr(transformer, name, ()):
            cls = next(c for c in type(block).__mro__ if "forward" in vars(c) and not issubclass(c, StreamedBlock))
            if cls not in found:
                found.append(cls)
    return found


def _cache_counts() -> tuple:
    inductor = torch._dynamo.utils.counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]


@dataclass
class Compile:
    """One graph's compile: its class, forward (with or without grad) or backward, how long it took,
    and what Inductor's FX graph cache said."""
    name: str
    what: str
    began: float
    hits: int
    misses: int
    seconds: float = 0.0
    over: threading.Event = field(default_factory=threading.Event)

    def cache(self) -> str:
        hits, misses = _cache_counts()
        if misses > self.misses:
            return " (Inductor cache: compiled anew)"
        if hits > self.hits:
            return " (from Inductor's cache)"
        return ""


@dataclass
class CompileClock:
    """The seconds each block class spends compiling, read from Dynamo's compile callbacks: a
    forward compiles inside a compiled forward's call (which names the class), its backward later,
    in autograd's backward (the compile id, shared with its forward, names the class)."""
    log: Callable = print
    calling: Optional[str] = None
    owners: dict = field(default_factory=dict)  # Dynamo frame id -> class name
    seconds: dict = field(default_factory=dict)  # class name -> seconds compiling
    under_way: Optional[Compile] = None
    ended: list = field(default_factory=list)  # compiles not reported yet
    past_bound: bool = False
    classes: list = field(default_factory=list)  # the class names compile_blocks compiles
    with_grad: set = field(default_factory=set)  # the class names that compiled a forward with grad
    fallbacks: list = field(default_factory=list)  # when_uncompiled's callbacks, not called yet

    def start(self, args) -> None:
        frame, trigger = args.compile_id.split("/")[0], args.callback_trigger.name
        if trigger == "DYNAMO" and self.calling:
            self.owners[frame] = self.calling
        name = self.owners.get(frame)
        if name is None or trigger not in ("DYNAMO", "LAZY_BACKWARD"):
            return
        what = ("backward" if trigger == "LAZY_BACKWARD" else
                "forward with grad" if torch.is_grad_enabled() else "forward without grad")
        self.under_way = Compile(name, what, time.perf_counter(), *_cache_counts())
        threading.Thread(target=self.watch, args=(self.under_way,), name="compile_blocks watch", daemon=True).start()

    def watch(self, compiling: Compile) -> None:
        """Lines while one compile lasts past STALL_LINE_S; under the first, every thread's stack."""
        stacks_written = False
        while not compiling.over.wait(STALL_LINE_S):
            self.log(f"compile_blocks: {compiling.name} {compiling.what} still compiling after "
                     f"{time.perf_counter() - compiling.began:.0f} s" +
                     ("" if stacks_written else "; the stacks of every thread follow on stderr, for a bug report"))
            if not stacks_written:
                faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
                stacks_written = True

    def end(self, args) -> None:
        done, self.under_way = self.under_way, None
        if done is None:
            return
        done.over.set()
        done.seconds = time.perf_counter() - done.began
        self.seconds[done.name] = self.seconds.get(done.name, 0.0) + done.seconds
        if done.what == "forward with grad":
            self.with_grad.add(done.name)
        self.ended.append((done, done.cache()))

    def report(self, failed: bool = False) -> None:
        """One line per compile that ended (left out when it failed: the failure has its line),
        and one when compiling passed COMPILE_BOUND_S."""
        for done, cache in ([] if failed else self.ended):
            self.log(f"compile_blocks: {done.name} {done.what} compiled in {done.seconds:.1f} s{cache}; "
                     f"{self.seconds[done.name]:.1f} s compiling {done.name} so far")
        self.ended.clear()
        total = sum(self.seconds.values())
        if total > COMPILE_BOUND_S and not self.past_bound:
            self.past_bound = True
            self.log(f"compile_blocks: {total:.0f} s of compiling, past its bound of {COMPILE_BOUND_S:.0f} s: the "
                     "graphs compiled so far stay in use, calls they do not fit run uncompiled from now on")
            missing = [name for name in self.classes if name not in self.with_grad]
            if missing:
                self.fall_back(f"past the compile bound before {', '.join(missing)} compiled its forward with grad")

    def fall_back(self, why: str) -> None:
        """Call when_uncompiled's callbacks, once."""
        callbacks, self.fallbacks = self.fallbacks, []
        for callback in callbacks:
            callback(why)

    @contextlib.contextmanager
    def call(self, name: str):
        """Around a compiled forward's call: the class it compiles for; past the bound, only the
        graphs compiled already run (Dynamo's eager_on_recompile stance)."""
        self.calling = name
        try:
            with torch.compiler.set_stance("eager_on_recompile") if self.past_bound else contextlib.nullcontext():
                yield
        finally:
            self.calling = None


_clock = CompileClock()


def when_uncompiled(callback: Callable[[str], None]) -> None:
    """Call `callback(why)` once, the first time blocks that were to run compiled run uncompiled."""
    _clock.fallbacks.append(callback)


def _on_compile_start(args) -> None:
    _clock.start(args)


def _on_compile_end(args) -> None:
    _clock.end(args)


def compiled_forward(eager, name: str, log=print, backend: str = "inductor"):
    """A forward that runs `eager` through torch.compile, or eagerly once compiling failed (its
    `failure` attribute then says why)."""
    compiled = torch.compile(eager, backend=backend)

    @functools.wraps(eager)
    def forward(self, *args, **kwargs):
        if forward.failure is not None:
            return eager(self, *args, **kwargs)
        _clock.report()  # compiles that ended since the last call (a backward among them) succeeded
        try:
            with _clock.call(name), torch._dynamo.config.patch(suppress_errors=False):
                output = compiled(self, *args, **kwargs)
        except compile_errors() as error:
            _clock.report(failed=True)
            forward.failure = root_cause(error)
            log(f"compile_blocks: {name} could not be compiled ({forward.failure}); it runs uncompiled for "
                "the rest of this run (model_kwargs compile_blocks: false skips the attempt)")
            _clock.fall_back(f"{name} could not be compiled")
            return eager(self, *args, **kwargs)
        _clock.report()
        return output

    forward.failure = None
    setattr(forward, _COMPILED_MARK, eager)
    return forward


def compiled_graphs(classes) -> dict:
    """How many graphs Dynamo holds for each compiled class's forward: one per set of guards it
    told apart (grad mode, a first block's input that needs no gradient), never one per block."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return {cls.__name__: len(_debug_get_cache_entry_list(getattr(cls.forward, _COMPILED_MARK))) for cls in classes}


def compile_seconds() -> dict:
    """The seconds each block class has spent compiling so far (forwards and backwards)."""
    return dict(_clock.seconds)


def compile_blocks(transformer: torch.nn.Module, log=print, backend: str = "inductor") -> list:
    """Compile the forward of every block class of `transformer`. Returns the classes. Idempotent."""
    # torch 2.11's AOTAutograd cache gives a cached segment's view outputs corrupt sizes (the
    # second launch of a small FLUX.2 failed every time); Inductor's own FX graph cache stays on
    torch._functorch.config.enable_autograd_cache = False
    from torch._dynamo.callback import callback_handler

    _clock.log = log
    if _on_compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_compile_start)
        callback_handler.register_end_callback(_on_compile_end)
    classes = block_classes(transformer)
    _clock.classes = [cls.__name__ for cls in classes]
    for cls in classes:
        if not hasattr(cls.forward, _COMPILED_MARK):
            cls.forward = compiled_forward(cls.forward, cls.__name__, log, backend)
    return classes


def uncompile(classes) -> None:
    """Put the eager forwards back (the self-test and the tests build models uncompiled again),
    with a clock that starts from zero and no when_uncompiled callbacks."""
    global _clock
    _clock = CompileClock(log=_clock.log)
    for cls in classes:
        eager = getattr(cls.forward, _COMPILED_MARK, None)
        if eager is not None:
            cls.forward = eager


def requested(model_kwargs: dict) -> bool:
    """model_kwargs compile_blocks (flux2_contract/settings.py; `run` resolves its auto from the self-test)."""
    return read(model_kwargs, "compile_blocks")


def compile_for_model(base_model, transformer: torch.nn.Module) -> bool:
    """Compile the blocks when the model's settings ask for it; returns whether it did."""
    if not requested(base_model.model_config.model_kwargs):
        return False
    from toolkit import trainer_telemetry

    names = [cls.__name__ for cls in compile_blocks(transformer, log=base_model.print_and_status_update)]
    trainer_telemetry.record_event("compile_blocks", classes=names)
    base_model.print_and_status_update(f"compile_blocks: {', '.join(names)} compile on their first forward; "
                                       "the 4-bit matmuls run inside them as they are; no new graph is "
                                       f"compiled after {COMPILE_BOUND_S:.0f} s of compiling")
    return True
