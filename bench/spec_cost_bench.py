"""What one speculative step costs against one plain decoding step, on this machine.

    .venv/bin/python bench/spec_cost_bench.py --drafter runs/quality/export/q0 [--context 300] [--rounds 30]

Three timings with a ``--context``-token KV cache, interleaved round by round
(median of ``--rounds``): a plain greedy step (the target over one token), a
verification (the target over the anchor and ``--draft-tokens`` drafts, with
the hidden states the drafter needs) and a drafting pass of the drafter (two
new context positions, the cached rest). The speculative step costs
``verify + draft``, so a drafter pays for itself from
``tau = (verify + draft) / plain`` on: printed as the break-even tau, with the
speed-up the measured ``--tau`` would give. Each is timed twice in every round:
with the models' own linear layers and as evaluation decodes (``tools.small_linears``,
and eager attention for a bf16 target: ``--dtype``). Weights do not change the timings: any drafter of the
right shape will do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from drafter_worker.model.dflash_model import load_drafter  # noqa: E402
from common.model_loader import embedding_weights, load_target  # noqa: E402
from common.devices import resolve_dtype  # noqa: E402
from common.packing import dtype_from_name, dtype_name  # noqa: E402
from tools.speculative import (DFlashProposer, _new_cache, _target_forward, crop_cache,  # noqa: E402
                               evaluation_decoding, target_features)


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1000.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, required=True, help="an exported drafter or checkpoint directory")
    p.add_argument("--model", default="smollm2", help="the target (target.model syntax)")
    p.add_argument("--context", type=int, default=300, help="tokens already in the caches")
    p.add_argument("--draft-tokens", type=int, default=0, help="drafts verified a step (0: the whole block)")
    p.add_argument("--denoise-passes", type=int, default=0, help="drafting passes a block takes (0: the drafter's own)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32",
                   help="the target's dtype, the drafter cast to it as dflash-eval does (float32, bfloat16, auto)")
    p.add_argument("--tau", type=float, default=0.0, help="also print the speed-up at this tau")
    p.add_argument("--verify-lengths", default="",
                   help="also time the target over this many tokens with small-row linears (e.g. 1,4,5,8,13): "
                        "what a longer block or a tree of drafts would cost to verify")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = dtype_from_name(resolve_dtype(args.dtype, "cpu"))
    loaded = load_target(args.model, dtype=dtype)
    target = loaded.model
    drafter = load_drafter(args.drafter).to(dtype=dtype)
    embed, head, _ = embedding_weights(target)
    proposer = DFlashProposer(drafter, embed, head, args.denoise_passes or None)
    drafts = args.draft_tokens or proposer.block_size - 1
    layer_ids = proposer.layer_ids
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, loaded.vocab_size - 100, (args.context,), generator=gen).tolist()

    with torch.inference_mode():
        cache = _new_cache(target)
        out = _target_forward(target, context, 0, cache, hidden=True, last_only=True)
        proposer.reset()
        proposer.propose(target_features(out.hidden_states, layer_ids)[:, :-2], context[-2], args.context - 2, drafts)
        fresh = target_features(out.hidden_states, layer_ids)[:, -2:]
        n = args.context

        def plain() -> None:
            _target_forward(target, [context[-1]], n, cache, hidden=False, last_only=True)
            crop_cache(cache, n)

        def verify() -> None:
            _target_forward(target, context[-1 - drafts:], n, cache, hidden=True, last_only=False)
            crop_cache(cache, n)

        def draft() -> None:
            proposer.propose(fresh, context[-1], n, drafts)
            proposer.cache.crop(n - 2)

        def verify_length(tokens: int):
            def run() -> None:
                _target_forward(target, context[-tokens:], n, cache, hidden=True, last_only=False)
                crop_cache(cache, n)
            return run

        lengths = [int(x) for x in args.verify_lengths.split(",") if x]
        modes = {"own": contextlib.nullcontext, "small_rows": lambda: evaluation_decoding(target, drafter)}
        times: dict[str, dict[str, list[float]]] = {mode: {"plain": [], "verify": [], "draft": []} for mode in modes}
        by_length: dict[int, list[float]] = {tokens: [] for tokens in lengths}
        for _ in range(args.rounds + 1):  # the first round warms up
            for mode, linears in modes.items():
                with linears():
                    for name, fn in (("plain", plain), ("verify", verify), ("draft", draft)):
                        times[mode][name].append(_timed(fn))
            with evaluation_decoding(target, drafter):
                for tokens in lengths:
                    by_length[tokens].append(_timed(verify_length(tokens)))
    print(f"{dtype_name(dtype)} target, context {args.context} tokens, block {proposer.block_size} "
          f"({drafts} drafts verified, {proposer.denoise_passes} drafting passes), "
          f"{args.threads} threads, median of {args.rounds} interleaved rounds:")
    result: dict = {"dtype": dtype_name(dtype), "context": args.context, "block_size": proposer.block_size,
                    "draft_tokens": drafts, "denoise_passes": proposer.denoise_passes,
                    "threads": args.threads}
    for mode in modes:
        ms = {name: statistics.median(values[1:]) for name, values in times[mode].items()}
        break_even = (ms["verify"] + ms["draft"]) / ms["plain"]
        print(f"  linear layers: {mode}")
        print(f"    plain step   {ms['plain']:7.1f} ms")
        print(f"    verification {ms['verify']:7.1f} ms  ({ms['verify'] / ms['plain']:.2f}x a plain step)")
        print(f"    drafting     {ms['draft']:7.1f} ms  ({ms['draft'] / ms['plain']:.2f}x a plain step)")
        print(f"    break-even tau {break_even:.2f}")
        row = {**{f"{k}_ms": round(v, 2) for k, v in ms.items()}, "break_even_tau": round(break_even, 3)}
        if args.tau:
            row["speedup_at_tau"] = round(args.tau / break_even, 3)
            print(f"    speed-up at tau {args.tau:.2f}: {args.tau / break_even:.2f}x")
        result[mode] = row
    if lengths:
        plain_ms = statistics.median(times["small_rows"]["plain"][1:])
        result["verify_ms_by_tokens"] = {}
        print("  the target over n tokens (small-row linears, with hidden states):")
        for tokens, values in by_length.items():
            ms = statistics.median(values[1:])
            result["verify_ms_by_tokens"][tokens] = round(ms, 2)
            print(f"    {tokens:3d} tokens {ms:7.1f} ms  ({ms / plain_ms:.2f}x a plain step)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
