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

``--rephrased-after ANSWERS`` appends a second set of the same kinds, worded
differently: new questions about the same modules, built-ins, keywords and
topics, and a new request about each passage. Subjects whose first-set
conversation in ``ANSWERS`` (``dflash-regen``'s output for the first set) is
held out of training are left out, so no evaluation prompt has a rewording
in training. The first set's lines, and the answers made for them, keep
their places.
"""

from __future__ import annotations

import argparse
import builtins
import json
import keyword
import random
import sys
from pathlib import Path
from typing import Iterator

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

# The rephrased set's wordings: none is one of the first set's.
_REPHRASED = {
    "module": ("When should a Python programmer reach for the `{}` module?",
               "Describe the main classes and functions of Python's `{}` module."),
    "builtin": ("What arguments does Python's built-in `{}` take, and what does it return?",
                "What mistakes do people make with `{}` in Python?"),
    "keyword": ("What does the `{}` keyword do in Python? Show a short example.",
                "When would you write `{}` in Python code?"),
    "topic": ("Give a short example that illustrates '{}' in Python.",
              "How does {} work in Python?"),
    "passage": ("What are the key points of this passage from the Python reference?\n\n{}",),
}


def _first_set_subjects(max_passage_chars: int = 400) -> Iterator[tuple[str, str, str]]:
    """(prompt, kind, subject) of every first-set prompt, unshuffled, duplicates included."""
    from pydoc_data.topics import topics

    from target_server.data import chunk_text

    modules = sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in ("this", "antigravity"))
    names = sorted(n for n in dir(builtins) if not n.startswith("_") and n[0].islower())
    for kind, subjects, questions in (("module", modules, _MODULE_QUESTIONS), ("builtin", names, _BUILTIN_QUESTIONS),
                                      ("keyword", keyword.kwlist, _KEYWORD_QUESTIONS)):
        yield from ((q.format(s), kind, s) for s in subjects for q in questions)
    yield from ((q.format(t.replace("-", " ")), "topic", t.replace("-", " ")) for t in sorted(topics)
                for q in _TOPIC_QUESTIONS)
    for i, name in enumerate(sorted(topics)):
        for j, chunk in enumerate(chunk_text(topics[name], max_chunk_chars=max_passage_chars, min_chunk_chars=120)):
            yield _PASSAGE_QUESTIONS[(i + j) % len(_PASSAGE_QUESTIONS)].format(chunk), "passage", chunk


def build_prompts(seed: int = 0, max_passage_chars: int = 400) -> list[str]:
    """Every prompt of the set, in a seeded shuffled order (duplicates removed)."""
    prompts = list(dict.fromkeys(prompt for prompt, _, _ in _first_set_subjects(max_passage_chars)))
    random.Random(seed).shuffle(prompts)
    return prompts


def build_rephrased_prompts(held_out: set[str], seed: int = 0) -> list[str]:
    """The first set's subjects asked in other words, in a seeded shuffled order; a subject of any
    prompt in ``held_out`` (first-set prompts kept out of training) is left out."""
    first = list(_first_set_subjects())
    excluded = {(kind, subject) for prompt, kind, subject in first if prompt in held_out}
    existing = {prompt for prompt, _, _ in first}
    subjects = dict.fromkeys((kind, subject) for _, kind, subject in first if (kind, subject) not in excluded)
    prompts = [q.format(subject) for kind, subject in subjects for q in _REPHRASED[kind]]
    prompts = [p for p in dict.fromkeys(prompts) if p not in existing]
    random.Random(seed).shuffle(prompts)
    return prompts


def held_out_prompts(answers: Path, *, heldout_fraction: float, split_seed: int) -> set[str]:
    """First user message of each conversation in ``answers`` that the target server's split holds out."""
    from target_server.data import conversation_hash

    held = set()
    with open(answers, encoding="utf-8") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            if conversation_hash(messages, split_seed) < heldout_fraction:
                held.add(messages[0]["content"])
    return held


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSONL to write, one {\"prompt\": ...} per line")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    p.add_argument("--limit", type=int, default=0, help="keep the first N prompts (default all)")
    p.add_argument("--rephrased-after", type=Path, metavar="ANSWERS",
                   help="append the rephrased set, leaving out the subjects of the first-set conversations in "
                        "ANSWERS that the split holds out")
    p.add_argument("--heldout-fraction", type=float, default=0.04, help="the recipe's data.heldout_fraction (0.04)")
    p.add_argument("--split-seed", type=int, default=0, help="the recipe's data.seed (0)")
    args = p.parse_args(argv)
    prompts = build_prompts(args.seed)
    if args.rephrased_after:
        held = held_out_prompts(args.rephrased_after, heldout_fraction=args.heldout_fraction,
                                split_seed=args.split_seed)
        prompts += build_rephrased_prompts(held & set(prompts), args.seed)
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
