"""Where a training step's time goes, read from the profiler's Chrome trace (`run --profile N`).

The top-20 table ranks operators; the question a speed-up needs answered is coarser: of one
step, how much is block GEMMs, the 4-bit requantization, attention, the elementwise chains
(norms, modulation, RoPE, activations, casts), the LoRA matmuls, the optimizer, copies, and
how long the GPU waits for the host. Each GPU kernel is charged to one category: by its own
name (Triton kernels are named after their function), else by the operator that launched it
(the trace's "External id" links the two) and that operator's shapes (a matmul with a dimension
between 2 and 256 is a LoRA factor; block Linears are thousands wide), else by the operators
around it (optimizer, attention). Kernels also split by phase: forward, backward (which holds
the recomputed forward under gradient checkpointing) and optimizer.

Stdlib only: it runs inside the trainer after the profile is written, and the test reads a
synthetic trace with plain Python.
"""

import json

CATEGORIES = ("block GEMMs", "requantization", "attention", "elementwise", "LoRA matmuls",
              "optimizer", "copies")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "aten::_scaled_mm", "aten::addmv", "aten::mv"}
LORA_MAX_RANK = 256
KERNEL_EVENTS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load_trace(path: str) -> list:
    with open(path, encoding="utf-8") as handle:
        trace = json.load(handle)
    return trace.get("traceEvents", []) if isinstance(trace, dict) else trace


def breakdown(events: list, wall_s: float, steps: int) -> dict:
    """Milliseconds per step by category and by phase, the GPU's busy and idle time, data wait."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    host = [e for e in spans if e.get("cat") in ("cpu_op", "user_annotation")]
    launched_by = {}
    for event in host:
        external = (event.get("args") or {}).get("External id")
        if external is not None and (external not in launched_by or event.get("cat") == "cpu_op"):
            launched_by[external] = event
    ancestors = _ancestors(host)
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    by_phase = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    intervals = []
    for kernel in (e for e in spans if e.get("cat") in KERNEL_EVENTS):
        op = launched_by.get((kernel.get("args") or {}).get("External id"))
        outer = ancestors.get(id(op), []) if op is not None else []
        by_category[categorize(kernel, op, outer)] += kernel["dur"]
        by_phase[phase(outer)] += kernel["dur"]
        intervals.append((kernel["ts"], kernel["ts"] + kernel["dur"]))
    busy = _union_length(intervals)
    data_wait = sum(e["dur"] for e in host if "DataLoader" in e.get("name", "") and "__next__" in e.get("name", ""))
    per_step = 1e-3 / max(steps, 1)  # microseconds in the trace -> milliseconds per step
    wall_ms = wall_s * 1e3 / max(steps, 1)
    return {
        "steps": steps,
        "step_ms": round(wall_ms, 2),
        "category_ms": {name: round(value * per_step, 2) for name, value in by_category.items()},
        "phase_ms": {name: round(value * per_step, 2) for name, value in by_phase.items()},
        "gpu_busy_ms": round(busy * per_step, 2),
        "gpu_idle_ms": round(max(wall_ms - busy * per_step, 0.0), 2),
        "data_wait_ms": round(data_wait * per_step, 2),
    }


def categorize(kernel: dict, op, outer: list) -> str:
    name = kernel.get("name", "").lower()
    if kernel.get("cat") in ("gpu_memcpy", "gpu_memset") or name.startswith(("memcpy", "memset")):
        return "copies"
    names = [e.get("name", "") for e in outer] + ([op.get("name", "")] if op is not None else [])
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if "quantize" in name or "requant" in name:
        return "requantization"
    if any(word in name for word in ("flash", "fmha", "attention", "attn")) or any(
            "scaled_dot_product" in n or "attention" in n for n in names):
        return "attention"
    if op is not None and op.get("name") in GEMM_OPS:
        return "LoRA matmuls" if _is_lora_shape((op.get("args") or {}).get("Input Dims")) else "block GEMMs"
    if any(word in name for word in ("gemm", "matmul", "_mm_", "xmma", "nvjet", "cutlass")):
        return "block GEMMs"
    return "elementwise"


def phase(outer: list) -> str:
    names = [e.get("name", "") for e in outer]
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any(n.startswith("autograd::engine::evaluate_function") for n in names):
        return "backward"
    return "forward"


def _is_lora_shape(dims) -> bool:
    """A LoRA factor has a dimension between 2 and LORA_MAX_RANK (its rank); a block Linear's are
    thousands wide, and a batch-1 modulation GEMV has 1 where a LoRA would have its rank."""
    matrices = [d for d in (dims or []) if isinstance(d, list) and len(d) >= 2]
    return any(2 <= size <= LORA_MAX_RANK for matrix in matrices for size in matrix[-2:])


def _ancestors(host: list) -> dict:
    """{id(event): the events enclosing it on its thread}, by time containment."""
    found = {}
    by_thread = {}
    for event in host:
        by_thread.setdefault((event.get("pid"), event.get("tid")), []).append(event)
    for events in by_thread.values():
        stack = []
        for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < event["ts"] + event["dur"]:
                stack.pop()
            found[id(event)] = list(stack)
            stack.append(event)
    return found


def _union_length(intervals: list) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def format_summary(result: dict, gpu: bool) -> str:
    """One line: the window's wall time and, with a GPU, how much of it the GPU was busy. Busy is
    the union of the kernels' intervals, as in the breakdown: the profiler's per-operator device
    totals count a compiled region's kernels more than once (an H100 step read 251 % busy)."""
    wall_ms = result["step_ms"] * result["steps"]
    line = f"{result['steps']} steps in {wall_ms / 1e3:.3f} s wall ({result['step_ms'] / 1e3:.3f} s/step)"
    if gpu:
        busy_ms = result["gpu_busy_ms"] * result["steps"]
        line += (f", GPU busy {busy_ms / 1e3:.3f} s ({100 * busy_ms / max(wall_ms, 1e-9):.0f} %), "
                 f"not busy {(wall_ms - busy_ms) / 1e3:.3f} s: host work, syncs and data loading")
    return line


def format_table(result: dict) -> str:
    lines = [f"step breakdown, ms per step ({result['steps']} steps, {result['step_ms']} ms/step wall)"]
    for name, value in result["category_ms"].items():
        lines.append(f"  {name:<16} {value:>10.2f}")
    lines.append("  " + ", ".join(f"{name} {value:.2f}" for name, value in result["phase_ms"].items()))
    lines.append(f"  GPU busy {result['gpu_busy_ms']:.2f}, GPU idle (host work, syncs, data) "
                 f"{result['gpu_idle_ms']:.2f}, waiting for the data loader {result['data_wait_ms']:.2f}")
    return "\n".join(lines)
