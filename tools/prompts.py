"""``python -m tools.prompts``: the project's prompt set, for ``dflash-regen``.

    python -m tools.prompts --out data/prompts.jsonl

A drafter learns what its target says; the recipe (``configs/quality.toml``)
trains on the target's own answers to these prompts. They are derived from
what every Python install carries, so the set is the same on every machine
and needs no download: the topics of Python's reference (``pydoc_data``), the
standard-library module names, the built-in functions and the keywords, each
asked about in a few ways, plus short passages of the reference to explain or
summarise. The order is shuffled with a fixed seed, so any prefix of the file
is a spread of kinds and subjects. Output is deterministic for a given Python
version (its module list and reference text).
"""

from __future__ import annotations

import argparse
import builtins
import json
import keyword
import random
import sys
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSONL to write, one {\"prompt\": ...} per line")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    p.add_argument("--limit", type=int, default=0, help="keep the first N prompts (default all)")
    args = p.parse_args(argv)
    prompts = build_prompts(args.seed)
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
