#!/usr/bin/env python3
"""The VRAM cap under which the benchmark's shallower FLUX.2 plans like the full model on a card.

The full-width runs leave blocks out (`flux2_params: {depth_single_blocks: 36}`: 44 of 56 blocks)
to fit a disk. Lowering a card's free VRAM by the left-out blocks' weights is right when the
full model would keep them resident (a 22 GiB card), but on a card whose plan streams those
blocks it takes their bytes off the budget twice: a 12 GB card (~11 GiB free) becomes an 8.3 GiB
cap whose plan streams more of its blocks than the full model streams on that card, and an 8 GB
card's 3.8 GiB cap cannot hold a plan that the full model's 7 GiB can.

What a step costs beside its compute is the share of block bytes it copies in, so this cap is
the smallest at which the shallower model keeps on the device at least the share of its block
weights the full model keeps on the card, and then at least the share of its blocks whose
activations are kept. Both plans come from the trainer's own planner (overlay
`flux2_contract/memory_plan.py`) from the shapes, with its default margin.

    python -m bench.card_cap --free-gib 11 [--resolution 512] [--single-blocks 36]
"""

import argparse
import json
import sys

from flux2_contract import memory_plan

STEP_GIB = 0.05


def shares(plan) -> tuple[float, float]:
    """(resident share of the block weights, share of blocks whose activations are kept)."""
    total = plan.resident_weight_bytes + plan.streamed_weight_bytes
    return plan.resident_weight_bytes / total, len(plan.kept()) / len(plan.blocks)


def emulated_cap(free_gib: float, resolution: int = 512, single_blocks: int = 36) -> dict:
    """The cap for a model of `single_blocks` single-stream blocks that plans like the full FLUX.2
    [dev] on a card with `free_gib` free, and both plans' figures."""
    full = memory_plan.plan_for_budget(free_gib, resolution)
    wanted = shares(full)
    params = {"depth_single_blocks": single_blocks}
    cap = STEP_GIB
    while cap <= free_gib:
        try:
            plan = memory_plan.plan_for_budget(cap, resolution, flux2_params=params)
        except memory_plan.PlanError:
            plan = None
        if plan is not None and shares(plan) >= wanted:
            break
        cap = round(cap + STEP_GIB, 2)
    else:
        raise ValueError(f"no cap up to the card's {free_gib} GiB free plans like the full model at {resolution} px")
    return {"free_gib": free_gib, "resolution": resolution, "cap_gib": cap, "full": describe(full),
            "shallow": describe(plan)}


def describe(plan) -> dict:
    resident, kept = shares(plan)
    return {"blocks": len(plan.blocks), "streamed_gib": round(plan.streamed_weight_bytes / 2**30, 2),
            "resident_share": round(resident, 3), "kept_blocks": len(plan.kept())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.card_cap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--free-gib", type=float, required=True, help="the card's VRAM free for training")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--single-blocks", type=int, default=36, help="the benchmark model's single-stream blocks")
    args = parser.parse_args(argv)
    try:
        print(json.dumps(emulated_cap(args.free_gib, args.resolution, args.single_blocks)))
    except ValueError as error:  # the planner's PlanError included: the full model does not fit
        print(f"bench.card_cap: the full FLUX.2 has no plan with {args.free_gib} GiB free: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
