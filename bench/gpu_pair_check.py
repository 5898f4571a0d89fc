"""Data-plane pair checks on a GPU machine (driver for bench/gpu_pair_check.sh).

NEVER RUN ON A GPU YET: written on a CPU-only machine; its gloo/CPU paths were tried there.

Subcommands (each exits 0 on the expected outcome, 1 otherwise):
  versions                   torch / CUDA / NCCL versions, GPUs, the NCCL error-handling env
  transfer --kind K          target (this process, the real DrafterLink) and drafter (a child
                             process, the real PairGroup and Receiver): a weights message, then
                             batches of 16-128 MiB, every batch checked against its expected
                             content (and its checksum logged); --stall then sends one batch the
                             drafter never receives: the link must report "failed" within the
                             transport timeout and the target process must live on
  lonely --rank R            a pair whose peer never joins: TransportError within the timeout,
                             and the process still alive well after it (no watchdog kill)
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

from common.streams import record_current, wait_current
from common.transport import (
    DRAFTER_RANK, TARGET_RANK, PairGroup, TransportError, configure_nccl_error_handling, connect_store, gpu_uuid,
    host_store,
)

MIB = 1 << 20
WINDOW = 8  # batches in flight (buffers posted on the drafter, queued on the target)
PREFIX = "pair/check/1"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} pid {os.getpid()}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch_bytes(i: int, min_mib: int, max_mib: int) -> int:
    """Deterministic sizes in [min_mib, max_mib] MiB, known to both processes."""
    span = max_mib - min_mib + 1
    return (min_mib + (i * 37) % span) * MIB


def content(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen, device=device)


def checksum(buf: torch.Tensor) -> int:
    return int(buf.view(torch.int64).sum().item())  # nbytes are whole MiB: a multiple of 8


def _same_gpu_refused(error: str) -> bool:
    """NCCL's refusal of two ranks on one GPU (torch appends NCCL's last error to "invalid usage")."""
    return "Duplicate GPU" in error or "invalid usage" in error


# ------------------------------------------------------------------------------------------ versions
def cmd_versions(args) -> int:
    log(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
    import torch.distributed as dist
    log(f"nccl available {dist.is_nccl_available()}, gloo available {dist.is_gloo_available()}")
    if torch.cuda.is_available():
        log(f"NCCL {torch.cuda.nccl.version()}")
        for d in range(torch.cuda.device_count()):
            dev = torch.device("cuda", d)
            log(f"cuda:{d} {torch.cuda.get_device_name(d)} {gpu_uuid(dev)}")
    if dist.is_nccl_available():
        opts = dist.ProcessGroupNCCL.Options()
        log(f"ProcessGroupNCCL.Options attributes: {sorted(a for a in dir(opts) if not a.startswith('__'))}")
        config = getattr(opts, "config", None)
        if config is not None:
            log(f"Options.config attributes: {sorted(a for a in dir(config) if not a.startswith('__'))}")
    log(f"NCCL error-handling env in effect: {configure_nccl_error_handling(args.timeout_s)}")
    return 0


# ------------------------------------------------------------------------------------------ transfer
def cmd_transfer(args) -> int:
    device = torch.device(args.target_device)
    configure_nccl_error_handling(args.timeout_s)
    child_env = None
    if args.host_id_split:
        # Each rank claims its own host: NCCL's duplicate-GPU check compares (host, bus id) and
        # the pair talks over its socket transport on loopback, so one GPU can hold both ranks.
        os.environ.update(NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1", NCCL_HOSTID="dflash-check-target")
        child_env = {**os.environ, "NCCL_HOSTID": "dflash-check-drafter"}
    port = free_port()
    store = host_store("127.0.0.1", port, args.timeout_s)
    child = subprocess.Popen([
        sys.executable, __file__, "drafter", "--kind", args.kind, "--port", str(port),
        "--device", args.drafter_device, "--timeout-s", str(args.timeout_s), "--batches", str(args.batches),
        "--weights-mib", str(args.weights_mib), "--min-mib", str(args.min_mib), "--max-mib", str(args.max_mib),
        *(["--stall"] if args.stall else []),
    ], env=child_env)
    try:
        return _target(args, device, port, child)
    finally:
        try:
            rc = child.wait(timeout=args.timeout_s + 30)
        except subprocess.TimeoutExpired:
            log("drafter process did not end; killing it")
            child.kill()
            rc = child.wait(10)
        log(f"drafter process exit status {rc}")
        del store


def _target(args, device: torch.device, port: int, child: subprocess.Popen) -> int:
    from target_server.link import DrafterLink

    weights = content(args.weights_mib * MIB, 0, device)
    events: queue.Queue = queue.Queue()
    link = DrafterLink(name="check", transport=args.kind, store_address=("127.0.0.1", port), prefix=PREFIX,
                       device=device, timeout_s=args.timeout_s, weights=weights, events=events,
                       local_host="127.0.0.1")
    start = time.monotonic()
    link.start()
    while not link.paired:
        try:
            ev = events.get(timeout=0.1)
        except queue.Empty:
            if time.monotonic() - start > 2 * args.timeout_s + 10:
                log("FAIL: not paired and no failure reported within 2 x timeout: pair formation is unbounded")
                return 1
            continue
        if args.target_device == args.drafter_device and _same_gpu_refused(ev.error):
            log(f"SKIP (expected on one GPU): NCCL refuses two ranks on one GPU; reported cleanly "
                f"after {time.monotonic() - start:.1f}s: {ev.error}")
            return 0
        log(f"FAIL: pair formation failed after {time.monotonic() - start:.1f}s: {ev.error}")
        return 1
    log(f"paired in {time.monotonic() - start:.2f}s ({args.kind}, target {device}, drafter {args.drafter_device})")
    outstanding: dict[int, SimpleNamespace] = {}
    sent_bytes, t0 = 0, time.perf_counter()

    def settle_one() -> bool:
        nonlocal sent_bytes
        ev = events.get(timeout=2 * args.timeout_s)
        if ev.kind != "sent":
            log(f"FAIL: link reported {ev.kind}: {ev.error}")
            return False
        wait_current(device, ev.done_event)  # before the buffer can be freed or reused
        outstanding.pop(id(ev.ready), None)
        sent_bytes += ev.nbytes
        return True

    try:
        for i in range(args.batches):
            while len(outstanding) >= WINDOW:
                if not settle_one():
                    return 1
            nbytes = batch_bytes(i, args.min_mib, args.max_mib)
            buf = content(nbytes, i + 1, device)
            if i < 4 or i == args.batches - 1:
                log(f"batch {i}: {nbytes // MIB} MiB checksum {checksum(buf)}")
            ready = SimpleNamespace(buffer=buf, layout=SimpleNamespace(nbytes=nbytes), ready_event=record_current(device))
            outstanding[id(ready)] = ready
            link.enqueue(ready, i + 1)
        while outstanding:
            if not settle_one():
                return 1
    except queue.Empty:
        log(f"FAIL: no link event within {2 * args.timeout_s:.0f}s")
        return 1
    seconds = time.perf_counter() - t0
    log(f"sent {args.batches} batches, {sent_bytes / 2**30:.2f} GiB in {seconds:.2f}s "
        f"({sent_bytes / 2**30 / seconds:.2f} GiB/s)")
    rc = 0
    if args.stall:
        nbytes = 64 * MIB  # large enough that no transport completes it without a matching receive
        ready = SimpleNamespace(buffer=content(nbytes, 999, device), layout=SimpleNamespace(nbytes=nbytes),
                                ready_event=record_current(device))
        t_stall = time.monotonic()
        link.enqueue(ready, args.batches + 1)
        try:
            ev = events.get(timeout=3 * args.timeout_s + 10)
        except queue.Empty:
            log("FAIL: a send the drafter never receives did not fail within 3 x timeout")
            return 1
        log(f"stalled send: link reported {ev.kind!r} after {time.monotonic() - t_stall:.1f}s "
            f"(timeout {args.timeout_s:.0f}s), batch released: {ev.ready is ready}; error: {ev.error}")
        rc = 0 if ev.kind == "failed" and ev.ready is ready else 1
        link.join(args.timeout_s + 10)
        log(f"link thread ended: {not link.is_alive()}")
        time.sleep(10)  # a watchdog / heartbeat monitor would end this process about now
        log("target process alive 10s after the failed op")
    t_stop = time.perf_counter()
    link.stop()
    log(f"stop() returned in {1e3 * (time.perf_counter() - t_stop):.1f} ms")
    link.join(args.timeout_s + 10)
    if link.is_alive():
        log("FAIL: link thread still alive after stop")
        rc = 1
    child_rc = child.wait(timeout=args.timeout_s + 60)
    return rc or (1 if child_rc else 0)


def cmd_drafter(args) -> int:
    from drafter_worker.data_plane import PairAttachment, Receiver

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    configure_nccl_error_handling(args.timeout_s)
    store = connect_store("127.0.0.1", args.port, args.timeout_s)
    try:
        pair = PairGroup(kind=args.kind, store=store, prefix=PREFIX, rank=DRAFTER_RANK, device=device,
                         timeout_s=args.timeout_s)
    except TransportError as exc:
        log(f"drafter: pair formation failed: {exc}")
        return 0 if args.device == "cuda:0" and _same_gpu_refused(str(exc)) else 1
    t0 = time.perf_counter()
    wbuf = torch.empty(args.weights_mib * MIB, dtype=torch.uint8, device=device)
    pair.recv(wbuf, 0)
    seconds = time.perf_counter() - t0
    ok = torch.equal(wbuf, content(wbuf.numel(), 0, device))
    log(f"drafter: weights {args.weights_mib} MiB received in {seconds:.2f}s, content {'OK' if ok else 'WRONG'}")
    del wbuf
    receiver = Receiver(PairAttachment(pair), device)
    receiver.start()
    bufs = [torch.empty(args.max_mib * MIB, dtype=torch.uint8, device=device) for _ in range(WINDOW)]
    for i in range(min(WINDOW, args.batches)):
        receiver.inbox.put((SimpleNamespace(nbytes=batch_bytes(i, args.min_mib, args.max_mib), tag=i + 1),
                            bufs[i], None))
    bad = 0
    try:
        for i in range(args.batches):
            item = receiver.ready.get(timeout=2 * args.timeout_s)
            if isinstance(item, TransportError):
                log(f"drafter: FAIL: receive {i} failed: {item}")
                return 1
            meta, buf, ev = item
            wait_current(device, ev)
            got = buf[: meta.nbytes]
            expected = content(meta.nbytes, i + 1, device)
            same = torch.equal(got, expected)
            if not same or i < 4 or i == args.batches - 1:
                log(f"drafter: batch {i}: {meta.nbytes // MIB} MiB checksum {checksum(got)} "
                    f"(expected {checksum(expected)}) {'OK' if same else 'WRONG'}")
            bad += not same
            del expected
            if i + WINDOW < args.batches:
                j = i + WINDOW
                receiver.inbox.put((SimpleNamespace(nbytes=batch_bytes(j, args.min_mib, args.max_mib), tag=j + 1),
                                    buf, record_current(device)))
    except queue.Empty:
        log(f"drafter: FAIL: no batch within {2 * args.timeout_s:.0f}s")
        return 1
    log(f"drafter: {args.batches} batches received, {bad} wrong")
    if args.stall:
        time.sleep(args.timeout_s + 15)  # never receive the last batch; stay alive past the target's timeout
        log("drafter: process alive after the target's stalled send timed out")
    receiver.stop()
    pair.abort()
    receiver.join(args.timeout_s)
    return 0 if ok and bad == 0 else 1


# ------------------------------------------------------------------------------------------ lonely
def cmd_lonely(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    configure_nccl_error_handling(args.timeout_s)
    port = free_port()
    store = host_store("127.0.0.1", port, args.timeout_s)
    start = time.monotonic()
    try:
        pair = PairGroup(kind=args.kind, store=connect_store("127.0.0.1", port, args.timeout_s), prefix=PREFIX,
                         rank=args.rank, device=device, timeout_s=args.timeout_s)
    except TransportError as exc:
        took = time.monotonic() - start
        log(f"rank {args.rank}: TransportError after {took:.1f}s (timeout {args.timeout_s:.0f}s): {exc}")
        time.sleep(args.timeout_s + 10)  # a watchdog / heartbeat monitor would end this process about now
        log(f"rank {args.rank}: process alive {args.timeout_s + 10:.0f}s after the failure")
        del store
        return 0 if took <= 2 * args.timeout_s + 5 else 1
    log(f"rank {args.rank}: FAIL: a pair formed without a peer ({pair.prefix})")
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("versions")
    p.add_argument("--timeout-s", type=float, default=20.0)
    for name in ("transfer", "drafter"):
        p = sub.add_parser(name)
        p.add_argument("--kind", default="nccl")
        p.add_argument("--timeout-s", type=float, default=20.0)
        p.add_argument("--batches", type=int, default=64)
        p.add_argument("--weights-mib", type=int, default=1024)
        p.add_argument("--min-mib", type=int, default=16)
        p.add_argument("--max-mib", type=int, default=128)
        p.add_argument("--stall", action="store_true")
        if name == "transfer":
            p.add_argument("--target-device", default="cuda:0")
            p.add_argument("--drafter-device", default="cuda:0")
            p.add_argument("--host-id-split", action="store_true",
                           help="give each rank its own NCCL_HOSTID (socket transport on loopback): "
                                "both ranks on one GPU")
        else:
            p.add_argument("--port", type=int, required=True)
            p.add_argument("--device", default="cuda:0")
    p = sub.add_parser("lonely")
    p.add_argument("--kind", default="nccl")
    p.add_argument("--rank", type=int, choices=(TARGET_RANK, DRAFTER_RANK), required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--timeout-s", type=float, default=10.0)
    args = parser.parse_args()
    return {"versions": cmd_versions, "transfer": cmd_transfer, "drafter": cmd_drafter, "lonely": cmd_lonely}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
