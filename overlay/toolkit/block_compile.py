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

Compiling happens on the first forward of each variant (tens of seconds; Inductor's FX graph cache
makes later launches quicker). If it fails there (no Triton, no C compiler, an Inductor error), the
blocks run uncompiled for the rest of the run, after one line that says why. A failure while
compiling the backward is not caught: `python -m launcher selftest` compiles a small FLUX.2 on
the GPU, forward and backward, and compares it with the uncompiled one; `compile_blocks: auto`
in a preset compiles only where that check passed.
"""

from __future__ import annotations

import functools

import torch
import torch._functorch.config

from toolkit.block_streaming import StreamedBlock

BLOCK_LISTS = ("double_blocks", "single_blocks")
_COMPILED_MARK = "_flux2_compiled_from"


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


def compiled_forward(eager, name: str, log=print, backend: str = "inductor"):
    """A forward that runs `eager` through torch.compile, or eagerly once compiling failed (its
    `failure` attribute then says why)."""
    compiled = torch.compile(eager, backend=backend)
    announced = []

    @functools.wraps(eager)
    def forward(self, *args, **kwargs):
        if forward.failure is not None:
            return eager(self, *args, **kwargs)
        if not announced:
            announced.append(True)
            log(f"compile_blocks: compiling {name} on its first forward (tens of seconds, then cached)")
        try:
            return compiled(self, *args, **kwargs)
        except compile_errors() as error:
            forward.failure = root_cause(error)
            log(f"compile_blocks: {name} could not be compiled ({forward.failure}); it runs uncompiled for "
                "the rest of this run (model_kwargs compile_blocks: false skips the attempt)")
            return eager(self, *args, **kwargs)

    forward.failure = None
    setattr(forward, _COMPILED_MARK, eager)
    return forward


def compiled_graphs(classes) -> dict:
    """How many graphs Dynamo holds for each compiled class's forward: one per set of guards it
    told apart (grad mode, a first block's input that needs no gradient), never one per block."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return {cls.__name__: len(_debug_get_cache_entry_list(getattr(cls.forward, _COMPILED_MARK))) for cls in classes}


def compile_blocks(transformer: torch.nn.Module, log=print, backend: str = "inductor") -> list:
    """Compile the forward of every block class of `transformer`. Returns the classes. Idempotent."""
    # torch 2.11's AOTAutograd cache gives a cached segment's view outputs corrupt sizes (the
    # second launch of a small FLUX.2 failed every time); Inductor's own FX graph cache stays on
    torch._functorch.config.enable_autograd_cache = False
    classes = block_classes(transformer)
    for cls in classes:
        if not hasattr(cls.forward, _COMPILED_MARK):
            cls.forward = compiled_forward(cls.forward, cls.__name__, log, backend)
    return classes


def uncompile(classes) -> None:
    """Put the eager forwards back (the self-test and the tests build models uncompiled again)."""
    for cls in classes:
        eager = getattr(cls.forward, _COMPILED_MARK, None)
        if eager is not None:
            cls.forward = eager


def requested(model_kwargs: dict) -> bool:
    """compile_blocks: true compiles; false, unset or auto (which `run` resolves from the self-test
    before the trainer starts; the trainer alone has no verdict to read) leave the blocks eager."""
    value = model_kwargs.get("compile_blocks", False)
    if value not in (True, False, "auto"):
        raise ValueError(f"model_kwargs compile_blocks: {value!r}; use true, false or auto")
    return value is True


def compile_for_model(base_model, transformer: torch.nn.Module) -> bool:
    """Compile the blocks when the model's settings ask for it; returns whether it did."""
    if not requested(base_model.model_config.model_kwargs):
        return False
    from toolkit import trainer_telemetry

    names = [cls.__name__ for cls in compile_blocks(transformer, log=base_model.print_and_status_update)]
    trainer_telemetry.record_event("compile_blocks", classes=names)
    base_model.print_and_status_update(f"compile_blocks: {', '.join(names)} compile on their first forward; "
                                       "the 4-bit matmuls run inside them as they are")
    return True
