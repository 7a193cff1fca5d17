"""Build ``data/corpus.txt``: English prose from the docstrings of CPython's standard library.

The corpus lets ``lohan train`` fine-tune on real text with no download. Its source is the standard
library of the Python that runs this script, distributed under the PSF License (copied next to the
corpus as ``data/LICENSE-PSF.txt``).

What is kept: module, class and function docstrings, split into paragraphs; a paragraph stays if it
reads as prose (no doctest ``>>>`` lines, not an indented code/argument block, mostly letters, at least
a few words, almost no non-ASCII). Paragraphs are deduplicated (``"Return self==value."`` appears
hundreds of times), modules are visited in sorted path order, definitions in source order, and each
module contributes at most ``--per-module-bytes`` so the text spans the whole library instead of its
first letters. The output is a byte-for-byte function of the Python version and the arguments.

Usage::

    .venv/bin/python scripts/make_corpus.py            # writes data/corpus.txt and data/LICENSE-PSF.txt
    .venv/bin/python scripts/make_corpus.py --max-bytes 500000
"""

from __future__ import annotations

import argparse
import ast
import platform
import re
import shutil
import sys
import sysconfig
import tokenize
import warnings
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Directories whose docstrings are test scaffolding, vendored wheels or third-party code, not prose.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "_bundled"}

MIN_CHARS = 60
MIN_WORDS = 8
MIN_PROSE_RATIO = 0.80  # letters + whitespace + light punctuation, over all characters
MAX_NON_ASCII_RATIO = 0.02


def iter_modules(stdlib: Path) -> Iterator[Path]:
    """Every ``.py`` file under ``stdlib`` outside :data:`SKIP_DIRS`, in sorted (deterministic) order."""
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        yield path


def iter_docstrings(tree: ast.Module) -> Iterator[str]:
    """Docstrings of the module, then of its classes and functions in source order (depth first)."""
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        yield doc
    yield from _defs_docstrings(tree.body)


def _defs_docstrings(body: list[ast.stmt]) -> Iterator[str]:
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc
            yield from _defs_docstrings(node.body)


def is_prose(paragraph: str) -> bool:
    """True if a docstring paragraph reads as English prose rather than code, tables or doctests."""
    lines = paragraph.splitlines()
    if any(line.lstrip().startswith((">>>", "...")) for line in lines):
        return False
    # After cleandoc (ast.get_docstring(clean=True)), indented lines are code samples, argument tables or literal blocks.
    if sum(line[:1].isspace() for line in lines) * 2 >= len(lines):
        return False
    if len(paragraph) < MIN_CHARS or len(paragraph.split()) < MIN_WORDS:
        return False
    non_ascii = sum(not ch.isascii() for ch in paragraph)
    if non_ascii > MAX_NON_ASCII_RATIO * len(paragraph):
        return False
    prose = sum(ch.isalpha() or ch.isspace() or ch in ".,;:'\"()-" for ch in paragraph)
    return prose >= MIN_PROSE_RATIO * len(paragraph)


def build_corpus(stdlib: Path, max_bytes: int, per_module_bytes: int) -> tuple[str, int, int]:
    """Collect prose paragraphs from ``stdlib``.

    Returns:
        ``(text, n_modules, n_paragraphs)``: the corpus (paragraphs separated by one blank line, ending
        in a newline, at most ``max_bytes`` UTF-8 bytes), the number of modules that contributed and the
        number of paragraphs kept.
    """
    seen: set[str] = set()
    chunks: list[str] = []
    total = 0
    n_modules = 0
    for path in iter_modules(stdlib):
        try:
            with tokenize.open(path) as f:  # honours PEP 263 coding declarations
                source = f.read()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. SyntaxWarning for invalid escapes in old modules
                tree = ast.parse(source, filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # deliberately broken files (lib2to3 fixtures, bad encodings) carry no prose
        module_bytes = 0
        for doc in iter_docstrings(tree):
            for paragraph in re.split(r"\n[ \t]*\n", doc):
                paragraph = paragraph.strip("\n").rstrip()
                if paragraph in seen or not is_prose(paragraph):
                    continue
                size = len(paragraph.encode("utf-8")) + 2  # + the blank-line separator
                if module_bytes + size > per_module_bytes:
                    break
                if total + size > max_bytes:
                    return "\n\n".join(chunks) + "\n", n_modules, len(chunks)
                if module_bytes == 0:
                    n_modules += 1
                seen.add(paragraph)
                chunks.append(paragraph)
                module_bytes += size
                total += size
            if module_bytes + MIN_CHARS > per_module_bytes:
                break
    return "\n\n".join(chunks) + "\n", n_modules, len(chunks)


def find_license(stdlib: Path) -> Path:
    """The installation's ``LICENSE.txt`` (next to the stdlib on POSIX builds, one level up on some)."""
    for candidate in (stdlib / "LICENSE.txt", stdlib.parent / "LICENSE.txt", stdlib.parent / "LICENSE"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"no LICENSE.txt found in {stdlib} or its parent; pass --license PATH to the PSF license text "
        f"of this Python (it ships with every CPython installation)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stdlib",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="standard library directory to read (default: this Python's)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "data" / "corpus.txt", help="corpus file to write")
    parser.add_argument(
        "--license",
        type=Path,
        default=None,
        help="PSF license file to copy next to the corpus (default: found in the stdlib)",
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=900_000,
        help="corpus size cap in bytes (the repository ships at most 1 MB)",
    )
    parser.add_argument(
        "--per-module-bytes",
        type=int,
        default=6_000,
        help="cap per module, so the corpus covers many modules",
    )
    args = parser.parse_args(argv)

    text, n_modules, n_paragraphs = build_corpus(args.stdlib, args.max_bytes, args.per_module_bytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8", newline="\n")
    license_src = args.license or find_license(args.stdlib)
    license_dst = args.out.parent / "LICENSE-PSF.txt"
    shutil.copyfile(license_src, license_dst)

    size = len(text.encode("utf-8"))
    print(f"python {platform.python_version()} ({sys.implementation.name})")
    print(
        f"wrote {args.out.name}: {size:,} bytes ({size / 1e6:.3f} MB), {n_paragraphs:,} paragraphs "
        f"from {n_modules:,} modules"
    )
    print(f"copied the license to {license_dst.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
