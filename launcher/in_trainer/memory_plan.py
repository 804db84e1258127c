"""The trainer's memory plan for a budget, asked from its own `toolkit/memory_plan.py`:
`python -m launcher.in_trainer.memory_plan --trainer DIR --budget-gib G --resolution R
[--batch B] [--rank N] [--in-flight 1|2] [--flux2-params JSON]`. Prints one JSON object:
{"plan": ..., "summary": [lines]} or {"error": "..."} (exit 2).

`run` asks it before launching (and `run --dry-run` prints the plan), so the launcher refuses
a budget the trainer would refuse, by the trainer's own rule, with no copy of that rule here.
"""

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    index = argv.index("--trainer")
    trainer = Path(argv[index + 1])
    del argv[index:index + 2]
    sys.path.insert(0, str(trainer.resolve()))
    from toolkit import memory_plan

    return memory_plan.main(argv)


if __name__ == "__main__":
    sys.exit(main())
