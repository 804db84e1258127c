"""What `python -m launcher selftest` prints: one section per part of the report (machine, kernels,
quality gate, tiny steps, timings, BLAS library, VAE convolution, attention kernels, sampling, streaming,
compiled blocks)
and the verdict `qtype: auto` follows."""

from pathlib import Path


def format_report(report: dict, path: Path) -> list[str]:
    """The self-test as plain text, meant to be pasted whole into a bug report."""
    env = report["environment"]
    trainer = report.get("trainer") or {}
    backend = f"HIP {env['hip']}" if env.get("hip") else f"CUDA {env.get('cuda')}"
    lines = [
        f"flux2-24gb self-test (launcher {report.get('launcher')}), {report.get('created')}",
        f"machine   {env['platform']}, Python {env['python']}",
        f"torch     {env['torch']} ({backend}), Triton {env.get('triton') or 'does not import: ' + env.get('triton_error', '?')}",
        gpu_line(env, report.get("driver")),
        f"trainer   {trainer.get('target')} {str(trainer.get('commit'))[:10]} + {trainer.get('patch_count')} patches, "
        f"overlay {str(trainer.get('overlay'))[:10]}",
    ]
    lines += section("kernels against the plain-PyTorch reference", [c for c in report["checks"] if "candidate" in c])
    lines += section("8-bit activations against bf16 activations (reference path)",
                     [c for c in report["checks"] if "check" in c])
    lines.append("  (`qtype: auto` never picks a format that fails here; a preset naming int4_w4a8 and\n"
                 "   model_kwargs w4a8_activations still uses it)")
    lines += training_lines(report, on_gpu=env.get("gpu") is not None)
    lines += timing_lines(report)
    lines += blas_lines(report.get("blas"))
    lines += convolution_lines(report.get("convolution"))
    lines += attention_lines(report.get("attention"))
    lines += sampling_lines(report)
    lines += streaming_lines(report.get("streaming"))
    lines += compile_lines(report.get("compile"))
    lines += [""] + verdict_lines(report) + [f"written to {path}"]
    return lines


def gpu_line(env: dict, driver: str | None) -> str:
    gpu = env.get("gpu")
    if not gpu:
        return "gpu       NONE: torch sees no GPU, so only the reference path (CPU) was checked; nothing was timed"
    fp8 = "yes" if env.get("fp8_units") else "no (8-bit paths use int8)"
    return f"gpu       {gpu['name']}, {gpu['vram_gib']} GiB, {gpu['arch']}, driver {driver or 'unknown'}, FP8 units: {fp8}"


def section(title: str, checks: list) -> list[str]:
    lines = ["", title] + ([] if checks else ["  not run (they need a GPU and Triton)"])
    for check in checks:
        name = check.get("candidate") or check["check"]
        verdict = "pass" if check["passed"] else "FAIL"
        detail = (f"max relative error {check['max_relative_error']:.1e} (limit {check['tolerance']:.0e})"
                  if "max_relative_error" in check else check.get("error", ""))
        lines.append(f"  {name:<34} {verdict}  {detail}")
    return lines


def training_lines(report: dict, on_gpu: bool) -> list[str]:
    lines = ["", f"3 LoRA steps on the tiny FLUX.2 ({'GPU' if on_gpu else 'CPU, reference path'})"]
    for row in report.get("training", []):
        losses = row.get("losses") or []
        detail = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else row.get("error", "")
        lines.append(f"  {row['candidate']:<34} {'pass' if row['passed'] else 'FAIL'}  {detail}")
    return lines


def blas_lines(check: dict | None) -> list[str]:
    lines = ["", "BLAS library of the bf16 GEMMs (ROCm: hipBLAS against hipBLASLt; `rocm_blas: auto` follows)"]
    if not check:
        return lines + ["  not run by this self-test"]
    if not check.get("ran"):
        return lines + [f"  not timed: {check.get('reason')}"]
    for name, ms in (check.get("step_ms") or {}).items():
        lines.append(f"  {name:<34} " + (f"{ms:8.1f} ms per step" if ms else (check.get("notes") or {}).get(name, "")))
    return lines + [f"  chosen: {check.get('library')} ({check.get('reason')})"]


def convolution_lines(check: dict | None) -> list[str]:
    lines = ["", "a VAE-sized convolution (128 channels, 512x512, bf16) through MIOpen / cuDNN"]
    if not check:
        return lines + ["  not run by this self-test"]
    if not check.get("ran"):
        return lines + [f"  not run: {check.get('reason')}"]
    if check.get("passed"):
        return lines + [f"  pass  {check['library']}, first call {check['first_s']} s, second {check['second_s']} s, "
                        f"difference {check['max_relative_difference']:.1e}",
                        f"  `miopen_find_mode: auto` -> {check['find_mode']} ({check['reason']})"]
    return lines + [f"  FAIL  {check.get('error')}",
                    "  the first launch's VAE encode then retries without it, slower, and says so (docs/selftest.md)"]


def attention_lines(check: dict | None) -> list[str]:
    lines = ["", "attention kernels at a FLUX.2 attention (SDPA backends, forward + backward; `sdpa_kernels: auto` follows)"]
    if not check:
        return lines + ["  not run by this self-test"]
    if not check.get("ran"):
        return lines + [f"  not run: {check.get('reason')}"]
    for label, found in (("", check.get("backends")), (" (experimental)", check.get("with_variable"))):
        for name, row in (found or {}).items():
            detail = f"{row['ms']:8.2f} ms, difference {row['difference']:.1e}" if row.get("ran") else row.get("error")
            lines.append(f"  {name + label:<34} {detail}")
    return lines + [f"  chosen: {check['kernels']} ({check['reason']})"]


def sampling_lines(report: dict) -> list[str]:
    sampling = report.get("sampling")
    if sampling is None:
        return ["", "sampling (wall 6): not checked by this self-test"]
    detail = (f"{sampling.get('size')} px, {sampling.get('steps')} steps, strengths 0 and 1 on the "
              f"{sampling.get('device')} in {sampling.get('seconds')} s" if "seconds" in sampling else sampling.get("error", ""))
    return ["", "sampling the tiny 4-bit FLUX.2 (wall 6; `sample_every` in training needs a pass)",
            f"  {'pass' if sampling.get('passed') else 'FAIL'}  {detail}"]


def timing_lines(report: dict) -> list[str]:
    lines = []
    for shape in report.get("timing", []):
        lines += ["", f"FLUX.2 [dev] block Linears of one step at {shape['image_tokens']} image + "
                      f"{shape['text_tokens']} text tokens x batch {shape['batch']} (2 forwards + 1 input gradient each)"]
        base = next((r["step_ms"] for r in shape["results"] if r["candidate"] == "bf16"), None)
        for row in shape["results"]:
            ratio = f"{row['step_ms'] / base:.2f}x bf16" if base else ""
            lines.append(f"  {row['candidate']:<34} {row['step_ms']:8.1f} ms  {row['tflops']:6.1f} TFLOP/s  {ratio}")
    return lines


def streaming_lines(streaming: dict | None) -> list[str]:
    lines = ["", "overlapped block streaming (copies on a side stream during kernels: wall 5)"]
    if not streaming:
        return lines + ["  not run"]
    if streaming.get("skipped"):
        return lines + [f"  not run: {streaming.get('reason')}", "  presets with `stream_mode: auto` stream serialized"]
    if not streaming.get("completed"):
        return lines + [f"  FAIL  {streaming.get('reason')}", "  presets with `stream_mode: auto` stream serialized"]
    verdict = "pass" if streaming.get("passed") else "FAIL"
    lines.append(f"  {verdict}  {streaming['steps']} steps in {streaming['seconds']} s on the {streaming['device']}"
                 f"{'' if streaming.get('passed') else ': ' + str(streaming.get('reason'))}")
    uses = "overlapped" if streaming.get("passed") and streaming.get("device") == "cuda" else "serialized"
    return lines + [f"  presets with `stream_mode: auto` stream {uses}"]


def compile_lines(check: dict | None) -> list[str]:
    lines = ["", "transformer blocks compiled against uncompiled (a small FLUX.2, forward and backward)"]
    if not check:
        return lines + ["  not run"]
    if "x_eager" in check:
        lines.append(f"  {check['candidate']:<34} {check['compiled_ms']:8.1f} ms compiled, {check['eager_ms']:.1f} ms "
                     f"uncompiled ({check['x_eager']:.2f}x), difference {check['max_relative_difference']:.1e}, "
                     f"{check['compile_s']:.0f} s to compile")
    verdict = "pass" if check.get("passed") else f"FAIL  {check.get('reason')}"
    uses = "compile their blocks" if check.get("passed") else "leave their blocks uncompiled"
    return lines + [f"  {verdict}", f"  presets with `compile_blocks: auto` {uses}"]


def verdict_lines(report: dict) -> list[str]:
    fastest = report.get("fastest") or {}
    if fastest.get("qtype"):
        ratio = f", {fastest['x_bf16']:.2f}x the bf16 time" if fastest.get("x_bf16") else ""
        env = " ".join(f"{k}={v}" for k, v in (fastest.get("env") or {}).items())
        return [f"fastest that passed: {fastest['qtype']} ({fastest['candidate']}){ratio}",
                f"presets with `qtype: auto` use it{' with ' + env if env else ''}"]
    return [f"fastest that passed: none ({fastest.get('reason')})",
            "presets with `qtype: auto` use uint4 (the fork's torchao path)"]
