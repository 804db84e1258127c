"""The qtypes the trainer accepts, asked from its own `get_qtype`:
`python -m launcher.in_trainer.qtypes --trainer DIR`. Prints one JSON list.

The trainer's qtype table is not one literal: the fork keeps torchao's in
`toolkit/util/quantize.py` plus optimum-quanto's, the project's own qtypes are the overlay's
table (`flux2_contract/qtypes.py`: int4_fused, int4_w4a8), and upstream adds backends whose tables are
built by code in other modules. So the candidates are every name those tables hold (dicts,
tuples and module constants of the loaded `toolkit` modules, and optimum-quanto's `qtypes`), and
a candidate is kept only when the trainer's own `get_qtype` accepts it: the launcher refuses
exactly what the trainer would refuse.
"""

import argparse
import json
import sys
from pathlib import Path


def table_names(value) -> set[str]:
    """The names a qtype table holds: a dict's keys, a sequence's strings, a string itself."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, (dict, tuple, list, set, frozenset)):
        return {item for item in value if isinstance(item, str)}
    return set()


def candidates(quantize) -> set[str]:
    """Names from the qtype tables of the loaded trainer modules and the constants of the
    quantize module itself (where a patch names its qtype, e.g. INT4_FUSED)."""
    found = table_names(getattr(quantize, "torchao_qtypes", {})) | table_names(getattr(quantize, "qtypes", {}))
    for name, module in list(sys.modules.items()):
        if module is quantize or (name.startswith("toolkit.") and module is not None):
            for attr, value in vars(module).items():
                if attr.isupper() and (module is quantize or "QTYPE" in attr):
                    found |= table_names(value)
    return found


def accepted(trainer: Path) -> list[str]:
    sys.path.insert(0, str(trainer))
    from flux2_contract import qtypes as project_qtypes
    from toolkit.util import quantize

    def accepts(name: str) -> bool:
        try:
            quantize.get_qtype(name)
        except Exception:
            return False
        return True

    first = candidates(quantize) | set(project_qtypes.QTYPES)
    for name in sorted(first):  # a backend module may be imported on the first lookup
        accepts(name)
    return sorted(name for name in candidates(quantize) | set(project_qtypes.QTYPES) if accepts(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.in_trainer.qtypes")
    parser.add_argument("--trainer", type=Path, required=True)
    args = parser.parse_args(argv)
    print(json.dumps(accepted(args.trainer)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
