"""What do the drafter's metrics cost? The same training, metrics on vs off, side by side.

Runs short training bursts alternately with metrics at the default interval
(device accumulators, snapshot every ``log_every_steps``, deferred read,
summary, a non-blocking push to a sidecar address) and with metrics off, on
the same model and batches, and prints the throughput ratio (goal >= 0.99)
and the host syncs per step counted by the sync guard (goal 0).

Each round times one burst of each, in alternating order (off/on, then
on/off), and the ratio is the median over rounds of the two bursts' ratio:
drift of the machine's speed cancels within a round, and one disturbed round
cannot move the median.

    python bench/metrics_overhead.py [--steps 40] [--rounds 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import DrafterConfig, MetricsConfig  # noqa: E402
from drafter_worker.model.dflash_model import DFlashDrafter, make_drafter_config  # noqa: E402
from common.metrics_client import MetricsPusher  # noqa: E402
from common.packing import BatchLayout  # noqa: E402
from common.sync_guard import sync_guard  # noqa: E402
from drafter_worker.trainer import DrafterTrainer, make_optimizer, summarize  # noqa: E402


def build(device: torch.device, collect: bool, hidden: int, vocab: int, layers_captured: int):
    config = make_drafter_config(
        hidden_size=hidden, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
        intermediate_size=2 * hidden, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=2048, num_hidden_layers=1, num_target_layers=30,
        target_layer_ids=list(range(1, 1 + layers_captured)), block_size=16, mask_token_id=0,
    )
    torch.manual_seed(0)
    model = DFlashDrafter(config).to(device)
    cfg = DrafterConfig(max_steps=10_000)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    return DrafterTrainer(cfg, model, make_optimizer(cfg, model), gen, 0, collect_metrics=collect)


def burst(trainer, batch, weights, steps: int, log_every: int, pusher: MetricsPusher | None, guard_device=None):
    pending = False
    syncs = 0
    start = time.perf_counter()
    for _ in range(steps):
        if guard_device is not None:
            with sync_guard(guard_device, mode="record") as report:
                pending = _step(trainer, batch, weights, log_every, pusher, pending)
            syncs += len(report.violations)
        else:
            pending = _step(trainer, batch, weights, log_every, pusher, pending)
    if batch[0].device.type == "cuda":
        torch.cuda.synchronize()  # end of the measurement, not in the loop
    return time.perf_counter() - start, syncs


def _step(trainer, batch, weights, log_every, pusher, pending):
    trainer.train_step(*batch, *weights)
    if trainer.collect_metrics:
        if trainer.step % log_every == 0 and trainer.metrics.snapshot():
            pending = True
        if pending:
            values = trainer.metrics.poll()
            if values is not None:
                pending = False
                pusher.send(summarize(values), step=trainer.step)
    return pending


def metrics_path_ms(trainer, device: torch.device, log_every: int, pusher: MetricsPusher, steps: int = 500) -> float:
    """Milliseconds per step of what metrics add to a step, alone: the accumulator adds
    (``DrafterTrainer.record_step``), a snapshot every ``log_every`` steps, the deferred
    poll, ``summarize`` and the push; on values shaped like a real step's."""
    block = trainer.model.block_size
    loss = torch.tensor(2.5, device=device)
    correct = torch.ones(block, device=device)
    count = torch.full((block,), 4.0, device=device)
    tokens = torch.tensor(1024.0, device=device)
    norm = torch.tensor(0.7, device=device)
    pending = False
    start = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.record_step(loss, correct, count, tokens, norm)
        if step % log_every == 0 and trainer.metrics.snapshot():
            pending = True
        if pending:
            values = trainer.metrics.poll()
            if values is not None:
                pending = False
                pusher.send(summarize(values), step=step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps per burst")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of one burst each, median of their ratios")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    log_every = MetricsConfig().log_every_steps
    layout = BatchLayout(8, 128, 5 * args.hidden, torch.float32)
    buf = layout.allocate(device)
    feats, ids, mask, lengths = layout.views(buf)
    g = torch.Generator(device="cpu").manual_seed(1)
    feats.copy_(torch.randn(feats.shape, generator=g))
    ids.copy_(torch.randint(0, args.vocab, ids.shape, generator=g))
    mask.fill_(1)
    lengths.fill_(128)
    batch = (feats, ids, mask, lengths)
    weights = (torch.randn(args.vocab, args.hidden, device=device) * 0.02,) * 2
    # Nobody listens on this port: sends must still never block (they are dropped and counted).
    pusher = MetricsPusher("tcp://127.0.0.1:1", "drafter/bench")
    on, off = build(device, True, args.hidden, args.vocab, 5), build(device, False, args.hidden, args.vocab, 5)
    burst(on, batch, weights, 3, log_every, pusher)  # warm-up both
    burst(off, batch, weights, 3, log_every, pusher)
    t_on = t_off = 0.0
    ratios = []
    for round_index in range(args.rounds):
        pair = {}
        for trainer in ((off, on) if round_index % 2 == 0 else (on, off)):
            pair[trainer is on] = burst(trainer, batch, weights, args.steps, log_every, pusher)[0]
        t_on, t_off = t_on + pair[True], t_off + pair[False]
        ratios.append(pair[False] / pair[True])
    _, syncs = burst(on, batch, weights, 2 * log_every + 1, log_every, pusher, guard_device=device)
    metrics_ms = metrics_path_ms(on, device, log_every, pusher)
    pusher.close()
    steps = args.steps * args.rounds
    step_ms_on, step_ms_off = 1000 * t_on / steps, 1000 * t_off / steps
    result = {
        "device": str(device),
        "steps_per_run": steps,
        "throughput_ratio_metrics_on_vs_off": statistics.median(ratios),
        "round_ratios": ratios,
        "host_syncs_per_step": syncs / (2 * log_every + 1),
        "step_ms_metrics_on": step_ms_on,
        "step_ms_metrics_off": step_ms_off,
        # The metrics' own work per step, timed alone (no training around it): far below the
        # burst-to-burst noise of the ratio above, it bounds what metrics can cost.
        "metrics_path_ms_per_step": metrics_ms,
        "isolated_ratio": step_ms_off / (step_ms_off + metrics_ms),
    }
    print(f"metrics on / off throughput ratio: {result['throughput_ratio_metrics_on_vs_off']:.3f} (goal >= 0.99)")
    print(f"host syncs per step in the hot path: {result['host_syncs_per_step']:.0f} (goal 0)")
    print(f"step time: {result['step_ms_metrics_on']:.1f} ms with metrics, {result['step_ms_metrics_off']:.1f} ms without")
    print(f"the metrics path alone: {metrics_ms:.3f} ms per step (step / (step + that) = {result['isolated_ratio']:.4f})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
