"""How much do the target's features say about the first draft position? A probe, against n-gram tables.

    python bench/feature_probe.py --config configs/quality.toml --samples 340 --holdout 40

For every answer position ``a`` of the first ``--samples`` training samples
(features captured once and kept in ``--feature-dir``, shared with
``bench/recipe_sweep.py``), predict token ``a + 1`` (the first draft slot of a block
anchored at ``a``) from what a drafter has at that point. Four predictors, all
scored on the last ``--holdout`` samples:

* bigram / trigram tables of the training answers (no model at all);
* an MLP reading the anchor's and the previous token's embeddings;
* the same MLP also given the captured target features of position ``a - 1``
  (all captured layers, or one with ``--layer``).

The gap between the last two is what a drafter can gain by reading the
features; docs/recipe.md ("A third sweep") used it to find that the drafter
was barely ahead of the n-gram tables. Two more questions, each one flag:

* ``--each-layer``: which target layer says most? The features probe once per
  captured layer alone (``--layer-ids`` chooses the layers to capture).
* ``--soft``: does the target's own distribution teach better than its greedy
  token? The features probe trained on the hard label, on the target's
  softmax at position ``a`` (its final norm applied to the captured last
  layer, which must be the target's last), and on both; scored the same way.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import load_config  # noqa: E402
from drafter_worker.model.dflash_model import build_target_layer_ids  # noqa: E402
from target_server.data import token_ranking  # noqa: E402
from drafter_worker.model.distill_loss import teacher_hidden  # noqa: E402
from common.model_loader import embedding_weights, final_norm_weight, load_target  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from recipe_sweep import capture_all, feature_cache_path, sweep_dataset  # noqa: E402  (same data and feature cache)


def positions(samples, feats, idx, teacher=None):
    """(features of a-1, token a, token a-1, token a+1[, teacher input at a]) for every trained a+1 of ``idx``."""
    x, cur, prev, nxt, at = [], [], [], [], []
    for j in idx:
        ids, mask = samples[j].input_ids.long(), samples[j].loss_mask
        for a in range(1, len(ids) - 1):
            if mask[a + 1]:
                x.append(feats[j][a - 1])
                cur.append(ids[a])
                prev.append(ids[a - 1])
                nxt.append(ids[a + 1])
                if teacher is not None:
                    at.append(teacher[j][a])
    out = (torch.stack(x), torch.stack(cur), torch.stack(prev), torch.stack(nxt))
    return (*out, torch.stack(at)) if teacher is not None else out


def ngram_accuracy(samples, train_idx, test_idx, n: int) -> float:
    table: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for j in train_idx:
        ids, mask = samples[j].input_ids.tolist(), samples[j].loss_mask.tolist()
        for t in range(n, len(ids)):
            if mask[t]:
                table[tuple(ids[t - n:t])][ids[t]] += 1
    hits = total = 0
    for j in test_idx:
        ids, mask = samples[j].input_ids.tolist(), samples[j].loss_mask.tolist()
        for t in range(max(n, 2), len(ids)):  # the positions the probes score (a + 1 >= 2)
            if mask[t]:
                total += 1
                counts = table.get(tuple(ids[t - n:t]))
                hits += int(bool(counts) and counts.most_common(1)[0][0] == ids[t])
    return hits / max(total, 1)


def train_probe(train, test, embed, head, vocab_ids, use_features: bool, steps: int, seed: int,
                labels: str = "hard", norm=None) -> tuple[float, float]:
    """(train accuracy, held-out accuracy) of an MLP over the draft vocabulary ``vocab_ids``.

    ``labels``: ``hard`` (token a+1), ``soft`` (the target's softmax at a: ``train[4]`` is its last
    layer there, ``norm`` its final (weight, eps)) or ``both`` (the mean of the two losses)."""
    torch.manual_seed(seed)
    hidden = embed.shape[1]
    rms = train[0].pow(2).mean(0).sqrt().clamp(min=1e-6)  # the captured layers' massive dimensions

    def inputs(x, cur, prev):
        parts = [embed[cur], embed[prev]]
        return torch.cat([x / rms, *parts], dim=1) if use_features else torch.cat(parts, dim=1)

    width = (train[0].shape[1] if use_features else 0) + 2 * hidden
    net = torch.nn.Sequential(torch.nn.Linear(width, 1536), torch.nn.SiLU(), torch.nn.Linear(1536, hidden),
                              torch.nn.LayerNorm(hidden))
    scale = torch.nn.Parameter(torch.tensor(1.0))
    opt = torch.optim.AdamW([*net.parameters(), scale], lr=1e-3)
    remap = torch.full((embed.shape[0],), -1, dtype=torch.long)
    remap[vocab_ids] = torch.arange(len(vocab_ids))
    rows = head[vocab_ids]
    for _ in range(steps):
        b = torch.randint(0, len(train[3]), (512,))
        target = remap[train[3][b]]
        keep = target >= 0
        logits = net(inputs(train[0][b], train[1][b], train[2][b])) @ rows.T * scale
        hard = F.cross_entropy(logits[keep], target[keep])
        if labels == "hard":
            loss = hard
        else:
            q = F.softmax(teacher_hidden(train[4][b], *norm) @ rows.T, -1)
            soft = -(q * F.log_softmax(logits, -1)).sum(-1).mean()
            loss = soft if labels == "soft" else 0.5 * (hard + soft)
        opt.zero_grad()
        loss.backward()
        opt.step()

    @torch.no_grad()
    def accuracy(data, limit: int = 5000) -> float:
        x, cur, prev, nxt = (t[:limit] for t in data[:4])
        predicted = vocab_ids[(net(inputs(x, cur, prev)) @ rows.T).argmax(1)]
        return float((predicted == nxt).float().mean())

    return accuracy(train), accuracy(test)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--samples", type=int, default=340, help="training samples whose features recipe_sweep captured")
    p.add_argument("--holdout", type=int, default=40, help="the last this many of them score the predictors")
    p.add_argument("--steps", type=int, default=1500, help="probe training steps (512 positions each)")
    p.add_argument("--layer-ids", help="capture these target layers (comma-separated) instead of the config's")
    p.add_argument("--layer", type=int, help="give the probe only this captured layer's features (index in the list)")
    p.add_argument("--each-layer", action="store_true", help="the features probe once per captured layer alone")
    p.add_argument("--soft", action="store_true",
                   help="the features probe on hard labels, the target's distribution and both")
    p.add_argument("--vocab", type=int, default=8192, help="the probe scores the most used answer tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--feature-dir", default="/tmp/dflash-sweep")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    loaded = load_target(cfg.target.model, device="cpu", dtype=torch.float32)
    ds = sweep_dataset(cfg, loaded, args.samples)
    layer_ids = ([int(x) for x in args.layer_ids.split(",")] if args.layer_ids else
                 cfg.target.target_layer_ids or build_target_layer_ids(loaded.num_layers, cfg.target.num_captured_layers))
    cache = feature_cache_path(args.feature_dir, cfg, len(ds.train), layer_ids)
    if cache.is_file():
        feats = torch.load(cache)
    else:
        feats = capture_all(loaded, layer_ids, ds.train)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(feats, cache)
    h = loaded.hidden_size
    n = len(ds.train)
    train_idx, test_idx = list(range(n - args.holdout)), list(range(n - args.holdout, n))
    embed, head, _ = embedding_weights(loaded.model)
    embed, head = embed.float(), head.float()
    vocab_ids = torch.tensor(token_ranking(ds.train, loaded.vocab_size, args.vocab)[: args.vocab])

    def one_layer(i: int) -> dict:
        return {j: f[:, i * h:(i + 1) * h] for j, f in feats.items()}

    if args.each_layer:
        for i, layer in enumerate(layer_ids):
            single = one_layer(i)
            train, test = positions(ds.train, single, train_idx), positions(ds.train, single, test_idx)
            tr, te = train_probe(train, test, embed, head, vocab_ids, True, args.steps, seed=0)
            print(json.dumps({"layer": layer, "train": round(tr, 3), "held_out": round(te, 3)}), flush=True)
        return 0
    if args.soft:
        if layer_ids[-1] != loaded.num_layers - 1:
            print(f"--soft needs the target's last layer ({loaded.num_layers - 1}) last in --layer-ids", file=sys.stderr)
            return 2
        norm = final_norm_weight(loaded.model)
        last = one_layer(len(layer_ids) - 1)
        use = one_layer(args.layer) if args.layer is not None else feats
        train, test = positions(ds.train, use, train_idx, last), positions(ds.train, use, test_idx, last)
        for labels in ("hard", "soft", "both"):
            tr, te = train_probe(train, test, embed, head, vocab_ids, True, args.steps, seed=0, labels=labels, norm=norm)
            print(json.dumps({"labels": labels, "train": round(tr, 3), "held_out": round(te, 3)}), flush=True)
        return 0
    if args.layer is not None:
        feats = one_layer(args.layer)
    train, test = positions(ds.train, feats, train_idx), positions(ds.train, feats, test_idx)
    rows = {"positions": {"train": len(train[3]), "held_out": len(test[3])},
            "bigram": ngram_accuracy(ds.train, train_idx, test_idx, 1),
            "trigram": ngram_accuracy(ds.train, train_idx, test_idx, 2)}
    for name, use in (("probe_tokens", False), ("probe_tokens_and_features", True)):
        tr, te = train_probe(train, test, embed, head, vocab_ids, use, args.steps, seed=0)
        rows[name] = {"train": round(tr, 3), "held_out": round(te, 3)}
        print(name, rows[name], flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
