"""The memory plan's VRAM budget (overlay toolkit/memory_budget.py budget_bytes) counts what the
caching allocator holds but no tensor uses as free: on a first launch the text phase leaves its
encoder layers and activations cached there, and a budget short of them made the plan stream blocks
that a relaunch keeps resident. Checked against a stand-in allocator on any machine, and on a GPU."""

import pytest
import torch

pytestmark = pytest.mark.first_target
GIB = 2**30


class Allocator:
    """torch.cuda's memory figures for one 24 GiB card: `in_use` bytes of tensors, `cached` more
    reserved by the allocator, `others` used outside it (the context, other processes)."""

    def __init__(self, in_use, cached, others=GIB // 2, total=24 * GIB):
        self.in_use, self.cached, self.others, self.total = in_use, cached, others, total
        self.fraction = 1.0

    def reserved(self, device=None):
        return self.in_use + self.cached

    def empty_cache(self):
        self.cached = 0

    def mem_get_info(self, device=None):
        return self.total - self.others - self.reserved(), self.total

    def set_fraction(self, fraction, device=None):
        self.fraction = fraction

    def install(self, monkeypatch):
        for name, value in {"is_available": lambda: True, "current_device": lambda: 0,
                            "mem_get_info": self.mem_get_info, "memory_reserved": self.reserved,
                            "empty_cache": self.empty_cache, "get_per_process_memory_fraction": lambda d=None: self.fraction,
                            "set_per_process_memory_fraction": self.set_fraction}.items():
            monkeypatch.setattr(torch.cuda, name, value)


@pytest.fixture(scope="module")
def memory_budget(trainer_on_path):
    from toolkit import memory_budget

    return memory_budget


@pytest.mark.parametrize("kwargs, budget", [
    ({"vram_margin_gib": 0}, 24 * GIB - GIB // 2 - GIB),  # the card's free VRAM, the cache counted free
    ({"vram_margin_gib": 0, "vram_budget_gib": 22}, 21 * GIB),  # the preset's cap, less the tensors in use
], ids=["free-vram", "preset-budget"])
def test_cached_but_unused_memory_counts_as_free(memory_budget, monkeypatch, kwargs, budget):
    allocator = Allocator(in_use=GIB, cached=3 * GIB)
    allocator.install(monkeypatch)
    assert memory_budget.budget_bytes(kwargs, "cuda") == budget


@pytest.mark.gpu
def test_on_the_gpu_the_budget_includes_what_the_allocator_caches(memory_budget):
    block = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    del block  # cached by the allocator, used by no tensor
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 512 * 2**20
    budget = memory_budget.budget_bytes({"vram_margin_gib": 0}, "cuda")
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    assert budget >= free - 64 * 2**20, f"budget {budget / GIB:.2f} GiB, {free / GIB:.2f} GiB free once released"
