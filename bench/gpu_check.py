"""The torch parts of ``bench/gpu_check.sh``: sync guard, stream overlap and throughput on one device.

    python bench/gpu_check.py --device cuda [--sections sync,overlap,throughput] [--out DIR]
    python bench/gpu_check.py --device cpu      # the same code on tiny sizes (validates the script)

Sections:

- ``sync``: a few target capture steps, then a few drafter train steps with a
  metrics snapshot and its deferred poll, each inside
  ``common.sync_guard.sync_guard(device)`` (on CUDA: ``torch.cuda.set_sync_debug_mode("error")``;
  on CPU: the guard's emulation). One untimed step of each runs first, outside
  the guard (allocator warm-up, Triton compilation). The guard records; a host
  read fails the check unless it is a known third-party one (transformers'
  packed-sequence check, as in tests/target_server/test_capture_no_sync.py),
  which is reported next to the result.
- ``overlap``: the streams the pipeline uses (``common.streams.SideStream``)
  against one stream. Target: capture batch n on a capture stream while batch
  n-1 is copied out to pinned host memory on a send stream (the copy stands in
  for the NCCL send, which one GPU cannot pair with itself), ordered by events
  only. Drafter: copy batch n+1 in on a receive stream while training on batch
  n. Each reports one-stream time / side-stream time per batch (above 1.0: the
  transfer hides behind compute) and the host reads the overlapped loop made
  (under the sync guard; 0 expected besides the known third-party one).
- ``throughput``: capture tokens/s and train-step tokens/s (bf16 on CUDA) for
  each target of ``--targets``: ``smollm2`` (the real SmolLM2-135M, when its
  package is installed) and ``llama8b`` (a random model with Llama-3.1-8B's
  shapes, hidden 4096, vocab 128256, and ``--llama-layers`` layers, built on
  the device). The drafter is timed twice: with float32 weights as the worker
  runs it (bf16 features upcast) and with bfloat16 weights.

Writes ``gpu_check.json`` under ``--out`` (default ``$OUT`` or ``runs/gpu_check``)
and prints a summary; exit status 1 when a sync check failed or a section broke.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchlib import drafter_trainer, write_json

from common.config import DrafterConfig, load_config  # noqa: E402
from common.layer_ids import build_target_layer_ids  # noqa: E402
from common.streams import SideStream, record_current  # noqa: E402
from common.sync_guard import sync_guard  # noqa: E402
from target_server.capture import LayerCapture  # noqa: E402


@dataclass
class Target:
    name: str
    model: Any
    config: Any
    num_layers: int
    hidden: int
    vocab: int


def smollm2(device: torch.device, dtype: torch.dtype) -> Target:
    from common.model_loader import load_target

    loaded = load_target("smollm2", device=str(device), dtype=dtype)
    return Target("smollm2", loaded.model, loaded.config, loaded.num_layers, loaded.hidden_size, loaded.vocab_size)


def random_llama(device: torch.device, dtype: torch.dtype, *, name: str, layers: int, hidden: int, intermediate: int,
                 heads: int, kv_heads: int, vocab: int) -> Target:
    """A random Llama built directly on ``device`` in ``dtype`` (no host copy, fast even at 8B shapes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    return Target(name, model, config, layers, hidden, vocab)


def make_target(which: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> Target:
    if which == "smollm2":
        return smollm2(device, dtype)
    if which == "llama8b":
        return random_llama(device, dtype, name=f"llama8b-shaped ({args.llama_layers} layers)", layers=args.llama_layers,
                            hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
    if which == "tiny":
        return random_llama(device, dtype, name="tiny (8 layers x 64)", layers=8, hidden=64, intermediate=128, heads=4,
                            kv_heads=2, vocab=4096)
    raise ValueError(f"unknown target {which!r} (smollm2, llama8b, tiny)")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bench:
    """One target with its capture, a batch on the device, and drafters to train on its features."""

    def __init__(self, target: Target, device: torch.device, dtype: torch.dtype, batch: int, seq_len: int,
                 dcfg: DrafterConfig):
        self.target, self.device, self.dtype, self.dcfg = target, device, dtype, dcfg
        self.layer_ids = build_target_layer_ids(target.num_layers, 5 if target.num_layers >= 8 else 1)
        if dcfg.distill_weight > 0:  # the soft-target loss needs the last layer, as the recipes capture it
            self.layer_ids = sorted({*self.layer_ids[:-1], target.num_layers - 1})
        self.capture = LayerCapture(target.model, self.layer_ids)
        gen = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(0, target.vocab, (batch, seq_len), generator=gen).to(device)
        self.features = torch.empty(batch, seq_len, len(self.layer_ids) * target.hidden, device=device, dtype=dtype)
        self.ids32 = self.input_ids.to(torch.int32)
        self.loss_mask = torch.ones(batch, seq_len, dtype=torch.uint8, device=device)
        self.lengths = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        embed = target.model.get_input_embeddings().weight.detach()
        head = target.model.get_output_embeddings().weight.detach()
        self.weights = {torch.float32: (embed.float(), head.float()), dtype: (embed.to(dtype), head.to(dtype))}

    def drafter(self, weight_dtype: torch.dtype):
        return drafter_trainer(self.target.config, num_target_layers=self.target.num_layers, vocab_size=self.target.vocab,
                               layer_ids=self.layer_ids, drafter_cfg=self.dcfg, device=self.device, dtype=weight_dtype)

    def capture_step(self) -> None:
        self.capture.run(self.input_ids, self.features)

    def train_step(self, trainer) -> None:
        dtype = next(trainer.model.parameters()).dtype
        features = self.features.float() if dtype == torch.float32 else self.features  # as the worker does
        trainer.train_step(features, self.ids32, self.loss_mask, self.lengths, *self.weights[dtype])

    def timed(self, fn, steps: int) -> float:
        """Seconds per call, the device synchronized around the loop (not inside it)."""
        fn()
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        sync(self.device)
        return (time.perf_counter() - start) / steps


# ---------------------------------------------------------------------------
# Sections


def check_sync(bench: Bench, steps: int, log_every: int) -> dict[str, Any]:
    """Capture steps, then train steps with a snapshot and a deferred poll, under the sync guard."""
    results: dict[str, Any] = {}
    bench.capture_step()  # warm-up outside the guard
    sync(bench.device)
    results["capture"] = _guarded(bench.device, lambda: [bench.capture_step() for _ in range(steps)])

    trainer = bench.drafter(torch.float32)
    bench.train_step(trainer)  # warm-up (and Triton compilation) outside the guard
    sync(bench.device)
    polled: list[dict] = []

    def train() -> None:
        pending = False
        for _ in range(steps):
            bench.train_step(trainer)
            if trainer.step % log_every == 0 and trainer.metrics.snapshot():
                pending = True
            if pending:  # the deferred read: returns None until the copy has landed, never waits
                values = trainer.metrics.poll()
                if values is not None:
                    pending = False
                    polled.append(values)

    results["train_step"] = _guarded(bench.device, train)
    sync(bench.device)
    late = trainer.metrics.poll()  # outside the guard: the last snapshot has landed by now
    if late is not None:
        polled.append(late)
    results["train_step"]["snapshots_read"] = len(polled)
    results["train_step"]["loss_finite"] = bool(polled) and all(
        v["loss_sum"][0] == v["loss_sum"][0] and abs(v["loss_sum"][0]) != float("inf") for v in polled
    )
    if not polled:
        results["train_step"].update(ok=False, error="no metrics snapshot was read back")
    return results


# Host reads that are not project code, known and accepted (as in
# tests/target_server/test_capture_no_sync.py): transformers >= 5 checks every
# forward without an attention mask for packed sequences with `if (...).all():`.
# On CUDA the sync debug mode's warning names only the file and line.
KNOWN_THIRD_PARTY = (("masking_utils.py", "find_packed_sequence_indices"),)


def _known(violation) -> bool:
    path = violation.site.rsplit(":", 1)[0]
    return any(path.endswith(f"/{name}") and violation.function in (fn, "") for name, fn in KNOWN_THIRD_PARTY)


def _guarded(device: torch.device, fn) -> dict[str, Any]:
    """Run ``fn`` under the sync guard in record mode; ok when every host read is a known third-party one."""
    with sync_guard(device, mode="record") as report:
        fn()
    unexpected = [v for v in report.violations if not _known(v)]
    known = sorted({f"{v.site} ({v.function or v.method})" for v in report.violations if _known(v)})
    result: dict[str, Any] = {"ok": not unexpected, "host_reads": len(report.violations), "known_third_party": known}
    if unexpected:
        result["error"] = "\n".join(v.message for v in unexpected[:5])[:3000]
    return result


def overlap(bench: Bench, steps: int) -> dict[str, Any]:
    """One stream vs the pipeline's side streams, for the target (capture || send) and the drafter (receive || train)."""
    device, cuda = bench.device, bench.device.type == "cuda"
    feats = [bench.features, torch.empty_like(bench.features)]
    host = [torch.empty(bench.features.shape, dtype=bench.features.dtype, pin_memory=cuda) for _ in range(2)]
    host[0].normal_()
    host[1].normal_()

    def target_serial() -> None:
        for i in range(steps):
            bench.capture.run(bench.input_ids, feats[i % 2])
            host[i % 2].copy_(feats[i % 2], non_blocking=True)

    capture, send = SideStream(device), SideStream(device)

    def target_streams() -> None:
        capture.wait_default()
        send.wait_default()
        sent: list[Any] = [None, None]
        for i in range(steps):
            b = i % 2
            capture.wait(sent[b])  # the buffer's previous send has read it
            with capture.active():
                bench.capture.run(bench.input_ids, feats[b])
            send.wait(capture.record())
            with send.active():
                host[b].copy_(feats[b], non_blocking=True)
            sent[b] = send.record()
        if cuda:
            torch.cuda.current_stream(device).wait_stream(send.stream)

    trainer = bench.drafter(torch.float32)

    def train_on(b: int) -> None:
        trainer.train_step(feats[b].float(), bench.ids32, bench.loss_mask, bench.lengths, *bench.weights[torch.float32])

    def drafter_serial() -> None:
        for i in range(steps):
            feats[(i + 1) % 2].copy_(host[(i + 1) % 2], non_blocking=True)
            train_on(i % 2)

    recv = SideStream(device)

    def drafter_streams() -> None:
        recv.wait_default()
        freed: list[Any] = [None, None]
        for i in range(steps):
            nxt = (i + 1) % 2
            recv.wait(freed[nxt])  # the step that last read this buffer is done with it
            with recv.active():
                feats[nxt].copy_(host[nxt], non_blocking=True)
            arrived = recv.record()
            train_on(i % 2)
            freed[i % 2] = record_current(device)
            if cuda:
                torch.cuda.current_stream(device).wait_event(arrived)

    out: dict[str, Any] = {"bytes_per_batch": bench.features.numel() * bench.features.element_size()}
    for side, serial, streams in (("target", target_serial, target_streams), ("drafter", drafter_serial, drafter_streams)):
        one = bench.timed(serial, 1)
        two = bench.timed(streams, 1)
        with sync_guard(device, mode="record") as report:
            streams()
        sync(device)
        unexpected = [v for v in report.violations if not _known(v)]
        out[side] = {"one_stream_ms": one / steps * 1e3, "side_streams_ms": two / steps * 1e3,
                     "speedup": one / two, "host_reads": len(report.violations), "ok": not unexpected}
        if unexpected:
            out[side]["error"] = "\n".join(v.message for v in unexpected[:5])[:3000]
    out["ok"] = out["target"]["ok"] and out["drafter"]["ok"]
    return out


def throughput(bench: Bench, steps: int) -> dict[str, Any]:
    tokens = bench.input_ids.numel()
    out: dict[str, Any] = {"batch": list(bench.input_ids.shape), "captured_layers": bench.layer_ids,
                           "target_layers": bench.target.num_layers, "hidden": bench.target.hidden,
                           "vocab": bench.target.vocab}
    out["capture_tokens_per_s"] = tokens / bench.timed(bench.capture_step, steps)
    # (name, weight dtype, torch.set_float32_matmul_precision): float32 as the worker runs it by default
    # ("highest"), with TF32 as the GPU configs set it (drafter.matmul_precision = "high"), and bf16 weights.
    variants = [("float32", torch.float32, "highest")]
    if bench.device.type == "cuda":
        variants.append(("float32_tf32", torch.float32, "high"))
    if bench.dtype != torch.float32:
        variants.append((str(bench.dtype).replace("torch.", ""), bench.dtype, "highest"))
    previous = torch.get_float32_matmul_precision()
    for name, weight_dtype, precision in variants:
        torch.set_float32_matmul_precision(precision)
        trainer = bench.drafter(weight_dtype)
        if bench.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(bench.device)
        try:
            out[f"train_tokens_per_s_{name}_weights"] = tokens / bench.timed(lambda t=trainer: bench.train_step(t), steps)
        finally:
            torch.set_float32_matmul_precision(previous)
        if bench.device.type == "cuda":
            out[f"train_peak_gib_{name}_weights"] = torch.cuda.max_memory_allocated(bench.device) / 2**30
        out["drafter_params_m"] = sum(p.numel() for p in trainer.model.parameters()) / 1e6
        del trainer
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sections", default="sync,overlap,throughput")
    parser.add_argument("--targets", default=None, help="comma list of smollm2, llama8b, tiny (default: by device)")
    parser.add_argument("--llama-layers", type=int, default=8, help="layers of the llama8b-shaped target")
    parser.add_argument("--batch", type=int, default=None, help="sequences per batch (default 8 on CUDA, 2 on CPU)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 2048 on CUDA, 64 on CPU")
    parser.add_argument("--anchors", type=int, default=None, help="anchors per sequence (default 32 on CUDA, 4 on CPU)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10 on CUDA, 2 on CPU)")
    parser.add_argument("--drafter-config", default=None,
                        help="a config whose [drafter] section sets the drafter (layers, heads, draft vocabulary, "
                             "soft-target loss; e.g. configs/quality-gpu.toml); default: block 16, the rest defaults")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="a KEY=VALUE override of --drafter-config (e.g. drafter.num_key_value_heads=0)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if cuda else torch.float32
    batch = args.batch or (8 if cuda else 2)
    seq_len = args.seq_len or (2048 if cuda else 64)
    dcfg = (load_config(args.drafter_config, args.overrides).drafter if args.drafter_config
            else DrafterConfig(block_size=16, anchors_per_sequence=32 if cuda else 4))
    dcfg = dataclasses.replace(dcfg, anchors_per_sequence=args.anchors or dcfg.anchors_per_sequence, max_steps=0,
                               warmup_steps=2)
    steps = args.steps or (10 if cuda else 2)
    targets = (args.targets or ("smollm2,llama8b" if cuda else "tiny")).split(",")
    sections = args.sections.split(",")
    report: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name(device) if cuda else None, "sections": sections}
    failed = False
    for which in targets:
        entry: dict[str, Any] = {}
        report[which] = entry
        started = time.perf_counter()
        try:
            target = make_target(which, device, dtype, args)
        except Exception as exc:  # noqa: BLE001 - a missing model package skips that target, reported
            entry["skipped"] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"[gpu_check] {which}: skipped ({entry['skipped']})", flush=True)
            continue
        entry["name"], entry["load_s"] = target.name, time.perf_counter() - started
        bench = Bench(target, device, dtype, batch, seq_len, dcfg)
        for section in sections:
            print(f"[gpu_check] {which}: {section}", flush=True)
            try:
                if section == "sync":
                    entry["sync"] = check_sync(bench, steps=max(3, min(steps, 6)), log_every=2)
                    failed |= not all(r["ok"] for r in entry["sync"].values())
                elif section == "overlap":
                    entry["overlap"] = overlap(bench, steps)
                    failed |= not entry["overlap"]["ok"]
                elif section == "throughput":
                    entry["throughput"] = throughput(bench, steps)
                else:
                    raise ValueError(f"unknown section {section!r} (sync, overlap, throughput)")
            except Exception as exc:  # noqa: BLE001 - reported, the other sections still run
                entry[section] = {"ok": False, "error": traceback.format_exc()[-3000:]}
                print(f"[gpu_check] {which}: {section} broke: {exc}", file=sys.stderr, flush=True)
                failed = True
        del bench, target
        if cuda:
            torch.cuda.empty_cache()

    out = Path(args.out)
    write_json(out / "gpu_check.json", report)
    print(summary(report))
    print(f"[gpu_check] wrote {out / 'gpu_check.json'}")
    return 1 if failed else 0


def summary(report: dict[str, Any]) -> str:
    lines = [f"gpu_check on {report['gpu'] or report['device']} ({report['dtype']}, torch {report['torch']})"]
    for which, entry in report.items():
        if not isinstance(entry, dict):
            continue
        if "skipped" in entry:
            lines.append(f"  {which}: skipped: {entry['skipped'][:200]}")
            continue
        for name, check in (entry.get("sync") or {}).items():
            if isinstance(check, dict):
                state = "ok" if check.get("ok") else f"FAILED: {str(check.get('error', ''))[:300]}"
                if check.get("known_third_party"):
                    state += f" (known third-party host reads: {', '.join(check['known_third_party'])})"
                lines.append(f"  {entry['name']}: sync guard, {name}: {state}")
        o = entry.get("overlap")
        if o and "target" in o:
            for side in ("target", "drafter"):
                r = o[side]
                state = "ok" if r["ok"] else f"FAILED: {r.get('error', '')[:300]}"
                lines.append(f"  {entry['name']}: overlap, {side}: one stream {r['one_stream_ms']:.2f} ms/batch, "
                             f"side streams {r['side_streams_ms']:.2f} ms/batch (x{r['speedup']:.2f}); "
                             f"host reads {r['host_reads']}: {state}")
        elif o:
            lines.append(f"  {entry['name']}: overlap broke: {str(o.get('error', ''))[-300:]}")
        t = entry.get("throughput")
        if t and "capture_tokens_per_s" in t:
            trains = ", ".join(f"{k.removeprefix('train_tokens_per_s_')} {v:,.0f}" for k, v in t.items()
                               if k.startswith("train_tokens_per_s_"))
            lines.append(f"  {entry['name']}: batch {t['batch']}: capture {t['capture_tokens_per_s']:,.0f} tok/s; "
                         f"train step {trains} tok/s")
        elif t:
            lines.append(f"  {entry['name']}: throughput broke: {str(t.get('error', ''))[-300:]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
