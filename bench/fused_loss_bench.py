"""Peak memory and time of the LM-head loss: plain reference vs fused versions.

One forward + backward of ``sum(w * CE(hidden @ W^T, labels))`` at the real
SmolLM2 sizes (V=49152, H=576) with N = 16 blocks x 15 scored slots x 8 rows
= 1920 positions, the LM head frozen (pass ``--train-head`` to also build
grad_weight).  Every method runs on the same inputs in this one process, and
their results are cross-checked against the plain one.

Peak memory is what the step allocates above its inputs: on CUDA
``torch.cuda.max_memory_allocated``; on CPU a ``TorchDispatchMode`` that adds
each new storage an op returns and subtracts it when the storage is freed (a
separate, untimed run).  After one warm-up each, the methods are timed
round-robin ``--repeats`` times; ``time_s`` is the fastest run (the least
disturbed on a shared machine), ``median_s`` is also reported.

    .venv/bin/python bench/fused_loss_bench.py               # CPU: plain vs chunked
    .venv/bin/python bench/fused_loss_bench.py --device cuda # + triton

The last stdout line is a JSON dict (also written to ``--out`` if given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from drafter_worker.model.lm_loss import chunked_lm_head_loss, lm_head_loss, triton_lm_head_loss  # noqa: E402

LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created by ops while active and still alive (CPU or CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[tuple[str, int], int] = {}

    def _free(self, key: tuple[str, int]) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            (str(t.device), t.untyped_storage().data_ptr())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in self._sizes or key in inputs:
                continue  # empty, already counted, or a view / in-place result of an input
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            # Storages keep their Python object while C++ holds them (e.g. saved
            # for backward), so this fires when the memory is really released.
            weakref.finalize(storage, self._free, key)
        return out


def make_inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n, h, v = args.n, args.hidden, args.vocab
    hidden = torch.randn(n, h, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=gen) * h**-0.5 * 4).to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    weights = torch.rand(n, generator=gen).to(device)
    weights[::7] = 0.0  # some padding positions
    return {"hidden": hidden, "weight": weight, "labels": labels, "weights": weights}


def step(fn: LossFn, inputs: dict[str, torch.Tensor], train_head: bool) -> dict[str, torch.Tensor]:
    hidden = inputs["hidden"].detach().requires_grad_(True)
    weight = inputs["weight"].detach().requires_grad_(train_head)
    loss_sum, weight_sum, hits = fn(hidden, weight, inputs["labels"], inputs["weights"])
    loss_sum.backward()
    out = {"loss_sum": loss_sum.detach(), "hits": hits, "grad_hidden": hidden.grad}
    if train_head:
        out["grad_weight"] = weight.grad
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(fn: LossFn, inputs: dict[str, torch.Tensor], device: torch.device, train_head: bool) -> float:
    sync(device)
    start = time.perf_counter()
    step(fn, inputs, train_head)
    sync(device)
    return time.perf_counter() - start


def peak_bytes(fn: LossFn, inputs: dict[str, torch.Tensor], device: torch.device, train_head: bool) -> int:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step(fn, inputs, train_head)
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with LiveBytes() as tracker:
        step(fn, inputs, train_head)
    return tracker.peak


def measure_all(
    methods: dict[str, LossFn], inputs: dict[str, torch.Tensor], device: torch.device, args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, torch.Tensor]]]:
    """Warm up each method, then time them round-robin (fair under a shared, noisy machine)."""
    results = {name: step(fn, inputs, args.train_head) for name, fn in methods.items()}  # also compiles Triton
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            times[name].append(timed_step(fn, inputs, device, args.train_head))
    stats = {
        name: {
            "time_s": min(times[name]),
            "median_s": statistics.median(times[name]),
            "times_s": times[name],
            "peak_bytes": peak_bytes(fn, inputs, device, args.train_head),
        }
        for name, fn in methods.items()
    }
    return stats, results


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16 * 15 * 8, help="scored positions (default 1920)")
    parser.add_argument("--hidden", type=int, default=576, help="H (SmolLM2-135M: 576)")
    parser.add_argument("--vocab", type=int, default=49152, help="V (SmolLM2: 49152)")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--chunk-size", type=int, default=4096, help="vocabulary chunk of the fused versions")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (after one warm-up)")
    parser.add_argument("--methods", default=None, help="comma list of plain,chunked,triton (default: all that run here)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--train-head", action="store_true", help="LM head requires grad (grad_weight too)")
    parser.add_argument("--out", default=None, help="also write the JSON result to this path")
    args = parser.parse_args(argv)
    if args.threads is not None:
        # On a shared machine a single thread gives steadier CPU numbers: with
        # more, every small op waits for descheduled OpenMP workers.
        torch.set_num_threads(args.threads)

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    methods: dict[str, LossFn] = {
        "plain": lm_head_loss,
        "chunked": lambda *a: chunked_lm_head_loss(*a, chunk_size=args.chunk_size),
        "triton": lambda *a: triton_lm_head_loss(*a, chunk_size=args.chunk_size),
    }
    default_names = ["plain", "chunked"] + (["triton"] if device.type == "cuda" else [])
    names = args.methods.split(",") if args.methods else default_names
    unknown = [m for m in names if m not in methods]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {sorted(methods)}")

    inputs = make_inputs(args, device, dtype)
    print(
        f"LM-head loss fwd+bwd: N={args.n} H={args.hidden} V={args.vocab} {dtype_name} on {device}, "
        f"chunk={args.chunk_size}, head {'trained' if args.train_head else 'frozen'}, "
        f"[N,V] fp32 = {args.n * args.vocab * 4 / 2**20:.0f} MiB, torch threads={torch.get_num_threads()}"
    )
    report: dict[str, Any] = {
        "n": args.n, "hidden": args.hidden, "vocab": args.vocab, "dtype": dtype_name, "device": str(device),
        "chunk_size": args.chunk_size, "train_head": args.train_head, "methods": {},
    }  # fmt: skip
    report["methods"], results = measure_all({name: methods[name] for name in names}, inputs, device, args)
    ref = results.get("plain")
    for name in names:
        stats = report["methods"][name]
        line = f"{name:>8}: {stats['time_s'] * 1e3:9.1f} ms (median {stats['median_s'] * 1e3:9.1f})   peak {stats['peak_bytes'] / 2**20:8.1f} MiB"
        if ref is not None and name != "plain":
            base = report["methods"]["plain"]
            stats["time_ratio_vs_plain"] = stats["time_s"] / base["time_s"]
            stats["mem_ratio_vs_plain"] = stats["peak_bytes"] / max(base["peak_bytes"], 1)
            stats["rel_err_loss"] = rel_err(results[name]["loss_sum"], ref["loss_sum"])
            stats["rel_err_grad_hidden"] = rel_err(results[name]["grad_hidden"], ref["grad_hidden"])
            if args.train_head:
                stats["rel_err_grad_weight"] = rel_err(results[name]["grad_weight"], ref["grad_weight"])
            stats["hits_agree"] = float((results[name]["hits"] == ref["hits"]).float().mean())
            line += (
                f"   time x{stats['time_ratio_vs_plain']:.2f}  mem x{stats['mem_ratio_vs_plain']:.3f}"
                f"   rel err loss {stats['rel_err_loss']:.1e} grad {stats['rel_err_grad_hidden']:.1e}"
                f"   hits agree {stats['hits_agree']:.4f}"
            )
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
