"""The package layout is the architecture (README "Architecture"): each subpackage is a layer and imports only
the layers below it. config <- plan <- {store, models, data} <- runtime <- app, with io_engine at the bottom (the
planning layer prices buffers with its torch-free `io_engine.align`) and knowing nothing of lohan. The planning
layer is torch-free: the dry run and the capacity CLI price a plan before torch is loaded."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# rank of each layer; a module may import its own layer's modules (same package) and any lower rank
LAYERS = {
    "io_engine": 0, "lohan.config": 0, "lohan.crashpoints": 0,
    "lohan.plan": 1,
    "lohan.store": 2, "lohan.models": 2, "lohan.data": 2,
    "lohan.runtime": 3,
    "lohan.app": 4, "lohan": 4,  # the package's public entry points (init, init_from_hf)
    "lohan.capacity": 5,  # `python -m lohan.capacity`: a shim over lohan.app.capacity, at the name the README uses
}


def layer_of(module: str) -> str:
    """The layer a dotted module name belongs to: its longest prefix in LAYERS."""
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        name = ".".join(parts[:k])
        if name in LAYERS:
            return name
    raise KeyError(module)


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of lohan or io_engine in a file, lazy ones inside functions included."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
    return [(line, m) for line, m in found if m.split(".")[0] in ("lohan", "io_engine")]


def violations() -> list[str]:
    bad = []
    for path in sorted([*(REPO / "lohan").rglob("*.py"), *(REPO / "io_engine").rglob("*.py")]):
        me = module_name(path)
        mine = layer_of(me)
        for line, target in imports(path):
            theirs = layer_of(target)
            if theirs == mine or (mine == "lohan" and target == "lohan"):
                continue
            if me.startswith("io_engine") or LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{path.relative_to(REPO)}:{line}: {me} ({mine}) imports {target} ({theirs})")
    return bad


def test_imports_follow_the_layer_order():
    bad = violations()
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself: a store module importing the runtime, or io_engine importing lohan, is reported."""
    fake = REPO / "lohan" / "store" / "_layer_probe.py"
    fake.write_text("from lohan.runtime.engine import Engine\n")
    try:
        assert any("_layer_probe" in v and "lohan.runtime" in v for v in violations())
    finally:
        fake.unlink()
    assert layer_of("lohan.runtime.engine") == "lohan.runtime" and layer_of("io_engine.volume") == "io_engine"


def test_every_module_has_a_layer():
    for path in [*(REPO / "lohan").rglob("*.py")]:
        layer_of(module_name(path))  # raises KeyError for a module outside every layer


PLAN_WITHOUT_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch.") or name == "numpy":
            raise ImportError(f"{name} is not available in this test")
sys.meta_path.insert(0, NoTorch())
import lohan.config, lohan.plan, lohan.plan.planner, lohan.plan.memory
from lohan.config import get_model_config
from lohan.plan.planner import capacity, parse_hardware
plan = capacity(get_model_config("175b"), parse_hardware("rtx4090,12xP5510,256GB"), 1, 1024)
assert plan.fits or plan.reasons, plan
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch was imported"
print("ok")
"""


def test_planning_layer_imports_without_torch():
    out = subprocess.run([sys.executable, "-c", PLAN_WITHOUT_TORCH], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("argv", [["--model", "175b", "--hardware", "rtx4090,12xP5510,256GB", "--seq", "1024"]])
def test_capacity_cli_runs_without_torch(argv):
    code = ("import sys, runpy\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            f"sys.argv = ['lohan.capacity'] + {argv!r}\n"
            "runpy.run_module('lohan.capacity', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "175b" in out.stdout


def test_every_module_imports():
    """A name imported from where it no longer lives fails only when its module is first imported; import every
    module of the package (in a child: nothing here is left imported for the other tests)."""
    code = ("import importlib, pkgutil, lohan, io_engine\n"
            "for pkg in (lohan, io_engine):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        if not m.name.endswith('__main__'):\n"
            "            importlib.import_module(m.name)\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
