"""Data-plane bandwidth for one batch-sized buffer (bench row 2).

    .venv/bin/python bench/transport_bench.py [--rounds 7] [--iters 20] [--consume copy|sum] [--out FILE]

Two processes, both with one torch thread: this one is the producer (the
target's side, rank 0), a spawned child is the consumer (the drafter's side,
rank 1). The buffer is one packed batch (``common.packing.BatchLayout``) of
the demo job by default: 768 tokens x 5 captured layers x 576 (SmolLM2) in
float32, about 8.9 MB. Methods, all moving the same bytes:

- ``memcpy``: ``dst.copy_(src)`` in the producer process, one destination:
  source and destination stay in the CPU's last-level cache (32 MiB here);
- ``memcpy_ring``: the same copy into ``--slots`` destinations in turn, the
  memory footprint of the ring: the baseline of ``shm``, so that the ratio
  compares transports and not cache residency (both ratios are reported);
- ``memcpy_pair``: both processes copy a batch at the same time, each its own
  buffers, nothing passed between them (the slower side's rate): what the
  machine gives two busy processes, i.e. the ceiling of any two-process
  hand-off; ``shm`` against it isolates the hand-off's own cost;
- ``shm``: the transport as the job runs it (``target_server/shm_pool.py``):
  the batch is already in a slot of a ``common.shm_transport.ShmRing`` (the
  target's capture writes it there), so the producer only marks the slot as
  being written and publishes its new tag; the consumer waits for the tag
  (``wait_ready``), reads the slot in place (``--consume sum``: every byte, as
  a CPU drafter's step reads its features) and acknowledges over a pipe (the
  control plane's ACK, which frees the slot); ``--slots`` slots keep both
  sides busy at once;
- ``shm_copy``: the same, but the producer copies the batch into the slot
  first: a copying ring (the design the zero-copy pool replaced), shown to
  explain why;
- ``gloo_raw``: ``torch.distributed.send``/``recv`` of a group made with
  ``init_process_group("gloo")`` (the baseline of ``gloo_pair``);
- ``gloo_pair``: ``common.transport.PairGroup`` send/recv, as the target and
  drafter use it;
- ``gloo_alt``: the two gloo paths alternating transfer by transfer, so both
  meet the same machine state; their ratio (row 2b) is the median time of a
  raw transfer over the median time of a pair transfer in a round (each
  transfer timed where it lands, from the previous landing), median over rounds. Loopback gloo on two
  shared cores swings by tens of percent between blocks of transfers, which
  blocks of one method after the other would read as a difference.

A round runs every method for ``--iters`` transfers; the rate of a method in
a round is (iters - 1) transfers over the time from the first to the last
completed one, timed where the data lands. Rounds alternate the method order,
one warm-up round is dropped; a ratio is the median over rounds of the two
methods' rates in the same round. For ``shm`` the JSON also says where a
batch's time goes (producer write and wait for a free slot, consumer wait and
read), which explains a gap: on 2 shared cores the two sides must run at once. The last stdout line
is the JSON result; without ``common.shm_transport`` the ``shm`` entry says so
and the rest still runs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import multiprocessing as mp
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from benchlib import free_ports, median, write_json

from common.packing import BatchLayout  # noqa: E402
from common.transport import DRAFTER_RANK, TARGET_RANK, PairGroup, connect_store, host_store  # noqa: E402

TIMEOUT_S = 60.0
METHODS = ("memcpy", "memcpy_ring", "memcpy_pair", "shm", "shm_copy", "gloo_raw", "gloo_pair", "gloo_alt")


def _load_shm(module_name: str) -> tuple[Any, str]:
    """(ShmRing class or None, why not)."""
    try:
        return importlib.import_module(module_name).ShmRing, ""
    except ImportError as exc:
        return None, f"shm transport missing ({exc})"


def segment_name(*parts: object) -> str:
    try:
        from common.shm_transport import segment_name as name
    except ImportError:
        return "dflash." + ".".join(str(p) for p in parts)
    return name(*parts)


def _groups(rank: int, ports: list[int]) -> PairGroup:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    if rank == TARGET_RANK:
        store = host_store("127.0.0.1", ports[1], TIMEOUT_S)
    else:
        store = connect_store("127.0.0.1", ports[1], TIMEOUT_S)
    pair = PairGroup(kind="gloo", store=store, prefix="bench/pair", rank=rank, device=torch.device("cpu"), timeout_s=TIMEOUT_S)
    pair._bench_store = store  # keep the store client alive as long as the pair
    return pair


def _rate(times: list[float], nbytes: int) -> float:
    """Bytes/s between the first and the last completion."""
    return (len(times) - 1) * nbytes / (times[-1] - times[0])


# ---------------------------------------------------------------------------
# Consumer (the drafter's side), in a spawned process


def consumer(conn, ports: list[int], nbytes: int, shm_name: str, slots: int, shm_module: str, consume: str) -> None:
    torch.set_num_threads(1)
    pair = _groups(DRAFTER_RANK, ports)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)
    ring = None
    checksum = 0
    try:
        while True:
            command = conn.recv()
            kind = command[0]
            if kind == "stop":
                break
            if kind == "attach":
                ring_cls, _ = _load_shm(shm_module)
                ring = ring_cls.attach(shm_name, [nbytes], slots)
                conn.send(("attached",))
                continue
            _, iters, first_tag = command
            times = []
            wait_s = copy_s = 0.0
            for i in range(iters):
                tag = first_tag + i
                if kind == "memcpy_pair":
                    dst.copy_(buf)  # its own copy, at the same time as the producer's, no data between them
                elif kind == "gloo_raw":
                    dist.recv(buf, src=TARGET_RANK, tag=tag)
                elif kind == "gloo_pair" or (kind == "gloo_alt" and i % 2):
                    pair.recv(buf, tag)
                elif kind == "gloo_alt":
                    dist.recv(buf, src=TARGET_RANK, tag=tag)
                elif kind in ("shm", "shm_copy"):
                    slot = i % slots
                    t0 = time.perf_counter()
                    ring.wait_ready(0, slot, tag, TIMEOUT_S)  # raises TransportError on timeout
                    t1 = time.perf_counter()
                    if consume == "copy":  # a drafter on an accelerator copies the slot to its device
                        dst.copy_(ring.payload(0, slot)[:nbytes])
                    else:  # read in place, as a CPU drafter's train_step reads its features
                        checksum += int(ring.payload(0, slot)[:nbytes].view(torch.int64).sum())
                    wait_s += t1 - t0
                    copy_s += time.perf_counter() - t1
                    conn.send(("ack", i))  # frees the slot, as the drafter's ACK does
                times.append(time.perf_counter())
            conn.send(("done", times, {"consumer_wait_ms": 1e3 * wait_s / iters, "consumer_read_ms": 1e3 * copy_s / iters}))
    finally:
        if ring is not None:
            ring.close()
        pair.abort()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Producer (the target's side), in this process


class Producer:
    def __init__(self, conn, ports: list[int], nbytes: int, ring, slots: int):
        self.conn = conn
        self.nbytes = nbytes
        self.ring = ring
        self.slots = slots
        self.pair = _groups(TARGET_RANK, ports)
        gen = torch.Generator().manual_seed(0)
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        # As many private batch buffers as the ring has slots: the same memory footprint as shm.
        self.ring_dst = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(slots)]
        self.tag = 1
        self.breakdown: dict[str, list[float]] = {}  # shm: where a batch's time goes, per round

    def run(self, kind: str, iters: int) -> float:
        """Bytes/s of one round of ``kind``."""
        if kind in ("memcpy", "memcpy_ring"):
            times = []
            for i in range(iters):
                dst = self.dst if kind == "memcpy" else self.ring_dst[i % self.slots]
                dst.copy_(self.src)
                times.append(time.perf_counter())
            return _rate(times, self.nbytes)
        first_tag, self.tag = self.tag, self.tag + iters
        self.conn.send((kind, iters, first_tag))
        ack_s = copy_s = 0.0
        own: list[float] = []
        for i in range(iters):
            if kind == "memcpy_pair":
                self.ring_dst[i % self.slots].copy_(self.src)
                own.append(time.perf_counter())
            elif kind == "gloo_raw":
                dist.send(self.src, dst=DRAFTER_RANK, tag=first_tag + i)
            elif kind == "gloo_pair" or (kind == "gloo_alt" and i % 2):
                self.pair.send(self.src, first_tag + i)
            elif kind == "gloo_alt":
                dist.send(self.src, dst=DRAFTER_RANK, tag=first_tag + i)
            elif kind in ("shm", "shm_copy"):
                slot = i % self.slots
                t0 = time.perf_counter()
                if i >= self.slots:
                    self._expect("ack", i - self.slots)
                t1 = time.perf_counter()
                self.ring.publish(0, slot, 0)  # being written (what the capture thread does first)
                if kind == "shm_copy":
                    self.ring.payload(0, slot)[: self.nbytes].copy_(self.src)
                self.ring.publish(0, slot, first_tag + i)
                ack_s += t1 - t0
                copy_s += time.perf_counter() - t1
        if kind in ("shm", "shm_copy"):
            for i in range(max(0, iters - self.slots), iters):
                self._expect("ack", i)
        _, times, breakdown = self._expect("done")
        if kind == "memcpy_pair":  # the slower of the two sides bounds a pipeline of the two
            return min(_rate(times, self.nbytes), _rate(own, self.nbytes))
        if kind == "gloo_alt":  # not a rate: raw time / pair time over the round (pair rate / raw rate)
            spans = [b - a for a, b in zip(times, times[1:])]  # spans[j] ends at transfer j + 1
            raw = [s for j, s in enumerate(spans) if (j + 1) % 2 == 0]
            pair = [s for j, s in enumerate(spans) if (j + 1) % 2 == 1]
            return median(raw) / median(pair)  # medians: one descheduled transfer does not decide it
        if kind in ("shm", "shm_copy"):
            breakdown.update(producer_ack_wait_ms=1e3 * ack_s / iters, producer_write_ms=1e3 * copy_s / iters)
            for key, value in breakdown.items():
                self.breakdown.setdefault(f"{kind}/{key}", []).append(value)
        return _rate(times, self.nbytes)

    def _expect(self, kind: str, value: Any = None) -> tuple:
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"no {kind} from the consumer within {TIMEOUT_S}s")
        message = self.conn.recv()
        if message[0] != kind or (value is not None and message[1] != value):
            raise RuntimeError(f"expected {kind} {value}, got {message[:2]}")
        return message

    def close(self) -> None:
        self.pair.abort()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=768, help="tokens of the batch (B*T)")
    parser.add_argument("--feature-dim", type=int, default=5 * 576, help="k*H of the batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds (after one warm-up round)")
    parser.add_argument("--iters", type=int, default=20, help="transfers per method per round")
    parser.add_argument("--slots", type=int, default=3, help="shm slots (target.ready_batches)")
    parser.add_argument("--consume", choices=["copy", "sum"], default="sum",
                        help="what the shm consumer does with a slot: sum it in place (default) or copy it out")
    parser.add_argument("--shm-module", default="common.shm_transport", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    layout = BatchLayout(1, args.tokens, args.feature_dim, getattr(torch, args.dtype))
    nbytes = layout.nbytes
    ring_cls, shm_missing = _load_shm(args.shm_module)
    methods = [m for m in METHODS if not m.startswith("shm") or ring_cls is not None]
    if ring_cls is None:
        print(f"shm: n/a ({shm_missing})")

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    ports = free_ports(2)
    shm_name = segment_name("bench", os.getpid())  # dflash.*: sweep_stale cleans it up if this process is killed
    proc = ctx.Process(target=consumer, args=(child_conn, ports, nbytes, shm_name, args.slots, args.shm_module, args.consume), daemon=True)
    proc.start()
    ring = None
    rates: dict[str, list[float]] = {m: [] for m in methods}
    try:
        if ring_cls is not None:
            ring = ring_cls.create(shm_name, [nbytes], args.slots)
        producer = Producer(conn, ports, nbytes, ring, args.slots)
        if ring is not None:
            conn.send(("attach",))
            producer._expect("attached")
        for round_index in range(args.rounds + 1):
            order = methods if round_index % 2 == 0 else methods[::-1]  # alternate: noise hits all alike
            for kind in order:
                rate = producer.run(kind, args.iters)
                if round_index:  # round 0 warms up
                    rates[kind].append(rate)
            if round_index == 0:
                producer.breakdown.clear()
        conn.send(("stop",))
        producer.close()
        proc.join(TIMEOUT_S)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        if ring is not None:
            ring.close()
            ring.unlink()

    def ratio(a: str, b: str) -> float:
        """Median over rounds of a/b: the two were measured next to each other in each round."""
        return median(x / y for x, y in zip(rates[a], rates[b]))

    alt = rates.pop("gloo_alt", [])
    gbps = {m: median(r) / 1e9 for m, r in rates.items()}
    result: dict[str, Any] = {
        "nbytes": nbytes, "tokens": args.tokens, "feature_dim": args.feature_dim, "dtype": args.dtype,
        "slots": args.slots, "consume": args.consume, "rounds": args.rounds, "iters": args.iters,
        "GBps": gbps, "rounds_GBps": {m: [x / 1e9 for x in r] for m, r in rates.items()},
        "gloo_pair_vs_raw": median(alt),
        "gloo_pair_vs_raw_rounds": alt,
        "gloo_pair_vs_raw_blocks": ratio("gloo_pair", "gloo_raw"),
    }
    if ring_cls is None:
        result["shm_vs_memcpy"] = None
        result["shm_missing"] = shm_missing
    else:
        result["shm_vs_memcpy"] = ratio("shm", "memcpy_ring")
        result["shm_vs_memcpy_hot"] = ratio("shm", "memcpy")
        result["shm_vs_memcpy_pair"] = ratio("shm", "memcpy_pair")
        result["shm_copy_vs_memcpy"] = ratio("shm_copy", "memcpy_ring")
        result["shm_copy_vs_memcpy_pair"] = ratio("shm_copy", "memcpy_pair")
        result["shm_breakdown_ms"] = {k: median(v) for k, v in producer.breakdown.items()}
        result["memcpy_ring_ms"] = 1e3 * nbytes / median(rates["memcpy_ring"])
    for name, value in gbps.items():
        print(f"{name:>10}: {value:6.2f} GB/s")
    write_json(args.out, result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
