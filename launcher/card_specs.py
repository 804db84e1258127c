"""The public figures the step prediction scales the H200's measured step by, one row a card.

`bench/predict_step.py` predicts a card's s/it from these, and the launcher holds a run's step
against the rows it writes (`launcher/step_prediction.py`, which reads a card's bandwidth here for
the math attention's traffic): one table of card figures for both. Tensor rates are
dense (not sparse) with FP32 accumulation: what cuBLAS's and hipBLAS's bf16 GEMMs and
`torch._scaled_mm`'s FP8 GEMMs accumulate in (GeForce cards run it at half their FP16-accumulate
rate, which the product pages' "AI TOPS" quote). The card's name, arch and memory are the card
table's where it has a row (`presets/cards.csv`; tests/test_card_specs.py holds the two together);
whether an arch multiplies FP8 is the runtime's rule (`qtypes.arch_has_fp8_units`), not a figure here.

What a card's bf16 GEMMs really reach at FLUX.2's block shapes is the prediction's named
assumption, a range (`gemm_rates`):
- AMD: the published hipBLAS measurements of the RX 7900 XTX (RATE_RANGE, central CENTRAL_RATE:
  bench/predict_step.py names them), the other RDNA3 cards by their bf16 peak relative to it;
- NVIDIA: the fraction of its dense bf16 peak the H200 reached at those shapes (a measurement,
  bench/results/block_linear_time.csv, that bench/predict_step.py reads and passes in), at the card's
  base clock (slow end), between its base and boost (central) and at its rated boost clock (fast end).
"""

from dataclasses import dataclass

CENTRAL_RATE = 77.0  # TFLOP/s: the RX 7900 XTX's central bf16 GEMM rate through hipBLAS
RATE_RANGE = (46.3, 99.4)  # the low and high published bf16 GEMM rates of the RX 7900 XTX
H200_BF16_TFLOPS = 989.4  # dense bf16 peak (NVIDIA H200 product page: 1,979 TFLOPS with sparsity)
H200_FP8_TFLOPS = 1978.9  # dense FP8 peak (the same page: 3,958 TFLOPS with sparsity)
H200_BANDWIDTH_GBS = 4800.0  # NVIDIA H200 product page
PCIE_EFFECTIVE = 25.0 / 31.5
"""The share of a PCIe link's raw rate a host-to-device copy of pinned memory reaches (25 GB/s of
PCIe 4.0 x16's 31.5)."""
PCIE_LANE_GBS = {4: 31.5 / 16, 5: 63.0 / 16}  # raw GB/s a lane, by PCIe generation


@dataclass(frozen=True)
class CardSpec:
    name: str
    arch: str
    memory_gb: int
    bf16_tflops: float
    """Dense bf16 tensor rate, FP32 accumulation, at the rated boost clock (RDNA3: its FP16 peak)."""
    int8_tops: float
    """Dense int8 tensor rate (RDNA3: its bf16 rate, the WMMA multiplies int8 at its fp16 rate)."""
    int4_tops: float | None
    """Dense int4 tensor rate (RDNA3: twice its int8 rate); None where not published."""
    fp8_tflops: float | None
    """Dense FP8 tensor rate with FP32 accumulation; None where the arch has no FP8 matrix units."""
    bandwidth_gbs: float
    pcie: tuple[int, int]
    """PCIe generation and lanes: the link streamed blocks cross."""
    clocks_mhz: tuple[int, int] | None
    """Base and rated boost clock (NVIDIA); None where the rate range is the measured one (AMD)."""
    source: str

    @property
    def hip(self) -> bool:
        return self.arch.startswith("gfx")

    @property
    def pcie_gbs(self) -> float:
        """What a copy of pinned host memory reaches over the card's link."""
        generation, lanes = self.pcie
        return PCIE_LANE_GBS[generation] * lanes * PCIE_EFFECTIVE

    def peak(self, fmt: str) -> float:
        """The dense tensor rate of `fmt` (bf16, fp8, int8, int4); one the card has no figure for is an error."""
        rate = {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "int8": self.int8_tops, "int4": self.int4_tops}[fmt]
        if rate is None:
            raise ValueError(f"the {self.name} ({self.arch}) has no {fmt} tensor rate in launcher/card_specs.py")
        return rate


AMD_PAGE = ("AMD product page (amd.com, Radeon RX 7000 series specifications: FP16 peak, bandwidth, memory, PCIe); "
            "int8 and int4: RDNA3's WMMA at 1x and 2x its fp16 rate (AMD RDNA3 ISA reference guide)")
ADA = "NVIDIA Ada GPU Architecture whitepaper, appendix A (GeForce RTX {card})"
SPECS = {spec.name: spec for spec in (
    CardSpec("RX 7900 XTX", "gfx1100", 24, 122.8, 122.8, 245.6, None, 960.0, (4, 16), None, AMD_PAGE),
    CardSpec("RX 7900 XT", "gfx1100", 20, 103.0, 103.0, 206.0, None, 800.0, (4, 16), None, AMD_PAGE),
    CardSpec("RX 7800 XT", "gfx1101", 16, 74.6, 74.6, 149.2, None, 624.0, (4, 16), None, AMD_PAGE),
    CardSpec("RTX 4090", "sm_89", 24, 165.2, 660.6, 1321.2, 330.3, 1008.0, (4, 16), (2235, 2520), ADA.format(card="4090")),
    CardSpec("RTX 4080", "sm_89", 16, 97.5, 389.9, 779.8, 194.9, 716.8, (4, 16), (2205, 2505), ADA.format(card="4080")),
    CardSpec("RTX 4070 Ti Super", "sm_89", 16, 88.2, 352.8, 705.6, 176.4, 672.0, (4, 16), (2340, 2610),
             "NVIDIA's product page (66 SMs, 2.34/2.61 GHz, 706 AI TOPS = FP8 sparse with FP16 accumulation, 4x the "
             "dense FP32-accumulate rate; 16 GB at 672 GB/s) and the Ada whitepaper's rate per SM and clock"),
    CardSpec("RTX 3090", "sm_86", 24, 71.0, 284.0, 568.0, None, 936.0, (4, 16), (1395, 1695),
             "NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix A (GeForce RTX 3090)"),
    CardSpec("RTX 5090", "sm_120", 32, 209.5, 838.0, None, 419.0, 1792.0, (5, 16), (2017, 2407),
             "NVIDIA RTX Blackwell GPU Architecture whitepaper, appendix (GeForce RTX 5090; no int4 rate given)"),
)}


def gemm_rates(card: str, h200_gemm_tflops: float) -> tuple[float, float, float]:
    """The card's bf16 GEMM rate at FLUX.2's block shapes, TFLOP/s: (slow end, central, fast end);
    `h200_gemm_tflops`: what the H200's block Linears reached, the share of its peak an NVIDIA card reaches."""
    spec = SPECS[card]
    if spec.clocks_mhz is None:
        relative = spec.bf16_tflops / SPECS["RX 7900 XTX"].bf16_tflops
        return RATE_RANGE[0] * relative, CENTRAL_RATE * relative, RATE_RANGE[1] * relative
    base, boost = spec.clocks_mhz
    reached = spec.bf16_tflops * h200_gemm_tflops / H200_BF16_TFLOPS
    return reached * base / boost, reached * (base + boost) / 2 / boost, reached
