"""Compare drafter recipes quickly: same captured features, same time budget, measured tau.

    python bench/recipe_sweep.py --config configs/quality.toml --minutes 6 \\
        --variant base: --variant bs16:drafter.block_size=16 --variant lr3e-3:drafter.learning_rate=3e-3

The target captures the features of the first ``--samples`` training samples
once (kept on disk under ``--feature-dir`` for later runs); each variant then
trains a fresh drafter on them for the same wall-clock budget, in the
drafter's real training step (``DrafterTrainer``: anchors, loss, fused AdamW;
the cosine spans the steps the budget allows at the variant's own pace,
estimated from its first steps), and is evaluated with real speculative
decoding against the target on held-out prompts, plain greedy timed side by
side. ``docs/recipe.md``'s table of settings was measured with it; the recipe
itself then runs in the real pipeline (``make quality``). ``--time-steps N``
only times each variant's training step on one real batch, round-robin, as
ratios to the first variant's.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import load_config  # noqa: E402
from drafter_worker.model.dflash_model import (  # noqa: E402
    DFlashDrafter, _block_hidden, _weighted_slot_loss, build_block_inputs, build_causal_block_inputs, build_target_layer_ids, init_feature_scale,
    init_logit_scale, make_drafter_config, sample_anchors)
from drafter_worker.trainer import DrafterTrainer, make_optimizer  # noqa: E402
from drafter_worker.model.target_layers import copy_target_layers  # noqa: E402
from target_server.capture import LayerCapture  # noqa: E402
from target_server.data import build_dataset, token_ranking  # noqa: E402
from common.model_loader import (  # noqa: E402
    decoder_layers, embedding_weights, final_norm_weight, load_target, pick_mask_token_id)
from tools.eval import evaluate, stop_token_ids  # noqa: E402


def capture_all(loaded, layer_ids, samples, batch_tokens: int = 1024):
    capture = LayerCapture(loaded.model, layer_ids)
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]))
    out: dict[int, torch.Tensor] = {}
    i = 0
    while i < len(order):
        length = len(samples[order[i]])
        rows = max(1, batch_tokens // length)
        idx = order[i : i + rows]
        seq = max(len(samples[j]) for j in idx)
        ids = torch.full((len(idx), seq), loaded.pad_token_id, dtype=torch.long)
        for r, j in enumerate(idx):
            ids[r, : len(samples[j])] = samples[j].input_ids.long()
        buf = torch.empty(len(idx), seq, len(layer_ids) * loaded.hidden_size)
        capture.run(ids, buf)
        for r, j in enumerate(idx):
            out[j] = buf[r, : len(samples[j])].clone()
        i += rows
    capture.close()  # its hooks would fire in the evaluation's forward passes
    return out


def batches(samples, feats, rng: random.Random, seqs: int):
    """Endless random batches of ``seqs`` samples, padded to the longest (epoch by epoch)."""
    while True:
        order = list(range(len(samples)))
        rng.shuffle(order)
        for k in range(0, len(order) - seqs + 1, seqs):
            idx = order[k : k + seqs]
            seq = max(len(samples[j]) for j in idx)
            f = torch.zeros(len(idx), seq, feats[idx[0]].shape[-1])
            ids = torch.zeros(len(idx), seq, dtype=torch.int32)
            mask = torch.zeros(len(idx), seq, dtype=torch.uint8)
            lens = torch.zeros(len(idx), dtype=torch.int32)
            for r, j in enumerate(idx):
                n = len(samples[j])
                f[r, :n] = feats[j]
                ids[r, :n] = samples[j].input_ids
                mask[r, :n] = samples[j].loss_mask
                lens[r] = n
            yield f, ids, mask, lens


def _every_anchor(model, sample, sample_feats, embed, reveal: int = 0):
    """Every eligible anchor of one answer as a block: ``(anchors, valid, block inputs, drafter hidden
    states of slots 1..)``. ``reveal``: each block shows its first this many draft slots' true tokens
    (a later denoising pass)."""
    ids, mask, lens = sample.input_ids.long()[None], sample.loss_mask[None], torch.tensor([len(sample)])
    anchors, valid = sample_anchors(mask, lens, len(sample))
    if model.causal_passes:  # every pass of a block at once, each seeing the true tokens before its slot
        inputs = build_causal_block_inputs(input_ids=ids, loss_mask=mask, lengths=lens, anchors=anchors,
                                           anchor_valid=valid, block_size=model.block_size,
                                           mask_token_id=model.mask_token_id)
    else:
        inputs = build_block_inputs(input_ids=ids, loss_mask=mask, lengths=lens, anchors=anchors, anchor_valid=valid,
                                    block_size=model.block_size, mask_token_id=model.mask_token_id,
                                    reveal=torch.full_like(anchors, reveal) if reveal else None)
    return anchors, valid, inputs, _block_hidden(model, inputs, sample_feats[None], embed, anchors)


@torch.no_grad()
def heldout_acceptance(model, samples, feats, embed, head, idx, passes: int = 1) -> tuple[float, list[float], float]:
    """Teacher-forced tau on the samples ``idx``: every eligible anchor of every sample, drafted once.

    On the target's own greedy answers a drafter's context at an anchor is exactly what speculative
    decoding gives it (the target's features of the true prefix), so the drafts at every anchor are
    the ones decoding would make there. Returns ``(position-averaged tau, acceptance by block
    position, decoding tau)``: the first averages over every anchor; the last walks each answer as
    greedy speculative decoding does (from its first token, each step moving past the accepted
    drafts and the target's own token), which weighs the positions as decoding visits them (hard
    stretches take more steps) and is exact for greedy decoding of these answers, without the noise
    of timing a few hundred steps. A block running past the end of its answer counts its missing
    slots as rejected. ``passes`` > 1 drafts each block in that many denoising passes, pass i fixing
    slot i + 1 (the last pass all the rest): the true tokens stand in for the earlier passes' drafts,
    exact for every draft that can still be accepted.
    """
    model.eval()
    bs = model.block_size
    accepted = torch.zeros(bs - 1)
    blocks = 0
    walks = []
    for j in idx:
        s = samples[j]
        anchors, valid, inputs, hidden = _every_anchor(model, s, feats[j], embed)
        label_valid = inputs.label_valid[:, :, 1:]
        _, hits = _weighted_slot_loss(model, hidden, inputs, head, 1.0, "auto")
        for r in range(1, 1 if model.causal_passes else min(passes, bs - 1)):
            _, _, later, later_hidden = _every_anchor(model, s, feats[j], embed, reveal=r)
            _, later_hits = _weighted_slot_loss(model, later_hidden, later, head, 1.0, "auto")
            hits[:, :, r:] = later_hits[:, :, r:]
        run = (hits.bool() & label_valid).long().cumprod(-1)  # slots 1..k all right
        accepted += run[valid].sum(0).float()
        blocks += int(valid.sum())
        walks.append((s.loss_mask.tolist().index(1), dict(zip(anchors[valid].tolist(), run[valid].sum(-1).tolist()))))
    model.train()
    rates = (accepted / max(blocks, 1)).tolist()
    return 1.0 + sum(rates), rates, decoding_walk(walks)


def decoding_walk(answers) -> float:
    """Tokens a step when each answer is decoded from its first token (the prefill's output), each step
    moving past the drafts accepted at its anchor and the target's own token. ``answers``: ``(first answer
    position, {anchor: drafts accepted there})`` per answer."""
    steps = tokens = 0
    for a, accepted in answers:
        while a in accepted:
            steps, tokens, a = steps + 1, tokens + accepted[a] + 1, a + accepted[a] + 1
    return tokens / max(steps, 1)


@torch.no_grad()
def slot_ranks(model, samples, feats, embed, head, idx, top: int) -> list[tuple[int, dict[int, tuple[int, ...]]]]:
    """For each answer of ``idx``: its first answer position, and for every eligible anchor the rank of the
    right token in each draft slot's logits (``top`` when it is not among the first ``top`` or cannot be drafted)."""
    model.eval()
    answers = []
    for j in idx:
        s = samples[j]
        anchors, valid, inputs, hidden = _every_anchor(model, s, feats[j], embed)
        rows, labels, in_vocab = model.head_and_labels(head, inputs.labels[:, :, 1:])
        logits = hidden @ rows.T
        hit = logits.topk(top, dim=-1).indices == labels[..., None]
        found = hit.any(-1) & inputs.label_valid[:, :, 1:].bool()
        if in_vocab is not None:
            found &= in_vocab.bool()
        ranks = torch.where(found, hit.float().argmax(-1), torch.full_like(labels, top))
        answers.append((s.loss_mask.tolist().index(1), dict(zip(anchors[valid].tolist(), map(tuple, ranks[valid].tolist())))))
    model.train()
    return answers


def tree_accepts(tree, ranks: tuple[int, ...]) -> int:
    """Drafts a step accepts when the target verifies ``tree`` (prefix-closed paths of per-slot ranks) at once."""
    return max((len(path) for path in tree if ranks[: len(path)] == path), default=0)


def tree_walk_tau(tree, answers) -> float:
    """The decoding walk when every step verifies ``tree``."""
    return decoding_walk([(a, {k: tree_accepts(tree, r) for k, r in ranks.items()}) for a, ranks in answers])


def greedy_tree(answers, nodes: int, top: int, depth: int) -> list[tuple[int, ...]]:
    """The ``nodes`` rank paths most often all right on ``answers``, added one at a time (each with its parent)."""
    seen = [r for _, ranks in answers for r in ranks.values()]
    tree: list[tuple[int, ...]] = []
    frontier = {(r,) for r in range(top)}
    while len(tree) < nodes and frontier:
        best = max(sorted(frontier), key=lambda path: sum(r[: len(path)] == path for r in seen))
        tree.append(best)
        frontier.remove(best)
        if len(best) < depth:
            frontier |= {best + (r,) for r in range(top)}
    return tree


def sweep_dataset(cfg, loaded, samples: int):
    """The first ``samples`` samples of the config's data, split as the target splits them."""
    return build_dataset(loaded.tokenizer, cfg.data.source, max_seq_len=cfg.data.max_seq_len, seed=cfg.data.seed,
                         heldout_fraction=cfg.data.heldout_fraction, max_samples=samples,
                         data_format=cfg.data.format, chat_template_kwargs=cfg.data.chat_template_kwargs,
                         num_proc=cfg.data.num_proc, cache_dir=cfg.data.cache_dir)


def feature_cache_path(feature_dir: str, cfg, num_train: int, layer_ids: list[int], dtype: str = "float32") -> Path:
    """Where the captured features of this data, these layers and this target dtype are kept between runs."""
    parts = [cfg.data.source, os.path.getsize(cfg.data.source), num_train, layer_ids]
    key = hashlib.sha256(json.dumps(parts if dtype == "float32" else [*parts, dtype]).encode()).hexdigest()[:12]
    return Path(feature_dir) / f"features-{key}.pt"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], help="override for every variant")
    p.add_argument("--variant", action="append", required=True, help="NAME:key=value,key=value (or ; between settings)")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--steps", type=int, default=0,
                   help="train each variant this many steps instead of --minutes (fair when the machine is shared)")
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--seqs", type=int, default=4, help="sequences per step")
    p.add_argument("--holdout", type=int, default=40,
                   help="the last this many captured samples are not trained on; they score teacher-forced tau")
    p.add_argument("--train-samples", type=int, default=0,
                   help="train on only the first this many of the samples before --holdout (0: all of them); "
                        "the held-out answers stay the same, so runs with different amounts of data compare")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts of measured tau (0: skip it)")
    p.add_argument("--eval-on", choices=("heldout-split", "holdout"), default="heldout-split",
                   help="measured tau on the data's held-out conversations, or on the --holdout samples that "
                        "teacher-forced tau scores (the two then measure the same answers)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tree-nodes", default="",
                   help="also score verification trees of these many drafts (e.g. 3,8,12): built on the first half "
                        "of the --holdout answers from the per-slot ranks of the right tokens, walked on the second")
    p.add_argument("--denoise-passes", type=int, default=1,
                   help="also score the decoding walk with blocks drafted in this many denoising passes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--time-steps", type=int, default=0,
                   help="only time each variant's training step (this many steps a round, 5 rounds, round-robin) "
                        "and print its ratio to the first variant's")
    p.add_argument("--out", type=Path, default=Path("bench/recipe_sweep.jsonl"))
    p.add_argument("--feature-dir", default="/tmp/dflash-sweep", help="captured features are kept here between runs")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    loaded = load_target(cfg.target.model, device="cpu", dtype=torch.float32)
    ds = sweep_dataset(cfg, loaded, args.samples)
    mask_id = pick_mask_token_id(loaded.tokenizer, None, vocab_size=loaded.vocab_size)
    captured: dict[tuple, dict] = {}

    targets = {"float32": loaded}

    def features(layer_ids: list[int], dtype: str = "float32") -> dict:
        """The training samples' features of these target layers, the target run in ``dtype`` (a variant's
        ``target.dtype``) for the trained samples; the held-out ones always come from the float32 target,
        so variants are scored on the same features. Captured once, kept on disk."""
        key = (tuple(layer_ids), dtype)
        if key not in captured:
            captured.clear()  # one layer set in memory at a time
            t0 = time.monotonic()
            cache = feature_cache_path(args.feature_dir, cfg, len(ds.train), layer_ids, dtype)
            if cache.is_file():
                captured[key] = torch.load(cache)
            else:
                if dtype not in targets:
                    targets[dtype] = load_target(cfg.target.model, device="cpu", dtype=getattr(torch, dtype))
                feats = capture_all(targets[dtype], layer_ids, ds.train)
                if dtype != "float32":
                    feats.update({j: f for j, f in features(layer_ids).items() if j >= n_train})
                    captured.clear()
                captured[key] = feats
                cache.parent.mkdir(parents=True, exist_ok=True)
                torch.save(feats, cache)
            print(f"features of layers {layer_ids} ({dtype} target) for {len(ds.train)} samples ready in "
                  f"{time.monotonic() - t0:.0f}s ({cache})", flush=True)
        return captured[key]
    embed, head, _ = embedding_weights(loaded.model)
    embed, head = embed.float(), head.float()
    n_train = len(ds.train) - args.holdout
    prompts = []
    for s in ds.heldout if args.eval_on == "heldout-split" else ds.train[n_train:]:
        m = s.loss_mask.tolist()
        if 1 in m and m.index(1) > 0:
            prompts.append(s.input_ids[: m.index(1)].tolist())
    prompts = prompts[: args.eval_prompts]
    stops = stop_token_ids(loaded.tokenizer, loaded.model)
    trained_on = ds.train[: min(n_train, args.train_samples or n_train)]
    ranking = token_ranking(trained_on, loaded.vocab_size, 1 << 15)
    arch = loaded.config

    def build_variant(spec: str):
        """One variant's settings, features, fresh drafter and trainer, as the sweep trains it."""
        name, _, sets = spec.partition(":")
        # ";" separates settings when a value is a list (layer_types=["a","b"]).
        kvs = [kv for kv in sets.split(";" if ";" in sets else ",") if kv]
        overrides = [f"drafter.{kv}" if not kv.startswith(("drafter.", "data.", "target.")) else kv for kv in kvs]
        full = load_config(args.config, [*args.overrides, *overrides])
        # The sweep's own budget (--steps or --minutes) sets the cosine, not the recipe's run length.
        vcfg = dataclasses.replace(full.drafter, decay_steps=0, decay_minutes=0.0)
        layer_ids = full.target.target_layer_ids or build_target_layer_ids(loaded.num_layers,
                                                                            full.target.num_captured_layers)
        feats = features(layer_ids, full.target.dtype)
        config = make_drafter_config(
            hidden_size=loaded.hidden_size, num_attention_heads=arch.num_attention_heads,
            num_key_value_heads=vcfg.num_key_value_heads or arch.num_key_value_heads, head_dim=loaded.hidden_size // arch.num_attention_heads,
            intermediate_size=arch.intermediate_size, vocab_size=loaded.vocab_size, rms_norm_eps=arch.rms_norm_eps,
            rope_theta=float((getattr(arch, "rope_parameters", None) or {}).get("rope_theta", getattr(arch, "rope_theta", 10000.0))),
            max_position_embeddings=arch.max_position_embeddings, num_hidden_layers=vcfg.num_layers,
            num_target_layers=loaded.num_layers, target_layer_ids=layer_ids, block_size=vcfg.block_size,
            mask_token_id=mask_id, draft_vocab_size=vcfg.draft_vocab_size,
            layer_types=vcfg.layer_types, sliding_window=vcfg.sliding_window, denoise_passes=vcfg.denoise_passes,
            causal_passes=vcfg.causal_passes, draft_head=vcfg.train_draft_head)
        torch.manual_seed(vcfg.seed)
        model = DFlashDrafter(config)
        if vcfg.draft_vocab_size:
            ranked = ranking[: vcfg.draft_vocab_size]
            ranked += [t for t in range(loaded.vocab_size) if t not in set(ranked)][: vcfg.draft_vocab_size - len(ranked)]
            model.set_draft_vocab(ranked)
            if model.draft_head is not None:
                model.init_draft_head(head)
        fc_from_target = bool(vcfg.init_target_layers) and copy_target_layers(
            model, decoder_layers(loaded.model), vcfg.init_target_layers, layer_ids)
        if vcfg.logit_std_init > 0:
            init_logit_scale(model, embed, head, vcfg.logit_std_init, seed=vcfg.seed)
        if vcfg.feature_scale_init and not fc_from_target:
            f0, _, _, l0 = next(batches(trained_on, feats, random.Random(vcfg.seed + 1), 8))
            init_feature_scale(model, f0, l0)
        gen = torch.Generator().manual_seed(vcfg.seed)
        trainer = DrafterTrainer(vcfg, model, make_optimizer(vcfg, model), gen, 0)
        if vcfg.distill_weight > 0:
            if layer_ids[-1] != loaded.num_layers - 1:
                raise SystemExit(f"{name}: distill_weight needs the target's last layer captured, not {layer_ids}")
            trainer.teacher_norm = final_norm_weight(loaded.model)
        return name, overrides, vcfg, layer_ids, feats, model, trainer

    if args.time_steps:
        # Each variant's drafter step on the same real batch, timed round-robin in this one process:
        # ratios to the first variant, fair on a shared machine (no training, no evaluation).
        timed = []
        for spec in args.variant:
            name, _, _, _, feats, _, trainer = build_variant(spec)
            batch = next(batches(trained_on, feats, random.Random(0), args.seqs))
            for _ in range(2):  # allocator and kernel set-up
                trainer.train_step(*batch, embed, head)
            timed.append((name, trainer, batch, []))
        for _ in range(5):
            for name, trainer, batch, runs in timed:
                t0 = time.perf_counter()
                for _ in range(args.time_steps):
                    trainer.train_step(*batch, embed, head)
                runs.append((time.perf_counter() - t0) / args.time_steps)
        base = min(timed[0][3])
        for name, _, _, runs in timed:
            print(json.dumps({"variant": name, "step_ms": round(1000 * min(runs)), "x_first": round(min(runs) / base, 2)}))
        return 0
    for spec in args.variant:
        name, overrides, vcfg, layer_ids, feats, model, trainer = build_variant(spec)
        data = batches(trained_on, feats, random.Random(vcfg.seed), args.seqs)
        # Schedule: estimate the budget's steps from the first 3 steps' pace.
        budget = args.minutes * 60
        start = time.monotonic()
        blocks = 0
        losses = []
        if args.steps:
            trainer.plan_steps = args.steps
        while (trainer.step < args.steps) if args.steps else (time.monotonic() - start < budget):
            f, ids, mask, lens = next(data)
            if trainer.step == 3 and not args.steps:
                pace = (time.monotonic() - start) / 3
                trainer.plan_steps = int(budget / pace)
            trainer.train_step(f, ids, mask, lens, embed, head)
            blocks += int(min(vcfg.anchors_per_sequence, int(lens.max())) * len(lens))
            if trainer.step % 10 == 0 and trainer.metrics.snapshot():
                v = trainer.metrics.poll()
                losses.append(v["loss_sum"][0] / max(v["finite_steps"][0], 1))
        train_s = time.monotonic() - start
        tf_tau, tf_accept, walk_tau = heldout_acceptance(model, ds.train, feats, embed, head, range(n_train, len(ds.train)))
        denoised = {}
        for passes in range(2, args.denoise_passes + 1):
            _, accept_p, walk_p = heldout_acceptance(model, ds.train, feats, embed, head, range(n_train, len(ds.train)), passes)
            denoised[str(passes)] = {"walk_tau": round(walk_p, 3), "accept": [round(a, 3) for a in accept_p]}
        trees = {}
        if args.tree_nodes:
            answers = slot_ranks(model, ds.train, feats, embed, head, range(n_train, len(ds.train)), top=8)
            build, score = answers[: len(answers) // 2], answers[len(answers) // 2:]
            chain = [(0,) * d for d in range(1, model.block_size)]
            trees["chain"] = {"tau": round(tree_walk_tau(chain, score), 3), "paths": chain}
            for nodes in map(int, args.tree_nodes.split(",")):
                tree = greedy_tree(build, nodes, top=8, depth=model.block_size - 1)
                trees[str(nodes)] = {"tau": round(tree_walk_tau(tree, score), 3), "paths": tree}
        walk_of_eval = None
        if args.eval_on == "holdout" and prompts:  # the same answers measured tau decodes
            eval_idx = [j for j in range(n_train, len(ds.train)) if 0 < ds.train[j].loss_mask.tolist().index(1)]
            walk_of_eval = round(heldout_acceptance(model, ds.train, feats, embed, head, eval_idx[: len(prompts)])[2], 3)
        model.eval()
        report = (evaluate(loaded.model, model, prompts, max_new_tokens=args.max_new_tokens, stop_tokens=stops)
                  if prompts else {"tau": float("nan"), "acceptance_rate": [], "speedup": float("nan")})
        row = {"variant": name, "overrides": overrides, "layers": layer_ids, "minutes": round(train_s / 60, 1), "steps": trainer.step,
               "blocks": blocks, "train_s": round(train_s), "loss_last": losses[-1] if losses else None,
               "heldout_tau": round(tf_tau, 3), "heldout_accept": [round(a, 3) for a in tf_accept],
               "heldout_walk_tau": round(walk_tau, 3), "denoised": denoised, "walk_tau_of_eval_prompts": walk_of_eval, "tree_walk_tau": trees,
               "tau": round(report["tau"], 3), "accept": [round(a, 3) for a in report["acceptance_rate"]],
               "speedup": round(report["speedup"], 3), "samples": len(ds.train),
               "train_samples": len(trained_on)}
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
