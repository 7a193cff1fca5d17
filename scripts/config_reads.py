"""Find (and rewrite) reads of `EngineConfig`'s flat aliases: ``cfg.cpu_mem`` -> ``cfg.memory.cpu_mem``.

    python scripts/config_reads.py            # list the reads left in lohan/
    python scripts/config_reads.py --write    # rewrite them to section access (then run ruff and the tests)

Code in lohan/ reads the sections; the flat aliases stay for code written before them (other branches, user
scripts) and can be retired once nothing reads them (tests/unit/config/test_config_sections.py checks lohan/ with this).
After merging a branch that still reads flat names, ``--write`` moves them.

Python has no types at this level, so a read is recognized by its receiver, as lohan names its configs:
``cfg``/``ecfg``/``engine_cfg``, anything ending in ``.cfg``, ``run.engine`` (``ctx.run.engine``...) and a
`RunPlan`'s ``plan.engine``, a parameter
annotated ``EngineConfig``, ``self`` inside `EngineConfig`, and a local name assigned one of those (or an
``EngineConfig(...)``, a ``.with_overrides(...)``/``rank_config(...)`` of one). A ``cfg`` annotated with
another type (a ``ModelConfig``) is not one, nor ``self.cfg`` in a class whose ``__init__`` takes such a ``cfg``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lohan.config import _DERIVED, FLAT_KEYS  # noqa: E402  (the repository's own lohan)

ALIASES = {**FLAT_KEYS, **_DERIVED}
CONFIG_NAMES = {"cfg", "ecfg", "engine_cfg", "engine_config"}
MAKERS = {"EngineConfig", "with_overrides", "rank_config"}


@dataclass(frozen=True)
class Read:
    line: int
    col: int
    """Where the receiver ends (the ``.`` before the name), 0-based on `line`."""
    receiver: str
    name: str

    @property
    def section(self) -> str:
        return ALIASES[self.name]


def _is_engine_annotation(node: ast.expr | None) -> bool | None:
    """True: annotated EngineConfig; False: annotated something else; None: not annotated."""
    if node is None:
        return None
    return "EngineConfig" in ast.unparse(node)


class _Finder(ast.NodeVisitor):
    def __init__(self, source: str) -> None:
        self.source = source
        self.reads: list[Read] = []
        self.scopes: list[tuple[set[str], set[str]]] = [(set(), set())]  # (config names, names that are not)
        self.self_is_config: list[bool] = [False]

    # ----------------------------------------------------------------------------- scopes
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        init = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
        other_cfg = init is not None and any(
            a.arg == "cfg" and _is_engine_annotation(a.annotation) is False for a in init.args.args)
        self.self_is_config.append(node.name == "EngineConfig")
        self.scopes.append((set(), {"self.cfg"} if other_cfg else set()))
        self.generic_visit(node)
        self.scopes.pop()
        self.self_is_config.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        yes, no = set(self.scopes[-1][0]), set(self.scopes[-1][1])
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        for a in args:
            kind = _is_engine_annotation(a.annotation)
            if kind:
                yes.add(a.arg)
            elif kind is False:
                no.add(a.arg)
        self.scopes.append((yes, no))
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(
                node.value, ast.Tuple) else [(target, node.value)]
            for name, value in pairs:
                self._bind(name, self._is_config(value))

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        self._bind(node.target, False)  # (lohan loops over model configs, never over engine configs)
        for child in node.body + node.orelse:
            self.visit(child)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._bind(node.target, False)
        self.generic_visit(node)

    def _bind(self, target: ast.expr, is_config: bool) -> None:
        """`target` now names an engine config, or (``cfg = model_config(...)``, a loop over presets) not."""
        if not isinstance(target, ast.Name):
            return
        yes, no = self.scopes[-1]
        if is_config:
            yes.add(target.id)
            no.discard(target.id)
        else:
            yes.discard(target.id)
            if target.id in CONFIG_NAMES:
                no.add(target.id)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if isinstance(node.target, ast.Name) and _is_engine_annotation(node.annotation) is False:
            self.scopes[-1][1].add(node.target.id)

    # ----------------------------------------------------------------------------- reads
    def _is_config(self, node: ast.expr) -> bool:
        yes, no = self.scopes[-1]
        text = ast.unparse(node)
        if text in no:
            return False
        if isinstance(node, ast.Name):
            return node.id in yes or node.id in CONFIG_NAMES or (node.id == "self" and self.self_is_config[-1])
        if isinstance(node, ast.Attribute):
            return node.attr == "cfg" or (node.attr == "engine" and text.split(".")[-2] in ("run", "plan"))
        if isinstance(node, ast.IfExp):
            return self._is_config(node.body) or self._is_config(node.orelse)
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            return name in MAKERS
        return False

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.generic_visit(node)
        if node.attr in ALIASES and isinstance(node.ctx, ast.Load) and self._is_config(node.value):
            self.reads.append(Read(node.value.end_lineno, node.value.end_col_offset, ast.unparse(node.value),
                                   node.attr))


def flat_reads(source: str) -> list[Read]:
    """The flat-alias reads in a module's source."""
    finder = _Finder(source)
    finder.visit(ast.parse(source))
    return finder.reads


def rewrite(source: str) -> str:
    """`source` with each flat-alias read going through its section."""
    lines = source.splitlines(keepends=True)
    for read in sorted(flat_reads(source), key=lambda r: (r.line, r.col), reverse=True):
        line = lines[read.line - 1].encode()  # (ast's columns count UTF-8 bytes)
        lines[read.line - 1] = (line[:read.col] + f".{read.section}".encode() + line[read.col:]).decode()
    return "".join(lines)


def main(argv: list[str]) -> int:
    write = "--write" in argv
    paths = [Path(a) for a in argv if a != "--write"] or sorted((ROOT / "lohan").rglob("*.py"))
    left = 0
    for path in paths:
        source = path.read_text()
        reads = flat_reads(source)
        if write and reads:
            path.write_text(rewrite(source))
        for r in reads:
            print(f"{path}:{r.line}: {r.receiver}.{r.name} -> {r.receiver}.{r.section}.{r.name}")
        left += len(reads)
    print(f"{left} flat read(s){' rewritten' if write else ''}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
