"""Target capture vs a plain transformers forward (bench row 3).

    .venv/bin/python bench/capture_bench.py [--model smollm2] [--batch 2] [--seq-len 128] [--out FILE]

Both produce the same ``[B, T, k*H]`` feature tensor for the DFlash layers
(``build_target_layer_ids(num_layers, 5)``: [1, 8, 14, 20, 27] on SmolLM2's 30
layers), on the same batch:

- ``capture``: ``target_server.capture.LayerCapture`` hooks copy each captured
  layer's output into a pre-allocated buffer and stop the forward after the
  last one (no later layers, final norm or LM head);
- ``plain``: ``model(input_ids, output_hidden_states=True)`` (the whole model,
  the logits included), then ``torch.cat`` of the chosen hidden states into a
  pre-allocated buffer of the same shape.

Both run under ``torch.inference_mode`` with ``use_cache=False``, one torch
thread by default. After one warm-up each they alternate ``--rounds`` times and
the median throughput (tokens/s) of each is reported with their ratio; the two
outputs are checked to be identical. The model is the real SmolLM2-135M
(``--model smollm2``, about 20 s to load) and falls back to a random 12-layer
Llama (``tests/fixtures.py``) if it cannot be loaded. The last stdout line is
the JSON result.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchlib import median, write_json

from common.layer_ids import build_target_layer_ids  # noqa: E402
from target_server.capture import LayerCapture  # noqa: E402
from common.model_loader import ModelLoadError, load_target  # noqa: E402


def load(model: str, tmp: Path) -> tuple[Any, str, str]:
    """(loaded target, what was loaded, why the fallback was taken or "")."""
    why = "asked for"
    if model != "tiny":
        try:
            return load_target(model), model, ""
        except (ModelLoadError, ImportError, OSError) as exc:
            why = f"{model}: {exc}"
    from tests.fixtures import make_tiny_target

    directory = make_tiny_target(tmp / "tiny", num_layers=12, hidden=256)
    return load_target(str(directory)), "tiny Llama 12x256", why


def plain_forward(model, input_ids: torch.Tensor, layer_ids: list[int], out: torch.Tensor) -> None:
    with torch.inference_mode():
        hidden = model(input_ids=input_ids, use_cache=False, output_hidden_states=True).hidden_states
        # hidden_states[0] is the embedding output: layer i's output is hidden_states[i + 1].
        torch.cat([hidden[i + 1] for i in layer_ids], dim=-1, out=out)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="target.model to load, or 'tiny' (also the fallback): a random 12-layer Llama")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--captured", type=int, default=5, help="captured layers (the DFlash rule spreads them)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="dflash-capture-bench-") as tmp:
        loaded, what, fallback = load(args.model, Path(tmp))
    model = loaded.model
    layer_ids = build_target_layer_ids(loaded.num_layers, args.captured)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, loaded.vocab_size, (args.batch, args.seq_len), generator=gen)
    width = len(layer_ids) * loaded.hidden_size
    captured = torch.empty(args.batch, args.seq_len, width)
    plain = torch.empty_like(captured)

    def run_capture() -> None:
        # Hooks on only while capturing: the plain forward must run the untouched model.
        capture = LayerCapture(model, layer_ids)
        try:
            capture.run(input_ids, captured)
        finally:
            capture.close()

    def run_plain() -> None:
        plain_forward(model, input_ids, layer_ids, plain)

    run_capture()
    run_plain()  # warm-up of both
    max_abs_diff = float((captured - plain).abs().max())
    times: dict[str, list[float]] = {"capture": [], "plain": []}
    for k in range(args.rounds):  # alternate the order so noise hits both alike
        order = (("capture", run_capture), ("plain", run_plain))
        for name, fn in order if k % 2 == 0 else order[::-1]:
            times[name].append(timed(fn))
    tokens = args.batch * args.seq_len
    result = {
        "model": what, "fallback_reason": fallback, "num_layers": loaded.num_layers, "hidden": loaded.hidden_size,
        "vocab": loaded.vocab_size, "captured_layers": layer_ids, "batch": args.batch, "seq_len": args.seq_len,
        "threads": args.threads, "rounds": args.rounds,
        "capture_tokens_per_s": tokens / median(times["capture"]),
        "plain_tokens_per_s": tokens / median(times["plain"]),
        "times_s": times,
        "max_abs_diff": max_abs_diff,
        # Per-round ratio (the two ran next to each other), then the median.
        "capture_vs_plain": median(p / c for c, p in zip(times["capture"], times["plain"])),
    }
    print(f"{what}: capture {result['capture_tokens_per_s']:.0f} tok/s, plain {result['plain_tokens_per_s']:.0f} tok/s, "
          f"ratio {result['capture_vs_plain']:.2f} (max |diff| {max_abs_diff:.1e})")
    write_json(args.out, result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
