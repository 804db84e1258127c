"""The self-test, launcher side: `python -m launcher selftest` tests the 4-bit kernels on this GPU.

The trainer side, launcher/in_trainer/selftest/, runs under the trainer venv's interpreter: every
4-bit kernel path against its plain-PyTorch reference, the 8-bit-activation quality gate, three
LoRA steps on the tiny FLUX.2 per path, the block-Linear time of one step at the preset's shapes,
bf16 weights against each path, a bounded sampling run (wall 6: the tiny 4-bit FLUX.2 samples
finite images in a process of its own, within launch.SAMPLING_LIMIT_S), and the overlapped block
streaming under a deadline (wall 5). Without a GPU only the reference path runs, and the report
says so.

Here: launch (run both parts, stamp the result with the trainer build, store it in
`<workdir>/selftest.json`), verdict (what the stored result decides: `qtype: auto`, `stream_mode:
auto`, in-training sampling; `doctor` reads it, and `run` once per launch through launcher/resolve.py)
and report (the printed text a bug report needs).
"""
