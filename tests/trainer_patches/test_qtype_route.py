"""The hand-offs `qtype` takes from the run's config.yaml to the kernel of every Int4Linear, found on
the AST of this target's checkout: at most 6, and docs/design.md's table names each one, in order.

The route is followed in code, not read from the doc: ModelConfig's assignment of the config's
`qtype`, the train process's hand-over of its ModelConfig to the model class, then from the one call
that passes `model_config.qtype` into a module of the overlay, the name's way through calls,
a table lookup and the assignment of what it chose."""

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \| `([^`]+)` \|$", re.M)
MOST = 6
CONFIG = "toolkit/config_modules.py"
TRAIN_PROCESS = "jobs/process/BaseSDTrainProcess.py"
FLUX2 = "extensions_built_in/diffusion_models/flux2/flux2_model.py"


@dataclass(frozen=True)
class Hop:
    path: str
    code: str  # the source of the statement or expression that hands the name on


class Checkout:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self.trees:
            self.trees[path] = ast.parse((self.root / path).read_text(encoding="utf-8"))
        return self.trees[path]

    def source(self, path: str, node: ast.AST) -> str:
        return ast.get_source_segment((self.root / path).read_text(encoding="utf-8"), node)

    def callee(self, path: str, call: ast.Call) -> tuple[str, ast.FunctionDef] | None:
        """(path, def) of a call's function where it is a top-level function of a module of the
        project's overlay: defined in `path` itself or imported from one by name."""
        if not isinstance(call.func, ast.Name):
            return None
        name = call.func.id
        for node in self.tree(path).body:
            if isinstance(node, ast.FunctionDef) and node.name == name and is_project_file(path):
                return path, node
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
                package = path.rpartition("/")[0].replace("/", ".")
                module = f"{package}.{node.module}" if node.level == 1 else node.module or ""
                target = module.replace(".", "/") + ".py"
                if is_project_file(target) and (self.root / target).is_file():
                    original = next(a.name for a in node.names if (a.asname or a.name) == name)
                    found = [d for d in self.tree(target).body if isinstance(d, ast.FunctionDef) and d.name == original]
                    return (target, found[0]) if found else None
        return None


def is_project_file(path: str) -> bool:
    """A module the project adds to the trainer: the overlay's, or the contract package's."""
    return (REPO / "overlay" / path).is_file() or (path.startswith("flux2_contract/") and (REPO / path).is_file())


def follow(checkout: Checkout, path: str, function: ast.FunctionDef, names: set[str]) -> list[Hop]:
    """The hops of a value held by `names` inside `function`: a call of a project function that is
    handed it (then the hops inside that function, and the name its result is bound to), a lookup
    in a module-level table, an assignment of it to an attribute."""
    hops: list[Hop] = []
    tables = {target.id for node in checkout.tree(path).body if isinstance(node, (ast.Assign, ast.AnnAssign))
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(target, ast.Name)}
    tables |= {a.asname or a.name for node in checkout.tree(path).body if isinstance(node, ast.ImportFrom) for a in node.names}
    statements = sorted((n for n in ast.walk(function) if isinstance(n, (ast.Assign, ast.Expr, ast.Return))),
                        key=lambda n: n.lineno)
    for statement in statements:
        value = statement.value
        if isinstance(value, ast.Call) and (at := [i for i, a in enumerate(value.args)
                                                   if isinstance(a, ast.Name) and a.id in names]):
            inner = checkout.callee(path, value)
            if inner is not None:
                hops.append(Hop(path, checkout.source(path, statement)))
                params = [a.arg for a in inner[1].args.args]
                hops += follow(checkout, *inner, {params[i] for i in at})
                if isinstance(statement, ast.Assign):
                    names |= {t.id for t in statement.targets if isinstance(t, ast.Name)}
            elif isinstance(value.func, ast.Attribute) and value.func.attr == "get" \
                    and isinstance(value.func.value, ast.Name) and value.func.value.id in tables:
                hops.append(Hop(path, checkout.source(path, statement)))
        elif isinstance(statement, ast.Assign) and isinstance(value, ast.Name) and value.id in names \
                and all(isinstance(t, ast.Attribute) for t in statement.targets):
            hops.append(Hop(path, checkout.source(path, statement)))
    return hops


def is_model_config_qtype(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "qtype" and isinstance(node.value, ast.Attribute)
            and node.value.attr == "model_config")


def route(root: Path) -> list[Hop]:
    checkout = Checkout(root)
    model_config = next(node for node in checkout.tree(CONFIG).body
                        if isinstance(node, ast.ClassDef) and node.name == "ModelConfig")
    taken = [node for node in ast.walk(model_config) if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Attribute) and t.attr == "qtype" for t in node.targets)
             and isinstance(node.value, ast.Call) and node.value.args and getattr(node.value.args[0], "value", None) == "qtype"]
    assert len(taken) == 1, "ModelConfig takes `qtype` from the config's model block once"
    handed = [keyword for keyword in ast.walk(checkout.tree(TRAIN_PROCESS))
              if isinstance(keyword, ast.keyword) and keyword.arg == "model_config"]
    assert len(handed) == 1, "the train process hands its ModelConfig to the model class once"
    hops = [Hop(CONFIG, checkout.source(CONFIG, taken[0])), Hop(TRAIN_PROCESS, checkout.source(TRAIN_PROCESS, handed[0]))]
    model = checkout.tree(FLUX2)
    into_project = [(function, call) for function in ast.walk(model) if isinstance(function, ast.FunctionDef)
                    for call in ast.walk(function) if isinstance(call, ast.Call)
                    and any(is_model_config_qtype(a) for a in call.args) and checkout.callee(FLUX2, call)]
    assert len(into_project) == 1, [ast.unparse(call) for _, call in into_project]
    function, call = into_project[0]
    hops.append(Hop(FLUX2, checkout.source(FLUX2, call)))
    inner_path, inner = checkout.callee(FLUX2, call)
    params = [a.arg for a in inner.args.args]
    hops += follow(checkout, inner_path, inner, {params[i] for i, a in enumerate(call.args) if is_model_config_qtype(a)})
    return hops


def documented() -> list[tuple[str, str, str]]:
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index("## How `qtype` reaches the 4-bit kernel")
    end = text.index("\n## ", start + 1)
    return ROW.findall(text[start:end])


def test_the_route_in_code_is_short_and_the_doc_names_each_hop(trainer_on_path):
    hops = route(trainer_on_path)
    assert len(hops) <= MOST, hops
    assert [(str(n), hop.path) for n, hop in enumerate(hops, 1)] == [(n, path) for n, path, _ in documented()], hops
    for hop, (n, _, code) in zip(hops, documented()):
        assert code in hop.code, f"hop {n}: docs/design.md names `{code}`, the code is `{hop.code}`"


def test_a_hop_added_in_code_is_found(trainer_on_path, tmp_path):
    """The route is followed, not matched: a step the name takes through one more project function
    (here: a pass-through between configure_linears and kernel_for) makes one more hop."""
    for path in (CONFIG, TRAIN_PROCESS, FLUX2, "flux2_contract/qtypes.py", "toolkit/int4_linear.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((trainer_on_path / path).read_text(encoding="utf-8"), encoding="utf-8")
    linear = tmp_path / "toolkit/int4_linear.py"
    text = linear.read_text(encoding="utf-8").replace("kernel = kernel_for(qtype, model_kwargs, device)",
                                                      "kernel = passed_on(qtype, model_kwargs, device)")
    linear.write_text(text + "\n\ndef passed_on(name, model_kwargs, device):\n"
                      "    return kernel_for(name, model_kwargs, device)\n", encoding="utf-8")
    assert len(route(tmp_path)) == len(route(trainer_on_path)) + 1


def test_the_name_is_not_turned_into_an_object_and_back(trainer_on_path):
    """The kernel is chosen from the qtype's name: no function takes get_qtype's object to read its name again."""
    quantize = importlib.import_module("toolkit.util.quantize")
    assert not [name for name in vars(quantize) if "int4_activations" in name]
    flux2 = (trainer_on_path / FLUX2).read_text(encoding="utf-8")
    assert "get_qtype(self.model_config.qtype), self.model_config.model_kwargs" not in flux2
