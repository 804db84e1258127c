"""docs/design.md counts the hand-offs `qtype` takes from the run's config.yaml to the kernel of every
Int4Linear: each row's code must be in its file of this target's checkout, and there are at most 6."""

import importlib
import re
from pathlib import Path

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \| `([^`]+)` \|$", re.M)
MOST = 6


def route() -> list[tuple[str, str, str]]:
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index("## How `qtype` reaches the 4-bit kernel")
    end = text.index("\n## ", start + 1)
    return ROW.findall(text[start:end])


def test_each_documented_hop_is_in_its_file(trainer_on_path):
    rows = route()
    assert 1 <= len(rows) <= MOST, f"{len(rows)} hand-offs from the config to Int4Linear.kernel"
    assert [int(hop) for hop, _, _ in rows] == list(range(1, len(rows) + 1))
    for hop, path, code in rows:
        assert code in (trainer_on_path / path).read_text(encoding="utf-8"), f"hop {hop}: {path} has no `{code}`"


def test_the_name_is_not_turned_into_an_object_and_back(trainer_on_path):
    """The kernel is chosen from the qtype's name: no function takes get_qtype's object to read its name again."""
    quantize = importlib.import_module("toolkit.util.quantize")
    assert not [name for name in vars(quantize) if "int4_activations" in name]
    flux2 = (trainer_on_path / "extensions_built_in/diffusion_models/flux2/flux2_model.py").read_text(encoding="utf-8")
    assert "get_qtype(self.model_config.qtype), self.model_config.model_kwargs" not in flux2
