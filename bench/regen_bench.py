"""``dflash-regen``'s answering against plain batched ``generate`` on the same prompts, side by side.

    .venv/bin/python bench/regen_bench.py [--prompts data/prompts.jsonl] [--batch-size 16] [--rounds 2]

Both sides get the same batch of prompts, greedy, the same ``max_new_tokens``:
``tools.regen.answer_batch`` (chat template, left padding, generate, decode, stop
handling) and a bare ``model.generate`` on pre-tokenized inputs. Rounds
alternate (ABBA) and the median per-round ratio of new tokens per second is
printed, with the JSON result as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.model_loader import load_target  # noqa: E402
from tools.regen import _stop_ids, answer_batch, read_prompts  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=Path, default=ROOT / "data" / "prompts.jsonl")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_target("smollm2")
    model, tok = loaded.model, loaded.tokenizer
    batch = [q.messages for q in read_prompts(args.prompts)[: args.batch_size]]
    stops = _stop_ids(loaded)
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch]
    tok.padding_side = "left"
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    tok.padding_side = "right"

    def regen() -> int:
        answers = answer_batch(model, tok, batch, max_new_tokens=args.max_new_tokens, temperature=0.0,
                               stop_ids=stops, pad_token_id=loaded.pad_token_id, seed=0)
        return sum(n for _, _, n in answers)

    def plain() -> int:
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=loaded.pad_token_id, eos_token_id=stops)
        new = out[:, enc["input_ids"].shape[1]:]
        return sum(next((i + 1 for i, t in enumerate(row) if t in stops), len(row)) for row in new.tolist())

    def timed(fn) -> float:
        start = time.perf_counter()
        tokens = fn()
        return tokens / (time.perf_counter() - start)

    timed(plain)  # warm-up
    ratios, regen_tps, plain_tps = [], [], []
    for r in range(args.rounds):
        order = (regen, plain) if r % 2 == 0 else (plain, regen)
        rates = {fn.__name__: timed(fn) for fn in order}
        regen_tps.append(rates["regen"])
        plain_tps.append(rates["plain"])
        ratios.append(rates["regen"] / rates["plain"])
    result = {"batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
              "regen_tokens_per_s": statistics.median(regen_tps), "plain_generate_tokens_per_s": statistics.median(plain_tps),
              "ratio": statistics.median(ratios)}
    print(f"regen {result['regen_tokens_per_s']:.1f} new tokens/s vs plain batched generate "
          f"{result['plain_generate_tokens_per_s']:.1f}: {result['ratio']:.2f} (batch {args.batch_size}, "
          f"{args.max_new_tokens} new tokens, {args.threads} threads)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
