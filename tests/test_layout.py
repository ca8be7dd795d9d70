"""The package's layering, checked from its imports.

Layers, bottom up: ``errors`` -> ``wire/`` (codecs; no trio) -> ``transport/``
(trio I/O; no round arithmetic, no role) -> ``fold/`` (the shared round
arithmetic) -> the roles ``client/``, ``relay/``, ``controller/`` (never each
other) -> ``train/`` -> ``daemon/``, ``demo/``, ``testing/``. Nothing imports
upward - at module level, inside a function or under TYPE_CHECKING. The only
exceptions are the ``__main__`` entry points (``python -m flodl_trio.relay``
starts the daemon a layer up; nothing imports them) and the package's
``__init__``, the facade that names the user API (lazily above the roles).
torch: only the tensor bridge imports it at module level, so the daemons
start without it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flodl_trio"
ROLES = ("relay", "controller", "client", "shard")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def module_level_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is imported: not inside functions or TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    importer, is_package = module_name(path), path.name == "__init__.py"
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(importer, is_package, node)
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


def every_import(path: Path, as_module: str | None = None) -> set[str]:
    """Every module ``path`` names in an import: module level, inside functions, and
    under TYPE_CHECKING alike (a back edge for the type checker is a back edge)."""
    tree = ast.parse(path.read_text())
    importer, is_package = as_module or module_name(path), path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(importer, is_package, node)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def modules_under(package: str) -> list[Path]:
    return sorted((PACKAGE / package).rglob("*.py"))


def imports_of(package: str) -> dict[str, set[str]]:
    return {module_name(path): module_level_imports(path) for path in modules_under(package)}


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in imports_of(package).items()
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    )


def test_the_checker_sees_relative_imports():
    """A check that finds nothing must be able to find something."""
    core = module_level_imports(PACKAGE / "relay" / "core.py")
    assert "flodl_trio.relay.channels" in core and "trio" in core and "flodl_trio.wire.handshake" in core


LAYERS: dict[str, int] = {
    "errors": 0, "_version": 0,
    "wire": 1,
    "transport": 2,
    "fold": 3,
    "client": 4, "relay": 4, "controller": 4, "shard": 4,
    "train": 5,
    "daemon": 6, "testing": 6, "demo": 7,  # the demo runs the daemons and may use the testing toolkit
}


def layer_of(module: str) -> tuple[str, int] | None:
    """The layer a module (or a name in one) is in; the package's facade (``from
    flodl_trio import x`` inside the package) is above everything: it hides an edge."""
    parts = module.split(".")
    if parts[0] != "flodl_trio":
        return None
    if len(parts) < 2 or parts[1] not in LAYERS:
        return "the flodl_trio facade", max(LAYERS.values()) + 1
    return parts[1], LAYERS[parts[1]]


def test_every_module_sits_in_a_layer():
    unknown = sorted({path.relative_to(PACKAGE).parts[0] for path in PACKAGE.rglob("*.py")} - {"__init__.py"}
                     - {f"{name}.py" for name in LAYERS} - set(LAYERS))
    assert unknown == [], f"modules outside every layer: {unknown}"


def test_nothing_imports_upward_or_across_the_roles():
    offending = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__main__.py" or path == PACKAGE / "__init__.py":
            continue
        importer = module_name(path)
        here = layer_of(importer)
        assert here is not None
        for target in every_import(path):
            there = layer_of(target)
            if there is None or there[0] == here[0]:
                continue
            if there[1] > here[1] or (there[1] == here[1] == LAYERS["client"]) or (
                there[1] == here[1] and there[0] != here[0] and here[1] == LAYERS["daemon"]
            ):
                offending.append(f"{importer} imports {target}")
    assert sorted(offending) == []


def test_the_layer_check_sees_a_type_checking_back_edge(tmp_path):
    """A check that finds nothing must be able to find something: an import under
    TYPE_CHECKING, or inside a function, counts."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..relay import RelayHandle\n"
        "def f():\n    from ..controller import open_controller\n"
    )
    found = every_import(probe, as_module="flodl_trio.wire.probe")
    assert {"flodl_trio.relay.RelayHandle", "flodl_trio.controller.open_controller"} <= found


def test_wire_is_codecs_only():
    above = tuple(f"flodl_trio.{p}" for p in ("transport", "fold", *ROLES, "train", "daemon", "testing", "demo"))
    assert offenders("wire", ("trio", *above)) == []


def test_transport_knows_no_round_and_no_role():
    assert offenders("transport", tuple(f"flodl_trio.{p}" for p in ("fold", *ROLES, "train", "testing"))) == []


def test_fold_knows_no_role():
    assert offenders("fold", tuple(f"flodl_trio.{p}" for p in (*ROLES, "train", "testing"))) == []


@pytest.mark.parametrize("role", ROLES)
def test_roles_never_import_each_other(role):
    others = tuple(f"flodl_trio.{other}" for other in ROLES if other != role)
    assert offenders(role, (*others, "flodl_trio.testing")) == []


def test_only_the_tensor_bridge_imports_torch_at_module_level():
    importers = sorted(
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if any(t == "torch" or t.startswith("torch.") for t in module_level_imports(path))
    )
    assert importers == ["flodl_trio.client.tensors"]


def test_the_daemons_start_without_torch():
    code = (
        "import sys, flodl_trio.daemon.relay, flodl_trio.daemon.controller, flodl_trio.wire.checkpoint; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
