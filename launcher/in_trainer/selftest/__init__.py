"""The self-test, trainer side (the launcher side, which starts it and keeps its verdict, is
launcher/selftest/).

runner (`python -m launcher.in_trainer.selftest.runner`: environment, kernel checks, training
steps, timings, streaming; one JSON report), kernels (the 4-bit paths against the plain-PyTorch
reference, the quality gate, the block-Linear timings), training (LoRA steps on the tiny FLUX.2),
streaming (the overlapped block streaming under a deadline, in a child process) and sampling
(`python -m launcher.in_trainer.selftest.sampling`: the tiny 4-bit FLUX.2 samples, in a process
of its own). Stdlib-only at module level, like every in_trainer module.
"""
