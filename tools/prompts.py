"""``python -m tools.prompts``: the project's prompt set, for ``dflash-regen``.

    python -m tools.prompts --out data/prompts.jsonl

A drafter learns what its target says; the recipe (``configs/quality.toml``)
trains on the target's own answers to these prompts. They are derived from
what every Python install carries, so the set is the same on every machine
and needs no download: the topics of Python's reference (``pydoc_data``), the
standard-library module names, the built-in functions and the keywords, each
asked about in a few ways, plus short passages of the reference to explain or
summarise. The order is shuffled with a fixed seed, so any prefix of the file
is a spread of kinds and subjects. A second set follows it in the file (since
session 36): one question about each documented public function, class and
method of the standard library's Python sources, read with ``ast`` (nothing is
imported), also shuffled; the first set's lines, and so the answers made for
them, keep their places. Output is deterministic for a given Python version
(its module list, sources and reference text).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import keyword
import random
import sys
import sysconfig
from pathlib import Path

_MODULE_QUESTIONS = (
    "What is the Python `{}` module used for?",
    "Show a short example that uses Python's `{}` module.",
    "What are the most useful functions in Python's `{}` module?",
)
_BUILTIN_QUESTIONS = (
    "What does Python's built-in `{}` do?",
    "Give an example of using `{}` in Python.",
)
_KEYWORD_QUESTIONS = (
    "How is the `{}` keyword used in Python?",
    "Explain the Python keyword `{}` with an example.",
)
_TOPIC_QUESTIONS = (
    "Explain the Python topic '{}'.",
    "What should a beginner know about {} in Python?",
)
_PASSAGE_QUESTIONS = (
    "Explain this passage from the Python reference in simple words:\n\n{}",
    "Summarize this passage from the Python reference:\n\n{}",
)
_API_QUESTIONS = {
    "function": ("What does `{}` do in Python?", "Show a short example of calling `{}` in Python."),
    "class": ("What is the Python class `{}` used for?", "Show how to use the Python class `{}`."),
    "method": ("What does the method `{}` do in Python?", "Give an example of calling the method `{}` in Python."),
}
# Not the reference of a library a user calls: tests, the IDE, 2to3, the installer of pip, GUI toolkits.
_API_SKIPPED = frozenset({"antigravity", "ensurepip", "idlelib", "lib2to3", "pydoc_data", "test", "this", "tkinter",
                          "turtle", "turtledemo"})


def build_prompts(seed: int = 0, max_passage_chars: int = 400) -> list[str]:
    """Every prompt of the set, in a seeded shuffled order (duplicates removed)."""
    from pydoc_data.topics import topics

    from target_server.data import chunk_text

    modules = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in ("this", "antigravity"))
    names = sorted(n for n in dir(builtins) if not n.startswith("_") and n[0].islower())
    prompts: list[str] = []
    prompts += [q.format(m) for m in modules for q in _MODULE_QUESTIONS]
    prompts += [q.format(n) for n in names for q in _BUILTIN_QUESTIONS]
    prompts += [q.format(k) for k in keyword.kwlist for q in _KEYWORD_QUESTIONS]
    prompts += [q.format(t.replace("-", " ")) for t in sorted(topics) for q in _TOPIC_QUESTIONS]
    for i, name in enumerate(sorted(topics)):
        for j, chunk in enumerate(chunk_text(topics[name], max_chunk_chars=max_passage_chars, min_chunk_chars=120)):
            prompts.append(_PASSAGE_QUESTIONS[(i + j) % len(_PASSAGE_QUESTIONS)].format(chunk))
    prompts = list(dict.fromkeys(prompts))
    random.Random(seed).shuffle(prompts)
    return prompts


def _stdlib_sources() -> list[tuple[str, Path]]:
    """(dotted module name, source file) of every public pure-Python standard-library module, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources: list[tuple[str, Path]] = []
    for top in sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in _API_SKIPPED):
        if (root / f"{top}.py").is_file():
            sources.append((top, root / f"{top}.py"))
            continue
        package = root / top
        if not (package / "__init__.py").is_file():
            continue  # a C extension: no source to read
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if any(part.startswith(("_", "test")) for part in parts):
                continue
            sources.append((".".join(parts), path))
    return sources


def _documented_names(source: str, module: str) -> list[tuple[str, str]]:
    """(kind, qualified name) of the module's documented public functions, classes and their methods."""
    names: list[tuple[str, str]] = []
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if not ast.get_docstring(node):
            continue
        if isinstance(node, ast.FunctionDef):
            names.append(("function", f"{module}.{node.name}"))
            continue
        names.append(("class", f"{module}.{node.name}"))
        names += [("method", f"{module}.{node.name}.{item.name}") for item in node.body
                  if isinstance(item, ast.FunctionDef) and not item.name.startswith("_") and ast.get_docstring(item)]
    return names


def build_api_prompts(seed: int = 0) -> list[str]:
    """One question about each documented public name of the standard library's sources, seeded shuffled order."""
    names = [name for module, path in _stdlib_sources()
             for name in _documented_names(path.read_text(encoding="utf-8"), module)]
    prompts = [_API_QUESTIONS[kind][i % 2].format(qualified) for i, (kind, qualified) in enumerate(names)]
    prompts = list(dict.fromkeys(prompts))
    random.Random(seed).shuffle(prompts)
    return prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSONL to write, one {\"prompt\": ...} per line")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    p.add_argument("--limit", type=int, default=0, help="keep the first N prompts (default all)")
    args = p.parse_args(argv)
    prompts = build_prompts(args.seed) + build_api_prompts(args.seed)
    if args.limit > 0:
        prompts = prompts[: args.limit]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for text in prompts:
            f.write(json.dumps({"prompt": text}, ensure_ascii=False) + "\n")
    tmp.replace(args.out)
    print(f"wrote {len(prompts)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
