"""The package's layering, checked from its imports (module level, as Python runs them).

- ``wire/``: codecs only; no trio, and nothing above it.
- ``transport/``: trio I/O over the codecs; no round arithmetic, no role.
- ``fold/``: the shared round arithmetic; no role.
- ``relay/``, ``controller/``, ``client/``: the roles; they never import each other.
- torch: only the tensor bridge imports it, so the daemons start without it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flodl_trio"
ROLES = ("relay", "controller", "client")


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


def test_wire_is_codecs_only():
    above = tuple(f"flodl_trio.{p}" for p in ("transport", "fold", "settings", *ROLES, "testing", "tensors"))
    assert offenders("wire", ("trio", *above)) == []


def test_transport_knows_no_round_and_no_role():
    assert offenders("transport", tuple(f"flodl_trio.{p}" for p in ("fold", *ROLES, "testing", "tensors"))) == []


def test_fold_knows_no_role():
    assert offenders("fold", tuple(f"flodl_trio.{p}" for p in (*ROLES, "testing", "tensors"))) == []


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
    assert importers == ["flodl_trio.tensors"]


def test_the_daemons_start_without_torch():
    code = (
        "import sys, flodl_trio.relay.cli, flodl_trio.controller.cli, flodl_trio.checkpoint; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
