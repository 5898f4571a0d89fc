"""Pipeline efficiency (bench row 1) and drafter scaling (row 5), on CPU.

    .venv/bin/python bench/pipeline_bench.py [--drafters 1,2,4] [--windows 4] [--out FILE]

A random Llama target (``tests/fixtures.py``: 16 layers x 256 hidden by
default, SmolLM2's 49152-token vocabulary) is written to a temporary
directory. Every process runs one torch thread (``target.threads = 1``,
``drafter.threads = 1``); data plane gloo; buckets [192, 256] at 768 tokens
per batch (B*T = 768 in both); drafter block 16, 4 anchors per sequence;
float32, or with ``--dtype bfloat16`` a bf16 target and the drafter's step
under bf16 autocast, as the quality recipe runs where the CPU has bf16. These
sizes put target and drafter within 2x of each other, where a pipeline that
serialized them instead of overlapping them would show (about 0.5-0.6).

- target-alone: ``LayerCapture.run`` on the plan's first batches (their
  shapes and the real samples' ids), in this process;
- drafter-alone: ``DrafterTrainer.train_step`` on the same batches (features
  from one untimed capture), in this process;
- end-to-end: a real job: metrics sidecar (W&B disabled), target server and
  drafter workers as separate processes on loopback, started by
  ``deploy/launcher.py`` as the tests and the demo start them. The rate comes from the drafters'
  per-step records in ``metrics.jsonl`` (step and time) inside measurement
  windows that open once every drafter is past ``--warm-steps``.

The 1-drafter job is measured in ``--windows`` windows; between two of them
its processes are paused (SIGSTOP) while one alone round runs (target, then
drafter), so both sides see the same machine over time; one more alone round
runs before and after. Medians are reported. Each alone round ends with both
sides running at the same time for ``--concurrent-s`` (the drafter in a
helper process, no data between them): two busy processes, as in the job, so
``pipeline_efficiency_vs_concurrent_alone`` separates what the pipeline
costs from what a shared machine gives two processes instead of one. The 2- and 4-drafter jobs get one
window each (row 5).

Tokens are batch-shape tokens (B*T, padding included) everywhere, so all rates
count the same work; the drafters' own ``tokens_per_s`` (real tokens only) is
reported next to it. Periodic checkpoints are kept out of the windows
(``checkpoint_every_steps`` is large): a configured cost, not a pipeline one.
``cpu_cores_used`` says how many cores each process really got while measured
(on a shared machine a busy single-threaded process gets less than 1). The
last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchlib import drafter_trainer, free_ports, median, offline_env, write_json

from common.config import Config, load_config  # noqa: E402
from common.layer_ids import build_target_layer_ids  # noqa: E402
from deploy.launcher import Job  # noqa: E402


def write_config(tmp: Path, model_dir: Path, drafter_ids: list[str], args: argparse.Namespace, name: str) -> Path:
    control, store, metrics = free_ports(3)
    lines = [
        "[run]", f'name = "{name}"', f'root_dir = "{tmp / "runs"}"',
        "[control]", f'address = "tcp://127.0.0.1:{control}"', f"store_port = {store}",
        # Generous: 4 drafters on 2 cores are slow to answer, and nobody dies here.
        "heartbeat_interval_s = 1.0", "heartbeat_timeout_s = 60.0", "handshake_timeout_s = 120.0",
        "[metrics]", f'address = "tcp://127.0.0.1:{metrics}"', "log_every_steps = 1", "window_s = 1.0",
        'wandb_mode = "disabled"',
        "[target]", f'model = "{model_dir}"', "num_captured_layers = 5", "threads = 1", "ready_batches = 3",
        f'dtype = "{args.dtype}"',
        "stop_timeout_s = 130.0",  # a stop outlasts transport.timeout_s (common/config.py requires it)
        "[data]", 'source = "pydoc"', "max_seq_len = 256", "bucket_lengths = [192, 256]",
        f"tokens_per_batch = {args.tokens_per_batch}", f"max_samples = {args.max_samples}", "heldout_fraction = 0.0",
        "[transport]", 'kind = "gloo"', "timeout_s = 120.0",
        "[drafter]", "block_size = 16", f"anchors_per_sequence = {args.anchors}", "threads = 1",
        "checkpoint_every_steps = 1000000", "warmup_steps = 5", "max_steps = 0", "credits = 2",
        # The quality recipe pairs a bf16 target with bf16 matmuls in the drafter's step.
        f'autocast = "{"bfloat16" if args.dtype == "bfloat16" else ""}"',
        "stop_timeout_s = 130.0",
    ]
    for k, drafter_id in enumerate(drafter_ids):
        lines += [f"[drafters.{drafter_id}]", f"seed = {k}"]
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# Alone: target capture and drafter step in this process


class Alone:
    """The target and a drafter built like the server and the worker build them, on the plan's batches."""

    def __init__(self, cfg: Config, num_batches: int):
        from target_server.bucketing import BatchPlan, BucketSpec, pack_batch
        from target_server.capture import LayerCapture
        from target_server.data import build_dataset
        from common.model_loader import embedding_weights, load_target
        from common.packing import dtype_from_name

        loaded = load_target(cfg.target.model, dtype=dtype_from_name(cfg.target.dtype))
        layer_ids = build_target_layer_ids(loaded.num_layers, cfg.target.num_captured_layers)
        self.capture = LayerCapture(loaded.model, layer_ids)
        feature_dim = len(layer_ids) * loaded.hidden_size
        dataset = build_dataset(
            loaded.tokenizer, cfg.data.source, max_seq_len=cfg.data.max_seq_len, seed=cfg.data.seed,
            heldout_fraction=cfg.data.heldout_fraction, max_samples=cfg.data.max_samples,
            data_format=cfg.data.format, chat_template_kwargs=cfg.data.chat_template_kwargs,
            num_proc=cfg.data.num_proc, cache_dir=cfg.data.cache_dir,
        )
        spec = BucketSpec(tuple(cfg.data.bucket_lengths), cfg.data.tokens_per_batch)
        plan = BatchPlan(dataset.train_lengths(), spec, cfg.data.seed)
        self.plan_tokens_per_batch = [
            spec.shape(plan.batch(i).bucket)[0] * spec.shape(plan.batch(i).bucket)[1]
            for i in range(plan.batches_per_epoch)
        ]
        self.batches = []  # (input_ids long, features, ids int32, loss mask, lengths)
        for index in range(min(num_batches, plan.batches_per_epoch)):
            planned = plan.batch(index)
            b, t = spec.shape(planned.bucket)
            ids, mask, lengths = pack_batch([dataset.train[i] for i in planned.sample_ids], b, t, loaded.pad_token_id)
            features = torch.empty(b, t, feature_dim, dtype=loaded.model.dtype)
            self.capture.run(ids, features)  # real features for the drafter; also warms every shape up
            self.batches.append((ids, features, ids.to(torch.int32), mask, lengths))
        self.features_out = [torch.empty_like(batch[1]) for batch in self.batches]

        self.trainer = drafter_trainer(
            loaded.config, num_target_layers=loaded.num_layers, vocab_size=loaded.vocab_size, layer_ids=layer_ids,
            drafter_cfg=cfg.drafter,
        )
        model = self.trainer.model
        embed, head, _ = embedding_weights(loaded.model)
        self.embed, self.head = embed.float(), head.float()  # as the worker holds them
        for batch in self.batches:  # warm-up of every shape
            self._train(batch)
        self.info = {
            "target_layers": loaded.num_layers, "hidden": loaded.hidden_size, "vocab": loaded.vocab_size,
            "captured_layers": layer_ids, "plan_batches_per_epoch": plan.batches_per_epoch,
            "plan_bucket_counts": list(plan.bucket_counts), "shapes": [list(s) for s in spec.shapes()],
            "drafter_params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        }

    def _train(self, batch) -> None:
        _, features, ids32, mask, lengths = batch
        self.trainer.train_step(features.float(), ids32, mask, lengths, self.embed, self.head)

    def target_round(self) -> float:
        """Batch-shape tokens/s of the capture over the batches."""
        tokens = 0
        start = time.perf_counter()
        for (ids, *_), out in zip(self.batches, self.features_out):
            self.capture.run(ids, out)
            tokens += ids.numel()
        return tokens / (time.perf_counter() - start)

    def drafter_round(self) -> float:
        tokens = 0
        start = time.perf_counter()
        for batch in self.batches:
            self._train(batch)
            tokens += batch[0].numel()
        return tokens / (time.perf_counter() - start)

    def for_seconds(self, side: str, seconds: float) -> float:
        """Tokens/s of ``side`` ("target" or "drafter") run over the batches again and again for ``seconds``."""
        tokens, k = 0, 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            k += 1
            if side == "target":
                i = k % len(self.batches)
                self.capture.run(self.batches[i][0], self.features_out[i])
            else:
                self._train(self.batches[k % len(self.batches)])
            tokens += self.batches[k % len(self.batches)][0].numel()
        return tokens / (time.perf_counter() - start)


def concurrent_drafter(conn, config: str, num_batches: int) -> None:
    """Child process: a drafter-alone that runs while the parent runs target-alone (no data between them)."""
    torch.set_num_threads(1)
    alone = Alone(load_config(config), num_batches)
    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            return
        conn.send(alone.for_seconds("drafter", command))


# ---------------------------------------------------------------------------
# End-to-end: a real job


def _drafter_records(records: list[dict], drafter_id: str) -> list[dict]:
    return [r for r in records if r["source"] == f"drafter/{drafter_id}" and "tokens_per_s" in r["values"]]


def window_rate(records: list[dict], start: float, end: float) -> dict[str, float] | None:
    """Steps/s of one drafter from its records whose time lies in [start, end] (None under 2 records)."""
    inside = [r for r in records if start <= r["time"] <= end]
    if len(inside) < 2 or inside[-1]["time"] <= inside[0]["time"]:
        return None
    first, last = inside[0], inside[-1]
    return {
        "steps": last["step"] - first["step"],
        "seconds": last["time"] - first["time"],
        "steps_per_s": (last["step"] - first["step"]) / (last["time"] - first["time"]),
        "reported_tokens_per_s": median(r["values"]["tokens_per_s"] for r in inside[1:]),
        "data_wait_frac": median(r["values"].get("data_wait_frac", float("nan")) for r in inside[1:]),
        "compute_ms": median(r["values"].get("compute_ms", float("nan")) for r in inside[1:]),
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), nan where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def run_job(
    tmp: Path, model_dir: Path, num_drafters: int, args: argparse.Namespace, tokens_per_batch: float,
    windows: int, window_s: float, between: Callable[[], None] | None = None,
) -> dict:
    """Start a job, let it warm up, measure ``windows`` windows of ``window_s``.

    Between two windows the job's processes are paused (SIGSTOP) while
    ``between`` runs (the alone rounds), then resumed and given a moment to
    settle, so the alone and end-to-end measurements alternate in time.
    """
    drafter_ids = [f"d{k}" for k in range(num_drafters)]
    name = f"job{num_drafters}"
    config = write_config(tmp, model_dir, drafter_ids, args, name)
    run_dir = tmp / "runs" / name
    started = time.monotonic()
    spans: list[tuple[float, float]] = []
    cpu: dict[str, float] = {}
    with Job(config, run_dir, env=offline_env(threads=1)) as job:
        job.start_metrics()
        job.start_target()
        for drafter_id in drafter_ids:
            job.start_drafter(drafter_id)

        def warm() -> bool:
            records = job.metrics()
            return all(any(r["step"] >= args.warm_steps for r in _drafter_records(records, d)) for d in drafter_ids)

        job.wait_for(warm, args.startup_timeout_s, f"{num_drafters} drafter(s) past step {args.warm_steps}",
                     running=job.procs, interval_s=0.5)
        startup_s = time.monotonic() - started
        for k in range(windows):
            if k and between is not None:
                job.signal_all(signal.SIGSTOP)
                try:
                    between()
                finally:
                    job.signal_all(signal.SIGCONT)
                time.sleep(args.settle_s)
            cpu_start = {n: _cpu_seconds(p.pid) for n, p in job.procs.items()}
            start = time.time()
            end = time.monotonic() + window_s
            while time.monotonic() < end:
                job.check("measuring", running=job.procs)
                time.sleep(0.25)
            spans.append((start, time.time()))
            for n, p in job.procs.items():
                cpu[n] = cpu.get(n, 0.0) + _cpu_seconds(p.pid) - cpu_start[n]
        codes = job.stop(drafter_ids, timeout_s=90.0)
        codes.update(job.stop(["target"], timeout_s=60.0))
        codes.update(job.stop(["metrics"], timeout_s=30.0))
        records = job.metrics()
    measured_s = sum(b - a for a, b in spans)
    drafters = {}
    for drafter_id in drafter_ids:
        recs = _drafter_records(records, drafter_id)
        rates = [window_rate(recs, a, b) for a, b in spans]
        rates = [r for r in rates if r is not None]
        if not rates:
            raise RuntimeError(f"drafter {drafter_id}: fewer than 2 metric records in every window")
        steps_per_s = median(r["steps_per_s"] for r in rates)
        drafters[drafter_id] = {
            "tokens_per_s": steps_per_s * tokens_per_batch,
            "steps_per_s": steps_per_s,
            "window_tokens_per_s": [r["steps_per_s"] * tokens_per_batch for r in rates],
            "steps": sum(r["steps"] for r in rates),
            "reported_tokens_per_s": median(r["reported_tokens_per_s"] for r in rates),
            "data_wait_frac": median(r["data_wait_frac"] for r in rates),
            "compute_ms": median(r["compute_ms"] for r in rates),
        }
    target = [
        r["values"] for r in records
        if r["source"] == "target" and any(a <= r["time"] <= b for a, b in spans) and r["values"].get("batches_per_s")
    ]
    return {
        "drafters": drafters,
        "total_tokens_per_s": sum(d["tokens_per_s"] for d in drafters.values()),
        "per_drafter_tokens_per_s": median(d["tokens_per_s"] for d in drafters.values()),
        "target_backpressure_frac": median(v.get("backpressure_frac", float("nan")) for v in target),
        "target_forward_ms": median(v["forward_ms"] for v in target),
        # Cores each process actually got while measured: below 1 for a busy
        # single-threaded process means the machine was shared.
        "cpu_cores_used": {n: c / measured_s for n, c in cpu.items()},
        "startup_s": startup_s,
        "measured_s": measured_s,
        "exit_codes": codes,
    }


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default="1,2,4", help="comma list of drafter counts; 1 is row 1's job")
    parser.add_argument("--windows", type=int, default=4, help="end-to-end windows of the 1-drafter job, alone rounds between")
    parser.add_argument("--window-s", type=float, default=10.0, help="length of one end-to-end window")
    parser.add_argument("--scaling-window-s", type=float, default=20.0, help="window of the 2- and 4-drafter jobs")
    parser.add_argument("--settle-s", type=float, default=1.5, help="after resuming a paused job, before measuring")
    parser.add_argument("--warm-steps", type=int, default=8, help="drafter steps before the first window opens")
    parser.add_argument("--startup-timeout-s", type=float, default=240.0)
    parser.add_argument("--alone-batches", type=int, default=4, help="plan batches per alone round")
    parser.add_argument("--concurrent-s", type=float, default=3.0,
                        help="seconds of each round with target-alone and drafter-alone running at the same time")
    parser.add_argument("--target-layers", type=int, default=16)
    parser.add_argument("--target-hidden", type=int, default=256)
    parser.add_argument("--anchors", type=int, default=4, help="drafter.anchors_per_sequence")
    parser.add_argument("--tokens-per-batch", type=int, default=768, help="B*T of both buckets (192 and 256)")
    parser.add_argument("--max-samples", type=int, default=200)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="target.dtype; bfloat16 also runs the drafter's step under bf16 autocast, as the recipe "
                             "does on a CPU with AVX512-BF16 or AMX")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    counts = sorted({int(n) for n in args.drafters.split(",") if n.strip() and int(n) > 0})
    torch.set_num_threads(1)  # as every process of the job

    from tests.fixtures import make_tiny_target

    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = make_tiny_target(tmp / "target", num_layers=args.target_layers, hidden=args.target_hidden)
        cfg = load_config(write_config(tmp, model_dir, ["d0"], args, "alone"))
        alone = Alone(cfg, args.alone_batches)
        tokens_per_batch = sum(alone.plan_tokens_per_batch) / len(alone.plan_tokens_per_batch)
        target_tps: list[float] = []
        drafter_tps: list[float] = []
        alone_cpu: list[float] = []
        both: dict[str, list[float]] = {"target": [], "drafter": []}
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        helper = ctx.Process(target=concurrent_drafter, args=(child_conn, str(tmp / "alone.toml"), args.alone_batches),
                             daemon=True)
        helper.start()
        if not conn.poll(args.startup_timeout_s):
            raise RuntimeError("the concurrent drafter-alone process did not start")
        conn.recv()

        def alone_round() -> None:
            wall, cpu = time.perf_counter(), time.thread_time()
            target_tps.append(alone.target_round())
            drafter_tps.append(alone.drafter_round())
            alone_cpu.append((time.thread_time() - cpu) / (time.perf_counter() - wall))
            # Both sides at once, in two processes with no data between them: the job's CPU
            # situation (two busy single-threaded processes) without the pipeline.
            conn.send(args.concurrent_s)
            both["target"].append(alone.for_seconds("target", args.concurrent_s))
            if not conn.poll(60.0):
                raise RuntimeError("the concurrent drafter-alone process did not answer")
            both["drafter"].append(conn.recv())

        alone_round()
        jobs = {}
        for n in counts:
            if n == 1:
                jobs["1"] = run_job(tmp, model_dir, 1, args, tokens_per_batch, args.windows, args.window_s, alone_round)
            else:
                jobs[str(n)] = run_job(tmp, model_dir, n, args, tokens_per_batch, 1, args.scaling_window_s)
            print(f"{n} drafter(s): total {jobs[str(n)]['total_tokens_per_s']:.0f} tok/s, "
                  f"per drafter {jobs[str(n)]['per_drafter_tokens_per_s']:.0f}", flush=True)
        alone_round()
        conn.send(None)
        helper.join(30.0)
        if helper.is_alive():
            helper.kill()
        print(f"alone: target {median(target_tps):.0f} tok/s, drafter {median(drafter_tps):.0f} tok/s; at the same "
              f"time: target {median(both['target']):.0f}, drafter {median(both['drafter']):.0f}", flush=True)

    target_alone, drafter_alone = median(target_tps), median(drafter_tps)
    result: dict[str, Any] = {
        "setup": {**alone.info, "tokens_per_batch": tokens_per_batch, "anchors_per_sequence": args.anchors,
                  "block_size": cfg.drafter.block_size, "dtype": args.dtype, "threads_per_process": 1,
                  "windows": args.windows,
                  "window_s": args.window_s, "scaling_window_s": args.scaling_window_s},
        "target_alone_tokens_per_s": target_alone,
        "drafter_alone_tokens_per_s": drafter_alone,
        "target_alone_rounds": target_tps,
        "drafter_alone_rounds": drafter_tps,
        "alone_cpu_cores_used": median(alone_cpu),
        "concurrent_target_alone_tokens_per_s": median(both["target"]),
        "concurrent_drafter_alone_tokens_per_s": median(both["drafter"]),
        "concurrent_rounds": both,
        "jobs": jobs,
    }
    if "1" in jobs:
        job = jobs["1"]
        slower = min(target_alone, drafter_alone)
        bottleneck = "target" if target_alone < drafter_alone else "d0"
        result["end_to_end_tokens_per_s"] = job["total_tokens_per_s"]
        result["bottleneck"] = "target" if bottleneck == "target" else "drafter"
        result["pipeline_efficiency"] = job["total_tokens_per_s"] / slower
        # Explanation, not the goal: the same ratio with the slower side's alone rate
        # scaled by the CPU share its process got in the job relative to alone.
        share = job["cpu_cores_used"].get(bottleneck, float("nan")) / max(median(alone_cpu), 1e-9)
        result["bottleneck_cpu_share_vs_alone"] = share
        result["pipeline_efficiency_cpu_adjusted"] = job["total_tokens_per_s"] / (slower * min(1.0, share))
        # The same ratio against both alone sides run at the same time (two processes, as in the job).
        result["pipeline_efficiency_vs_concurrent_alone"] = job["total_tokens_per_s"] / min(
            median(both["target"]), median(both["drafter"]))
    write_json(args.out, result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
