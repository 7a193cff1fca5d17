"""`--help-config`: every key a run config (YAML) or `--set` takes, with its default and what it means.

The descriptions are the attribute docstrings of the config dataclasses (lohan/config/), read from their
source, so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

import yaml

from lohan.config import ENGINE_SECTIONS, ModelConfig, RunConfig, flat_engine_settings


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string literal that follows its annotation)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen build): names and defaults only
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = _plain(" ".join(after.value.value.split()))
    return docs


def _plain(doc: str) -> str:
    """reST markup as a terminal shows it: ``x`` and :role:`x` as x."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", doc.replace("``", ""))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def config_reference(defaults: Path | None = None, width: int = 110) -> str:
    """The reference: one entry per key, grouped as a config file nests them (top level, ``engine.`` by section,
    ``model_overrides.``), with the built-in default and, when ``defaults`` (a run config) sets the key, its value
    there (the value a run without --config starts from)."""
    shipped: dict[str, Any] = yaml.safe_load(defaults.read_text()) if defaults and defaults.is_file() else {}
    engine = flat_engine_settings(shipped.get("engine"))
    sections = [("run (top level):", "", RunConfig, {k: v for k, v in shipped.items()
                                                     if k not in ("engine", "model_overrides")})]
    sections += [(f"engine.{name} (each key also as engine.{name}.KEY): {_summary(cls)}", "engine.", cls, engine)
                 for name, cls in ENGINE_SECTIONS.items()]
    sections.append(("model_overrides (presets only):", "model_overrides.", ModelConfig,
                     shipped.get("model_overrides") or {}))
    out = [f"Every key of a run config (YAML) and of --set KEY=VALUE. [default] is the built-in default"
           f"{f'; {defaults.name}: its value in {defaults}, which a run without --config starts from' if shipped else ''}.",
           "Flags override the config file, and --set overrides both.", ""]
    for title, prefix, cls, given in sections:
        docs = field_docs(cls)
        out += textwrap.wrap(title, width=width, subsequent_indent="    ")
        for f in dataclasses.fields(cls):
            if f.name in ("engine", "model_overrides") or f.name.startswith("_"):
                continue
            where = f" {defaults.name if defaults else ''}: {_show(given[f.name])}" if f.name in given else ""
            head = f"  {prefix}{f.name}  [{_show(_default(f))}]{where}"
            doc = docs.get(f.name, "")
            out.append(head)
            if doc:
                out += textwrap.wrap(doc, width=width, initial_indent="      ", subsequent_indent="      ")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _summary(cls: type) -> str:
    """The first paragraph of a class's docstring, on one line."""
    return _plain(" ".join((cls.__doc__ or "").split("\n\n")[0].split()))
