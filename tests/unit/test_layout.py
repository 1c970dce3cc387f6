"""The layout holds (docs/architecture.md): dependencies flow one way, one adapter touches Ray
LLM's internals, pure decision code imports neither Ray nor vLLM, and modules stay small.
The import graph is read from the source, imports inside functions included."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("infra", "pools", "router", "autoscale", "deployments", "bench")
# who may import whom (besides itself): deployments -> router, autoscale -> pools -> infra
ALLOWED = {
    "infra": set(),
    "pools": {"infra"},
    "router": {"pools", "infra"},
    "autoscale": {"pools", "infra"},
    "deployments": {"router", "autoscale", "pools", "infra"},
    "bench": {"deployments", "router", "autoscale", "pools", "infra"},
}
ADAPTER = "pools/llm.py"
PURE = ("pools/gate.py", "pools/kv_budget.py", "pools/types.py", "router/quota.py", "router/buckets.py", "router/policy.py",
        "autoscale/policy.py", "autoscale/knee.py", "autoscale/profile.py", "router/files.py", "router/batches.py",
        "infra/batchfile.py", "autoscale/operators.py", "autoscale/setups.py", "pools/fair.py", "router/costs.py",
        "router/grammar.py", "router/batch_records.py", "autoscale/ranges.py", "autoscale/controller.py")


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def imports(path: Path) -> list[str]:
    """Every module a file imports, except under `if TYPE_CHECKING:` (annotations only)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", modules(), ids=rel)
def test_dependencies_flow_one_way(path):
    own = rel(path).split("/")[0]
    for name in imports(path):
        top = name.split(".")[0]
        if top in PACKAGES and top != own:
            assert top in ALLOWED[own], f"{rel(path)} imports {name}: {own} may import only {sorted(ALLOWED[own])}"


def test_only_the_adapter_touches_ray_llm_internals():
    touching = [rel(p) for p in modules() if any(n.startswith("ray.llm._internal") for n in imports(p))]
    assert touching == [ADAPTER]


@pytest.mark.parametrize("name", PURE)
def test_pure_decision_code_imports_neither_ray_nor_vllm(name):
    bad = [n for n in imports(REPO / name) if n.split(".")[0] in ("ray", "vllm", "torch", "asyncio")]
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("path", modules() + sorted((REPO / "tests").rglob("*.py")), ids=rel)
def test_modules_and_classes_stay_small(path):
    text = path.read_text()
    assert text.count("\n") <= 400, f"{rel(path)} has {text.count(chr(10))} lines (at most 400)"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= 250, f"{rel(path)}: class {node.name} has {size} lines (at most 250)"


def test_the_route_fits_one_screen():
    tree = ast.parse((REPO / "router/app.py").read_text())
    route = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "route")
    assert route.end_lineno - route.lineno + 1 <= 25


def test_every_package_says_what_it_offers():
    for pkg in PACKAGES:
        doc = ast.get_docstring(ast.parse((REPO / pkg / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"{pkg}/__init__.py has no docstring naming what it offers"


def test_no_built_artifacts_or_copied_images_in_the_tree():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert not [f for f in tracked if f.endswith((".whl", ".tar.gz", ".egg"))]
    images = {(REPO / f).read_bytes() for f in tracked if f.startswith("docs/images/")}
    assert not [f for f in tracked if f.startswith("bench/results/") and f.endswith(".png")
                and (REPO / f).read_bytes() in images], "a plot lives once, in docs/images"


def test_the_readme_shows_the_batch_api_beside_the_cli():
    readme = (REPO / "README.md").read_text()
    for call in ("client.files.create(", "client.batches.create(", "poolserve batch submit"):
        assert call in readme, call
