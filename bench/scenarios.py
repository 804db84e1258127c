"""Every measurement of bench/ by name: which script, its arguments, where it runs, what it feeds.

`python -m bench.run NAME` runs one (see run.py); `python -m bench.run --list` prints this table.
In `args`, `{trainer}` is the trainer checkout (`--trainer`), `{workdir}` a launcher workdir
(`--workdir`), `{dir}` a scratch folder (`--dir`), `{out}` the output folder (`--out`): the
files named in `outputs` are written there and archived under archive/ with the date.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    command: tuple[str, ...]  # a module run with `python -m`, or `bash FILE`, then its arguments
    where: str  # "CPU", "GPU", "CPU or GPU", "here" (the machine that prepares a GPU call)
    python: str  # the interpreter to start bench.run with
    tables: tuple[str, ...] = ()  # the results/NAME.csv tables its output feeds
    outputs: tuple[str, ...] = ()  # files of {out} archived as the raw output
    stdout_rows: bool = False  # the script prints its JSON rows: kept as {out}/rows.jsonl
    env: tuple[tuple[str, str], ...] = ()
    needs: str = ""  # what must follow `--` (arguments without a default)


TRAINER_VENV = "the trainer venv (W/venv)"
GPU_PYTHON = "the GPU machine's python3, wheels of .whl on PYTHONPATH"
ANY = "any python of 3.10+"
EXPANDABLE = (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)

SCENARIOS = {s.name: s for s in [
    Scenario("carry", "copies the trainer files the GPU scenarios import into .bench-carry/trainer",
             ("bench.carry", "--trainer", "{trainer}"), "here", ANY),
    Scenario("loader_rss", "peak host RSS and wall time to load (+ quantize) a FLUX.2-shaped checkpoint: the fork's "
             "load_file path vs the streamed block-by-block loader (figure 1)",
             ("bench.loader_rss", "--trainer", "{trainer}", "--sizes",
              "1536:1:6,1536:2:12,1536:4:24,1536:8:48,6144:1:6", "--dir", "{dir}"),
             "CPU", TRAINER_VENV, ("loader_rss",), ("output.log",), env=(("HF_HUB_OFFLINE", "1"),)),
    Scenario("load_rss_depth", "peak host RSS of the trainer's own Flux2Model.load_model at two depths: streamed + "
             "quantize and from the cache, blocks parked on the CPU or off the host (meta stands in for the GPU)",
             ("tests/trainer_patches/load_rss_probe.py", "--trainer", "{trainer}", "--dir", "{dir}",
              "--sizes", "1024:2:8,1024:4:16", "--qtypes", "int4_fused", "--out", "{out}/rows.jsonl"),
             "CPU", TRAINER_VENV, ("load_rss_depth",), ("rows.jsonl",)),
    Scenario("load_rss_depth_upstream", "the same at width 768 with 4 MiB of staging, three depths (the test's sizes)",
             ("tests/trainer_patches/load_rss_probe.py", "--trainer", "{trainer}", "--dir", "{dir}",
              "--sizes", "768:2:4,768:4:8,768:8:16", "--qtypes", "int4_fused", "--staging-mib", "4",
              "--out", "{out}/rows.jsonl"),
             "CPU", TRAINER_VENV + " of the upstream-main workdir", ("load_rss_depth_upstream",), ("rows.jsonl",)),
    Scenario("gpu_suite", "figures 2 (full size), 3 and 4: the cache load and one LoRA step of the 32B model per "
             "variant (uint4 capped at 24/22 GiB and uncapped, bf16), each in its own child with a time budget",
             ("bench.gpu_suite", "--trainer", "{trainer}", "--out-dir", "{out}", "--workdir", "{dir}",
              "--budget", "450"),
             "GPU", GPU_PYTHON, ("step", "cache_load"), ("suite.json", "suite.log")),
    Scenario("gpu_suite_qtype", "the training-step children for another qtype (no cache; four shapes at 24 GiB and 512 px "
             "uncapped), divided by the archived bf16 run",
             ("bench.gpu_suite", "--trainer", "{trainer}", "--out-dir", "{out}", "--workdir", "{dir}",
              "--set", "qtype", "--qtype", "int4_fused", "--bf16-ref", "bench/archive/gpu_suite_2026-11-29.json",
              "--budget", "340"),
             "GPU", GPU_PYTHON, ("int4_fused_step",), ("suite.json", "suite.log")),
    Scenario("train_step", "one LoRA training step (r32 on all block Linears, checkpointing, AdamW) at 512 px: "
             "s/step and peak VRAM; `-- --weights bf16` (or another qtype, `--cap-gib 0`) for the other rows, "
             "`-- --kernel KEY=VALUE` for a 4-bit kernel setting (model_kwargs: w4a8_gemm=scaled_mm, int4_chunk_mib=256 ...)",
             ("bench.train_step", "--trainer", "{trainer}", "--weights", "int4_fused", "--shapes", "512",
              "--cap-gib", "24", "--steps", "5", "--out", "{out}/step.json"),
             "GPU (or `-- --tiny --device cpu`)", GPU_PYTHON, ("same_call", "w4a8_step"), ("step.json",), env=EXPANDABLE),
    Scenario("cache_load_gpu", "the quantized cache loaded onto the GPU through the staging buffers (pinned and "
             "plain) vs to the host then moved, with the peak host RSS each added; width 3072, 8.08 B parameters",
             ("bench.cache_load", "--trainer", "{trainer}", "--workdir", "{dir}", "--hidden", "3072", "--heads", "24",
              "--depth", "8", "--single", "48", "--device", "cuda", "--load-device", "cuda", "--out", "{out}/cache_load.json"),
             "GPU", GPU_PYTHON, ("cache_load_gpu",), ("cache_load.json",)),
    Scenario("pinned_retention", "host RSS kept after quantized blocks went GPU -> host -> GPU, with the fork's "
             "non-blocking copy to the host vs a blocking one",
             ("bench.pinned_retention", "--trainer", "{trainer}", "--gib", "2", "--variants",
              "int4_fused:1,int4_fused:0", "--out", "{out}/rows.json"),
             "GPU", GPU_PYTHON, ("pinned_retention",), ("rows.json",)),
    Scenario("text_encoder", "walls 3-4: the text phase's streamed Mistral encoder vs the whole model at full width: "
             "host and VRAM peaks, time, identical hidden states",
             ("bench.text_encoder_stream", "--trainer", "{trainer}", "--work", "{dir}", "--out", "{out}/result.json"),
             "GPU (or `-- --device cpu` at toy sizes)", "the GPU machine's python3, the fork's transformers pin",
             ("text_encoder",), ("result.json",), needs="--tokenizer-from DIR (a FLUX.2 tokenizer folder)"),
    Scenario("int4_kernel", "the 4-bit Linear's GPU path per block Linear shape against bf16 and torchao",
             ("bench.int4_kernel", "--trainer", "{trainer}", "--out", "{out}/kernel.json"),
             "GPU (or `TRITON_INTERPRET=1`, `-- --quick`)", GPU_PYTHON, ("int4_kernel", "int4_kernel_step"),
             ("kernel.json",)),
    Scenario("w4a8_quality", "the quality gate of qtype int4_w4a8 at full FLUX.2 block shapes: 8-bit against bf16 "
             "activations (with and without outlier channels), every W4A8 kernel (triton, scaled_mm) against its "
             "reference with a pass/fail per path, and the block-Linear time of one step for bf16, int4_fused and "
             "every W4A8 path (5 interleaved rounds, medians)",
             ("bench.w4a8_quality", "--trainer", "{trainer}", "--out", "{out}/quality.json", "--time", "5"),
             "GPU (or `-- --tiny` under TRITON_INTERPRET=1)", GPU_PYTHON, ("w4a8_quality",), ("quality.json",)),
    Scenario("compile_time", "seconds to compile each FLUX.2 block class at full width (8 double and 8 single "
             "4-bit blocks with a LoRA, every other one streamed as a memory plan does), cold and warm, per qtype "
             "(int4_w4a8 through torch._scaled_mm, int4_fused): graphs per class, recompile reasons, the compiled "
             "step at 512 px against the uncompiled one",
             ("bench.compile_time", "--trainer", "{trainer}", "--out", "{out}/compile_time.jsonl"),
             "GPU (or `-- --tiny` on the CPU)", "the GPU machine's python3 (the trainer venv (W/venv) with --tiny)",
             (), ("compile_time.jsonl",)),
    Scenario("compiled_step", "the 4-bit step with compiled blocks against bf16's at full width (44 blocks), 512 px, "
             "one child per variant (`-- --variants w4a8@base,bf16,w4a8_slice384,w4a8_hold_fwd,...`, @base: "
             "`--base-trainer`'s code): s/step, then profiled steps charged to `run --profile`'s categories",
             ("bench.compiled_step", "steps", "--trainer", "{trainer}", "--out", "{out}/steps.jsonl"),
             "GPU (or `-- --tiny --backend aot_eager` on the CPU)",
             "the GPU machine's python3 (the trainer venv (W/venv) with --tiny)",
             ("compiled_step", "compiled_step_profile"), ("steps.jsonl",)),
    Scenario("w4a8_parts", "the 8-bit matmul's parts per FLUX.2 block Linear shape at 512 px, per step: bf16 cuBLAS, "
             "int4_w4a8 FP8 as run, its FP8 GEMM, requantization and activation quantization, with the 8-bit weight held, "
             "the sliced Triton GEMM and gemm in_register (the GEMM reads the 4-bit weight), with each path's "
             "error against its reference and against bf16 (`-- --px 1024`: the 1024 px shapes)",
             ("bench.compiled_step", "kernels", "--trainer", "{trainer}", "--out", "{out}/parts.json"),
             "GPU", "the GPU machine's python3", ("w4a8_parts",), ("parts.json",)),
    Scenario("w4a8_gpu", "one GPU call: the self-test's trainer side at 512 and 1024 px (kernel checks, tiny steps, "
             "block-Linear timings), w4a8_quality, and train_step at 512 px for int4_w4a8, bf16 and int4_fused "
             "(the trainer is .bench-carry/trainer)",
             ("bash", "bench/w4a8_gpu.sh"), "GPU", GPU_PYTHON, ("block_linear_time", "w4a8_quality", "w4a8_step"),
             ("selftest.json", "w4a8_quality.json", "step_int4_w4a8.json", "step_bf16.json", "step_int4_fused.json",
              "all.log"), env=(("OUT", "{out}"), ("BUDGET", "520"))),
    Scenario("same_call_run", "bf16 against int4_w4a8 at 512 and 1024 px through `launcher run` on the prepared "
             "full-width root, checkpointing everywhere and the plan's choice, with profiled steps (breakdown.json); "
             "one stage per call, same machine",
             ("bash", "bench/same_call.sh"), "GPU", "the GPU machine's python3", ("same_call_run", "step_profile"),
             env=(("OUT", "{out}"),), needs="STAGE (prepare, then 512, then 1024), with R and M set"),
    Scenario("fallback_cost", "what each fallback path costs at 512 px through `launcher run`, full width, uncompiled, "
             "same machine: int4_fused with and without its Triton kernels, uint4 (no Triton), int4_w4a8 int8 and FP8 "
             "through the Triton GEMM, bf16 weights",
             ("bash", "bench/same_call.sh", "fallback"), "GPU", "the GPU machine's python3", ("fallback_cost",),
             env=(("OUT", "{out}"),), needs="`prepare none` first on the same machine (SKIP_SELFTEST=1 skips the self-test), "
             "with R and M set"),
    Scenario("relaunch", "a launch and relaunches of a preset through `python -m launcher run`: wall time, seconds "
             "to the first step, peak RSS of the trainer and of its process tree, the job's import time",
             ("bench.relaunch", "--workdir", "{workdir}", "--out", "{dir}"),
             "CPU (tiny preset) or GPU machine (Linux)", ANY + " with the launcher installed", ("relaunch",),
             ("rows.jsonl",), stdout_rows=True),
    Scenario("rank_memory", "host memory of each rank of `launcher run --gpus N` against one rank (Linux): peak "
             "anonymous, file-backed and Pss bytes per process and the tree's summed Pss; `--gpu-runtime` alone, on "
             "a GPU, what the runtime adds to a process",
             ("bench.rank_memory", "--workdir", "{workdir}", "--out", "{dir}"),
             "CPU (tiny preset, ranks over gloo)", ANY + " with the launcher installed", ("rank_memory",),
             ("rows.jsonl",), stdout_rows=True),
    Scenario("fullsize_pack", "packs what a full-width `launcher run` needs on an offline GPU machine into "
             ".bench-carry (then carry it along)",
             ("bench.fullsize", "pack", "--workdir", "{workdir}"), "here", ANY + " with the launcher installed",
             needs="--image-freeze FREEZE.txt (the GPU image's `pip freeze`)"),
    Scenario("card_cap", "the VRAM cap at which the 44-block full-width model plans as the whole FLUX.2 does on a "
             "card (same share of block weights resident, then of activations kept): same_call.sh's matched caps",
             ("bench.card_cap",), "here", ANY + " with the launcher installed", needs="--free-gib G (the card's free VRAM)"),
    Scenario("fullsize_prepare", "on the GPU machine: a venv from the carried packages and random-weight assets "
             "(transformer, Mistral3 text encoder, captioned images) under {dir}",
             ("bench.fullsize", "prepare", "--carry", ".bench-carry", "--root", "{dir}"), "GPU", "the GPU machine's python3",
             needs="the sizes, e.g. --single-blocks 36 --image-size 1024 --model-dir M"),
    Scenario("fullsize_launch", "one `python -m launcher run` of a shipped preset on the prepared root: trainer peak "
             "RSS, time to the first step, s/it, VRAM, the memory plan",
             ("bench.fullsize", "launch", "--root", "{dir}", "--json-out", "{out}/launch.json"), "GPU",
             "the GPU machine's python3", ("memory_plan", "fullsize_half", "samples"), ("launch.json",),
             needs="--preset presets/NAME.yaml --label LABEL [--steps N --cap-gib G --set KEY VALUE ...]"),
    Scenario("klein_run", "FLUX.2 klein 9B or 4B in its real shapes (random weights, its Qwen3 encoder) through "
             "`launcher run` of its shipped preset: the first launch, relaunches at the free VRAM of 24 to 8 GB cards, "
             "bf16 uncapped (a label's suffixes: _mN margin, _pN profiled steps, _sN steps, _c compiled); then "
             "`python -m bench.klein_table OUT --write --date DATE` and `python bench/report.py`",
             ("bash", "bench/klein_run.sh"), "GPU", "the GPU machine's python3", ("klein",), env=(("OUT", "{out}"),),
             needs="MODEL LABEL... (klein9b first_22_512 relaunch_7_512 bf16_512), with R and M set"),
]}

# Tables whose figures no scenario makes: where they came from instead.
ELSEWHERE = {
    "stream_pace": ("`bash bench/same_call.sh stream` on the GPU machine after `prepare`, then the 12 and 8 GB "
                    "launches again with SUFFIX=_tail and the previous memory plan (RESULTS.md)"),
    "held_copies": "`bash bench/same_call.sh held` on the GPU machine after `prepare` (RESULTS.md)",
    "traced_copy": "`python3 -m bench.traced_copy` on the GPU machine, one process a row (RESULTS.md)",
    "stream_pinned": ("`bash bench/same_call.sh stream stream_8_512` on the GPU machine after `prepare`, then again "
                      "with SUFFIX=_old and the previous block_streaming.py (RESULTS.md)"),
    "baseline": "a side script before this harness (not the trainer)",
    "lora_matmuls": "`python3 -m bench.compiled_step steps --save-lora LORAS` with the LoRA-precision variants, then "
                    "`python3 -m bench.compiled_step lora-compare LORAS` (both lines in RESULTS.md)",
    "step_profile": "`python -m launcher run --profile 3` (its breakdown.json)",
    "windows_wheels": "`python bench/windows_wheels.py`, which writes the table itself (PyPI downloads, no run)",
    "prediction": "`python bench/predict_step.py`, which writes the table itself and the launcher's rows of it "
                  "(a model of the measured tables, no run)",
    "kernel_isa": "`python bench/kernel_isa.py`, which writes the table itself (Triton compiles on the CPU, no run)",
    # probes of closed questions, archived next to their notes: `python -m bench.archive.NAME` runs one as it ran
    "loader_trim": "`python -m bench.archive.loader_trim_probe` (one size per process, with and without `--release`)",
    "op_call": "`python -m bench.archive.op_call`",
    "w4a4_quality": "`python -m bench.archive.w4a4_quality`",
    "rotation_quality": "`python -m bench.archive.rotation_quality quality`",
    "w4a8_slice": "`bash bench/archive/w4a8_slice.sh` on the GPU machine (.bench-carry carried)",
    "selftest_paths": ("`python -m launcher selftest` (its selftest.json; beside `bash bench/same_call.sh prepare`, "
                       "call 4 through `bash bench/archive/w4a8_slice.sh`)"),
    "first_launch": "`bash bench/same_call.sh first` on the GPU machine, then `python -m bench.first_launch OUT --write`",
    "lora_fidelity": ("`bash bench/same_call.sh fidelity` on the GPU machine, then "
                      "`python -m bench.lora_fidelity write OUT/lora_fidelity.json`"),
    "lora_fidelity_loss": "the same, its loss curves",
    "lora_fidelity_tiny": ("`python -m bench.lora_fidelity tiny` (CPU), then "
                           "`... write OUT/lora_fidelity_tiny.json --name lora_fidelity_tiny`"),
}
