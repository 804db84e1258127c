"""The 4-bit Linear's Triton kernels, compiled on the CPU for the consumer GPUs nobody here has.

launcher/in_trainer/kernel_isa.py compiles every kernel of toolkit/int4_kernels.py and toolkit/int4_w4a8.py
with each config the runtime would autotune over on RDNA3 (gfx1100, gfx1101), RDNA4 (gfx1201)
and NVIDIA sm_86 / sm_89 / sm_120, in each 8-bit format that arch would run. These are
deterministic compiler outputs, so the checks are exact: the 8-bit GEMM runs on the int8 matrix
units on RDNA, no kernel spills, shared memory stays within the arch's per-block limit, FP8 is
compiled only where FP8 matrix units exist. One compile of everything (about 90 s of one core
with an empty Triton cache) serves the whole file; the kernels are the overlay's, the same on every
target, so only the first target's suite compiles them.
"""

import importlib

import pytest

from launcher.in_trainer import kernel_isa

pytestmark = pytest.mark.first_target

RDNA = ("gfx1100", "gfx1101", "gfx1201")
FP8_UNITS = {"gfx1100": False, "gfx1101": False, "gfx1201": True, "sm_86": False, "sm_89": True, "sm_120": True,
             "sm_90": True}


@pytest.fixture(scope="module")
def modules(trainer_on_path):
    return tuple(importlib.import_module(name) for name in ("toolkit.int4_kernels", "toolkit.int4_w4a8", "flux2_contract.qtypes"))


@pytest.fixture(scope="module")
def rows(modules):
    return kernel_isa.measure_all()


def described(found: list[dict]) -> str:
    return "\n".join(f"{r['target']} {r['kernel']} {r['variant']} {r['config']}: {r.get('error') or ''}"
                     f"{r.get('registers')} registers, {r.get('scratch_bytes')} B scratch, {r.get('spilled')} spilled, "
                     f"{r.get('shared_bytes')} B shared" for r in found)


def test_every_kernel_of_the_modules_is_compiled_on_every_target(modules, rows):
    kernels = kernel_isa.kernels_of_modules()
    assert {"_dequant_kernel", "_quantize_rows_kernel", "_requantize_kernel", "_scaled_gemm_kernel",
            "_in_register_gemm_kernel"} <= kernels
    for target in kernel_isa.TARGETS:
        assert {r["kernel"] for r in rows if r["target"] == target} == kernels, target


def test_every_compile_succeeds(rows):
    failed = [r for r in rows if r["error"]]
    assert not failed, described(failed)


def test_no_kernel_spills(rows):
    spilled = [r for r in rows if not r["error"] and (r["scratch_bytes"] or r["spilled"])]
    assert not spilled, described(spilled)


def test_shared_memory_fits_the_target(rows):
    """64 KiB of LDS per workgroup on RDNA, 99 KiB per block on the consumer NVIDIA parts."""
    assert {kernel_isa.SHARED_LIMIT[t] // 1024 for t in RDNA} == {64}
    assert {kernel_isa.SHARED_LIMIT[t] // 1024 for t in ("sm_86", "sm_89", "sm_120")} == {99}
    over = [r for r in rows if not r["error"] and r["shared_bytes"] > r["shared_limit"]]
    assert not over, described(over)


def test_the_8bit_gemm_runs_on_int8_matrix_units_on_rdna(rows):
    gemms = [r for r in rows if r["kernel"] in kernel_isa.GEMMS and r["variant"] == "int8" and r["target"] in RDNA]
    assert {(r["target"], r["kernel"]) for r in gemms} == {(t, k) for t in RDNA for k in kernel_isa.GEMMS}
    scalar = [r for r in gemms if r["error"] or "v_wmma_i32_16x16x16_iu8" not in r["instructions"]]
    assert not scalar, described(scalar)


def test_every_gemm_kernel_uses_the_matrix_units_of_its_format(rows):
    """int8 or FP8 matrix instructions for the 8-bit GEMM: nothing falls back to another type (RDNA3
    would widen FP8 to fp16 WMMA)."""
    expected = {("gfx", "int8"): "v_wmma_i32_16x16x16_iu8", ("gfx", "fp8"): "v_wmma_f32_16x16x16_fp8_fp8",
                ("sm", "int8"): ".s8.s8.s32", ("sm", "fp8"): ".e4m3.e4m3.f32"}
    wrong = []
    for r in rows:
        if r["kernel"] in kernel_isa.GEMMS:
            want = expected[("gfx" if r["target"].startswith("gfx") else "sm", r["variant"])]
            if r["error"] or not r["instructions"] or not all(want in name for name in r["instructions"]):
                wrong.append(r)
    assert not wrong, described(wrong) + "\n" + "\n".join(str(r.get("instructions")) for r in wrong)


def test_fp8_only_where_the_arch_has_fp8_matrix_units(modules, rows):
    _, _, qtypes = modules
    assert {arch: qtypes.arch_has_fp8_units(arch) for arch in FP8_UNITS} == FP8_UNITS
    for target in kernel_isa.TARGETS:
        variants = {r["variant"].split()[0] for r in rows if r["target"] == target}
        assert ("fp8" in variants) == FP8_UNITS[target], (target, variants)
    misplaced = [r for r in rows if kernel_isa.uses_fp8_matrix(r) and not FP8_UNITS[r["target"]]]
    assert not misplaced, described(misplaced)


def test_rdna_occupancy_formula_matches_llvm(rows):
    """waves per SIMD = min(16, 1536 // (VGPRs rounded up to 24)), as LLVM prints it in the assembly."""
    amd = [r for r in rows if r["target"] in RDNA and not r["error"]]
    assert amd and all(r["occupancy"] == r["compiler_occupancy"] for r in amd), described(amd)
    assert (kernel_isa.rdna_waves(231), kernel_isa.rdna_waves(256), kernel_isa.rdna_waves(40)) == (6, 5, 16)


def test_the_runtime_autotunes_over_the_lists_that_are_checked(modules):
    """The autotuned kernel, the 8-bit GEMM, takes its configs from the same per-arch function the
    check compiles, for the arch of the current device (sm_90's list where no GPU is visible)."""
    ik, w, _ = modules
    arch = ik.tuning_arch()

    def shape(configs):
        return [(c.kwargs, c.num_warps, c.num_stages) for c in configs]

    assert shape(w._scaled_gemm_kernel.configs) == shape(w.gemm_configs(arch))
    in_register = w._in_register_gemm_kernel
    for fp8 in (True, False):  # the autotuner's early prune leaves each format the list compiled for it
        kept = in_register.early_config_prune(in_register.configs, {}, FP8=fp8)
        assert shape(kept) == shape(w.in_register_configs(arch, fp8)) and kept, fp8
    assert len(w.in_register_configs("sm_90", False)) < len(w.in_register_configs("sm_90", True))
    assert {arch: ik.config_family(arch) for arch in ("gfx1100", "gfx1201", "sm_86", "sm_89", "sm_120", "sm_90")} == {
        "gfx1100": "amd", "gfx1201": "amd", "sm_86": "nvidia_99k", "sm_89": "nvidia_99k", "sm_120": "nvidia_99k",
        "sm_90": "nvidia"}


def test_the_card_profiles_follow_the_runtime_s_fp8_rule(modules):
    """`launcher.selftest.cards` works out each card's self-test on paper: its FP8 flag must be the
    rule the runtime applies on that card."""
    from launcher.selftest.cards import CARDS

    _, _, qtypes = modules
    assert {card.arch for card in CARDS} >= set(kernel_isa.TARGETS)
    assert all(card.fp8_units == qtypes.arch_has_fp8_units(card.arch) for card in CARDS), CARDS
