"""Does a trained drafter copy from its context? Where its first draft misses, and what copying would add.

    python bench/copy_probe.py --config configs/quality.toml --drafter runs/quality/export/q0 --group passage

On the run's held-out conversations (the first ``--prompts``, as ``dflash-eval`` picks them), with the
float32 target's features of the true answers (the target's own greedy answers, so every anchor sees
what decoding would show it), scored over the first ``--max-new-tokens`` answer tokens:

* the drafter's first-slot hit rate by the target's own confidence in that token (its top-1
  probability, from the captured last layer), split by whether the token occurs in the prompt;
* the decoding walk's tau (``bench/recipe_sweep.py``'s, exact for greedy decoding) of the drafter
  alone; of prompt lookup (``tools/prompt_lookup.py``, ``dflash-eval --prompt-lookup``) taking a step
  wherever the last ``--min-ngram``..``--max-ngram`` tokens occur earlier in the sequence, the drafter
  everywhere else; and of the better of the two at every step (an oracle: what a drafter that also
  copied could reach).

``--group REGEX`` reports the prompts whose text matches it apart from the rest. docs/recipe.md
("Copying from the prompt", session 39) used it to find that the drafter does not copy: it misses
a third of the passage tokens the target copies with more than 0.9 confidence.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path
from typing import Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recipe_sweep import _every_anchor, capture_all, decoding_walk  # noqa: E402
from tools.prompt_lookup import MAX_NGRAM, MIN_NGRAM, lookup_draft  # noqa: E402

CONFIDENCE_BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def accepted_run(draft: Sequence[int], truth: Sequence[int]) -> int:
    """Drafts a greedy verification accepts: the leading drafts equal to the true tokens."""
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def confidence_bin(p: float) -> str:
    for lo, hi in zip(CONFIDENCE_BINS, CONFIDENCE_BINS[1:]):
        if p < hi or hi == CONFIDENCE_BINS[-1]:
            return f"{lo:.1f}-{hi:.1f}"
    raise AssertionError(p)


def walk_tables(steps: dict[int, tuple[int, int]], first: int) -> dict[str, tuple[int, dict[int, int]]]:
    """The decoding walk's inputs for the three ways of drafting, from ``{anchor: (drafter's accepted
    drafts, lookup's accepted drafts or -1 where the lookup has no draft)}``."""
    return {
        "drafter": (first, {a: d for a, (d, _) in steps.items()}),
        "lookup, else drafter": (first, {a: (p if p >= 0 else d) for a, (d, p) in steps.items()}),
        "better of the two (oracle)": (first, {a: max(d, p) for a, (d, p) in steps.items()}),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--drafter", required=True, help="an exported drafter directory (runs/<name>/export/<id>)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--group", default="", help="report prompts whose text matches this regular expression apart")
    p.add_argument("--max-ngram", type=int, default=MAX_NGRAM)
    p.add_argument("--min-ngram", type=int, default=MIN_NGRAM)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from common.config import load_config
    from common.model_loader import embedding_weights, final_norm_weight, load_target
    from drafter_worker.model.dflash_model import _weighted_slot_loss, load_drafter
    from drafter_worker.model.distill_loss import teacher_hidden
    from target_server.data import build_dataset

    cfg = load_config(args.config, [])
    loaded = load_target(cfg.target.model, device="cpu", dtype=torch.float32)
    ds = build_dataset(loaded.tokenizer, cfg.data.source, max_seq_len=cfg.data.max_seq_len, seed=cfg.data.seed,
                       heldout_fraction=cfg.data.heldout_fraction, max_samples=1, data_format=cfg.data.format,
                       chat_template_kwargs=cfg.data.chat_template_kwargs)
    # The conversations dflash-eval decodes: held out, with a prompt before the answer.
    held = [s for s in ds.heldout if 1 in s.loss_mask.tolist() and s.loss_mask.tolist().index(1) > 0][: args.prompts]
    model = load_drafter(args.drafter).float().eval()
    feats = capture_all(loaded, list(model.target_layer_ids), held)
    embed, head, _ = embedding_weights(loaded.model)
    embed, head = embed.float(), head.float()
    norm = final_norm_weight(loaded.model)
    if norm is None or max(model.target_layer_ids) != loaded.num_layers - 1:
        raise SystemExit("the target's confidence needs its final norm and its last layer among the drafter's")
    hidden_size = loaded.hidden_size

    hits = collections.defaultdict(lambda: [0, 0])  # (group, bin, in prompt) -> [hits, anchors]
    walks = collections.defaultdict(list)  # (group, way) -> walk inputs
    for j, sample in enumerate(held):
        ids = sample.input_ids.tolist()
        first = sample.loss_mask.tolist().index(1)
        text = loaded.tokenizer.decode(ids[:first])
        group = ("matching" if re.search(args.group, text) else "rest") if args.group else "all"
        prompt_tokens = set(ids[:first])
        with torch.no_grad():
            anchors, valid, inputs, hidden = _every_anchor(model, sample, feats[j], embed)
            _, slot_hits = _weighted_slot_loss(model, hidden, inputs, head, 1.0, "auto")
            confidence = torch.softmax(teacher_hidden(feats[j][:, -hidden_size:], *norm) @ head.T, -1).max(-1).values
        run = (slot_hits.bool() & inputs.label_valid[:, :, 1:].bool()).long().cumprod(-1).sum(-1)[0]
        steps = {}
        for n in range(anchors.shape[1]):
            a = int(anchors[0, n])
            if not valid[0, n] or a + 1 - first >= args.max_new_tokens:
                continue
            label = ids[a + 1]
            key = (group, confidence_bin(float(confidence[a])), label in prompt_tokens)
            hits[key][0] += int(slot_hits[0, n, 0])
            hits[key][1] += 1
            draft = lookup_draft(ids[: a + 1], model.block_size - 1, args.max_ngram, args.min_ngram)
            steps[a] = (int(run[n]), accepted_run(draft, ids[a + 1:]) if draft else -1)
        for way, table in walk_tables(steps, first).items():
            for name in {group, "all"}:
                walks[(name, way)].append(table)

    for (group, way), tables in sorted(walks.items()):
        print(json.dumps({"group": group, "drafting": way, "prompts": len(tables),
                          "walk_tau": round(decoding_walk(tables), 3)}))
    for (group, bin_, in_prompt), (h, n) in sorted(hits.items()):
        print(json.dumps({"group": group, "target_confidence": bin_, "token_in_prompt": in_prompt,
                          "anchors": n, "slot1_hit": round(h / n, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
