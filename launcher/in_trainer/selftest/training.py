"""The self-test's training check: a few LoRA steps on the tiny FLUX.2, one run per candidate.

The model is the trainer's own FLUX.2 (its `src/model.py`, loaded by path: it needs only
torch and einops), at the embedded tiny shape, with every block Linear turned into the
trainer's Int4Linear in the candidate's activation mode. The adapter is a plain rank-4 LoRA
(y = base(x) + up(down(x)), up starting at zero) on each of those Linears, trained with AdamW
on one fixed batch; the base stays frozen. A candidate passes when every loss is finite,
every adapter got a gradient and the loss went down. The whole trainer (data loading, its own
LoRA classes, checkpoints) is exercised by `python -m launcher run tiny` instead.
"""

import importlib.util
import sys
from pathlib import Path

from launcher.in_trainer.selftest.kernels import Modules
from launcher.in_trainer.tiny_assets import FLUX2_PARAMS

MODEL_FILE = Path("extensions_built_in/diffusion_models/flux2/src/model.py")
STEPS = 3
RANK = 4
LEARNING_RATE = 1e-2


def load_flux2(trainer: Path):
    """The fork's FLUX.2 model module, by path (no package imports, no diffusers)."""
    spec = importlib.util.spec_from_file_location("selftest_flux2_model", trainer / MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def with_lora(m: Modules, model, rank: int, kinds: tuple = (), where=None) -> list:
    """Wrap every Linear of the `kinds` (default: Int4Linear) for which `where(name, module)` holds
    (default: all) in a LoRA; returns the adapters' parameters, down and up for each."""
    torch = m.torch
    kinds = kinds or (m.int4.Int4Linear,)

    class LoRA(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.down = torch.nn.Linear(base.in_features, rank, bias=False, dtype=torch.bfloat16)
            self.up = torch.nn.Linear(rank, base.out_features, bias=False, dtype=torch.bfloat16)
            torch.nn.init.zeros_(self.up.weight)

        def forward(self, x):
            return self.base(x) + self.up(self.down(x))

    params = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full_name = f"{name}.{child_name}" if name else child_name
            if isinstance(child, kinds) and (where is None or where(full_name, child)):
                adapter = LoRA(child)
                setattr(module, child_name, adapter)
                params += [adapter.down.weight, adapter.up.weight]
    return params


def tiny_batch(torch, device, side: int = 4, text_tokens: int = 8, in_channels: int = FLUX2_PARAMS["in_channels"],
               context_in_dim: int = FLUX2_PARAMS["context_in_dim"]):
    """One fixed batch of one: `side` x `side` image tokens (default a 4 x 4 grid), `text_tokens`
    text tokens (default 8), for a FLUX.2 of these input widths (default the tiny one), and a target."""
    g = torch.Generator().manual_seed(1)
    image_tokens = side * side
    grid = torch.meshgrid(torch.arange(1), torch.arange(side), torch.arange(side), torch.arange(1), indexing="ij")
    ctx_ids = torch.zeros(1, text_tokens, 4, dtype=torch.long)
    ctx_ids[..., 3] = torch.arange(text_tokens)
    batch = dict(
        x=torch.randn(1, image_tokens, in_channels, generator=g),
        x_ids=torch.stack(grid, dim=-1).reshape(1, image_tokens, 4),
        timesteps=torch.tensor([0.5]),
        ctx=torch.randn(1, text_tokens, context_in_dim, generator=g),
        ctx_ids=ctx_ids,
        guidance=torch.tensor([4.0]),
    )
    target = torch.randn(1, image_tokens, in_channels, generator=g)
    cast = {k: (v.to(device, torch.bfloat16) if v.is_floating_point() else v.to(device)) for k, v in batch.items()}
    return cast, target.to(device)


def train_candidate(m: Modules, flux2, candidate: dict, device) -> dict:
    """STEPS optimizer steps of the tiny model with this candidate's 4-bit Linears."""
    torch = m.torch
    torch.manual_seed(0)
    model = flux2.Flux2(flux2.Flux2Params(**FLUX2_PARAMS)).to(torch.bfloat16)
    model.requires_grad_(False)
    m.int4.quantize_linears(model, lambda name, _: name.split(".")[0] in ("double_blocks", "single_blocks"))
    m.int4.configure_linears(model, candidate["qtype"], candidate.get("kernel"), device)
    params = with_lora(m, model, RANK)
    model.to(device)
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE)
    batch, target = tiny_batch(torch, device)
    losses, all_grads = [], True
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(**batch).float(), target)
        loss.backward()
        all_grads = all_grads and all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in params)
        optimizer.step()
        losses.append(float(loss.detach()))
    finite = all(loss == loss and abs(loss) != float("inf") for loss in losses)
    passed = finite and all_grads and losses[-1] < losses[0]
    return {"candidate": candidate["name"], "passed": passed, "losses": losses, "adapters": len(params) // 2}


def train_all(m: Modules, trainer: Path, candidates: list, device, log) -> list:
    flux2 = load_flux2(trainer)
    results = []
    for candidate in candidates:
        try:
            result = train_candidate(m, flux2, candidate, device)
        except Exception as error:  # a path that cannot train here is the finding
            result = {"candidate": candidate["name"], "passed": False, "error": f"{type(error).__name__}: {error}"[:800]}
        log(f"  {STEPS} tiny steps, {candidate['name']}: {'pass' if result['passed'] else 'FAIL'} "
            + (" ".join(f"{loss:.4f}" for loss in result.get("losses", [])) or result.get("error", "")))
        results.append(result)
    return results
