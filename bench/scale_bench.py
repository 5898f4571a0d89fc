"""Scale-out rows: 1 vs 2 target replicas, and 1 vs 2 ranks of a gloo DDP drafter group.

    .venv/bin/python bench/scale_bench.py [--window-s 20] [--rounds 2] [--out FILE]

Two real jobs per row (sidecar, target processes, drafter processes on
loopback gloo, one torch thread each), measured one after the other and
alternated ``--rounds`` times (A B A B ...), so machine noise hits both:

- **replicas**: a target-bound job (a 16-layer x 256 random target, a small
  drafter): one drafter's batch throughput with ``target.replicas`` 1 and 2.
  The supply side doubles; what it gets depends on free cores.
- **ranks**: a drafter-bound job (a 5-layer x 64 target, a 4-layer drafter):
  the drafter's batch throughput trained by 1 rank and by 2 torchrun ranks
  (``--nproc-per-node 2``, DDP over gloo).

Throughput is batch-shape tokens (B*T) trained per second: drafter steps per
second x ranks x ``data.tokens_per_batch``, from the per-step metrics records
inside the window. ``cpu_cores_used`` per process says what bounds a ratio on
a 2-core machine (three or four busy processes share two cores). The last
stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchlib import free_ports, median, offline_env, write_json

from deploy.launcher import Job, _descendants  # noqa: E402
from tests.fixtures import make_tiny_target  # noqa: E402
from tests.ports import free_replica_step  # noqa: E402

TOKENS_PER_BATCH = 768


def write_config(tmp: Path, name: str, model: Path, *, replicas: int, drafter_layers: int, anchors: int) -> Path:
    control, store, metrics = free_ports(3)
    lines = [
        "[run]", f'name = "{name}"', f'root_dir = "{tmp / "runs"}"',
        "[control]", f'address = "tcp://127.0.0.1:{control}"', f"store_port = {store}",
        f"replica_port_step = {free_replica_step(control, store)}",
        # A job is paused (SIGSTOP, all its processes) while the other is measured: nobody may time out.
        "heartbeat_interval_s = 1.0", "heartbeat_timeout_s = 3600.0", "ack_timeout_s = 7200.0",
        "handshake_timeout_s = 120.0",
        "[metrics]", f'address = "tcp://127.0.0.1:{metrics}"', "log_every_steps = 1", "window_s = 1.0",
        'wandb_mode = "disabled"',
        "[target]", f'model = "{model}"', "num_captured_layers = 2", "threads = 1", "ready_batches = 3",
        f"replicas = {replicas}", "stop_timeout_s = 620.0",
        "[data]", 'source = "pydoc"', "max_seq_len = 256", "bucket_lengths = [192, 256]",
        f"tokens_per_batch = {TOKENS_PER_BATCH}", "max_samples = 400", "heldout_fraction = 0.0",
        "[transport]", 'kind = "gloo"', "timeout_s = 600.0",
        "[drafter]", "block_size = 16", f"anchors_per_sequence = {anchors}", "threads = 1",
        f"num_layers = {drafter_layers}", "checkpoint_every_steps = 1000000", "warmup_steps = 5", "max_steps = 0",
        "credits = 2", "stop_timeout_s = 620.0",
        "[drafters.d0]", "seed = 0",
    ]
    path = tmp / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class Running:
    """One job kept running; its drafter's step rate measured in windows."""

    def __init__(self, tmp: Path, name: str, config: Path, replicas: int, ranks: int):
        self.run_dir = tmp / "runs" / name
        self.ranks = ranks
        self.source = "drafter/d0" if ranks == 1 else "rank/d0.0"
        self.job = Job(config, self.run_dir, env=offline_env(1))
        self.job.start_metrics()
        for r in range(replicas):
            self.job.start(f"target-{r}", "target_server", "--replica", str(r), log_name=f"target-{r}")
        if ranks == 1:
            self.job.start_drafter("d0")
        else:
            self.job.start_command("d0", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node", str(ranks), "-m", "drafter_worker", *self.job.job_args,
                                          "--group", "d0"], log_name="torchrun-d0")
        self.names = ["metrics", *(f"target-{r}" for r in range(replicas)), "d0"]

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("source") == self.source and "step" in rec:
                out.append(rec)
        return out

    def wait_warm(self, steps: int, timeout_s: float) -> None:
        self.job.wait_for(lambda: any(r["step"] >= steps for r in self.records()), timeout_s, "the drafter to warm up")

    def pause(self, stop: bool) -> None:
        import os
        import signal

        for name in self.names:
            pid = self.job.procs[name].pid
            for p in [pid, *_descendants(pid)]:
                try:
                    os.kill(p, signal.SIGSTOP if stop else signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def cpu(self) -> dict[str, float]:
        out = {}
        for name in self.names:
            pid = self.job.procs[name].pid
            out[name] = sum(_cpu_seconds(p) for p in [pid, *_descendants(pid)])
        return out

    def window(self, seconds: float) -> dict:
        cpu0, t0 = self.cpu(), time.time()
        time.sleep(seconds)
        cpu1, t1 = self.cpu(), time.time()
        inside = [r for r in self.records() if t0 <= r["time"] <= t1]
        if len(inside) < 2:
            raise RuntimeError(f"no drafter records in the window ({self.run_dir})")
        steps = inside[-1]["step"] - inside[0]["step"]
        seconds = inside[-1]["time"] - inside[0]["time"]
        return {"steps_per_s": steps / seconds,
                "tokens_per_s": steps / seconds * self.ranks * TOKENS_PER_BATCH,
                "cpu_cores_used": {n: round((cpu1[n] - cpu0[n]) / (t1 - t0), 2) for n in cpu0}}

    def close(self) -> None:
        self.pause(False)
        for name in reversed(self.names):
            self.job.terminate(name, 640)
        self.job.close()


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compare(tmp: Path, row: str, a: tuple, b: tuple, args) -> dict:
    """Jobs a and b (name, config, replicas, ranks) both started; windows alternate while the other is paused."""
    jobs = {}
    try:
        for name, config, replicas, ranks in (a, b):
            jobs[name] = Running(tmp, name, config, replicas, ranks)
            jobs[name].wait_warm(8, args.startup_timeout_s)
            jobs[name].pause(True)
        results = {name: [] for name in jobs}
        for _ in range(args.rounds):
            for name, job in jobs.items():
                job.pause(False)
                time.sleep(args.settle_s)
                results[name].append(job.window(args.window_s))
                job.pause(True)
    finally:
        for job in jobs.values():
            job.close()
    (na, nb) = list(jobs)
    ta = median(w["tokens_per_s"] for w in results[na])
    tb = median(w["tokens_per_s"] for w in results[nb])
    return {"row": row, na: {"tokens_per_s": ta, "windows": results[na]},
            nb: {"tokens_per_s": tb, "windows": results[nb]}, "ratio": tb / ta}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--only", default="replicas,ranks")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out: dict = {"machine_cores": __import__("os").cpu_count()}
    with tempfile.TemporaryDirectory(prefix="dflash-scale-") as tmp_name:
        tmp = Path(tmp_name)
        if "replicas" in args.only:
            model = make_tiny_target(tmp / "big-target", num_layers=16, hidden=256)
            one = write_config(tmp, "replicas-1", model, replicas=1, drafter_layers=1, anchors=2)
            two = write_config(tmp, "replicas-2", model, replicas=2, drafter_layers=1, anchors=2)
            out["replicas"] = compare(tmp, "1 vs 2 target replicas (target-bound job)",
                                      ("replicas-1", one, 1, 1), ("replicas-2", two, 2, 1), args)
            print(f"[scale] 2 replicas / 1 replica: {out['replicas']['ratio']:.2f}x drafter tokens/s", flush=True)
            if args.out:  # each row as soon as it is measured
                write_json(Path(args.out), out)
        if "ranks" in args.only:
            model = make_tiny_target(tmp / "small-target", num_layers=5, hidden=64)
            one = write_config(tmp, "ranks-1", model, replicas=1, drafter_layers=4, anchors=8)
            two = write_config(tmp, "ranks-2", model, replicas=1, drafter_layers=4, anchors=8)
            out["ranks"] = compare(tmp, "1 vs 2 drafter ranks, gloo DDP (drafter-bound job)",
                                   ("ranks-1", one, 1, 1), ("ranks-2", two, 1, 2), args)
            print(f"[scale] 2 ranks / 1 rank: {out['ranks']['ratio']:.2f}x drafter tokens/s", flush=True)
    if args.out:
        write_json(Path(args.out), out)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
