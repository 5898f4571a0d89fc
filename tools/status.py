"""``dflash-status``: ask the target over its control socket and print a table.

    dflash-status --config configs/demo.toml            # once
    dflash-status --config configs/demo.toml --watch    # refresh in place every 2 s

The target answers STATUS_REQUEST with its uptime, tokens/s, queue and bucket
depths and one entry per registered drafter (id, group, state, step, heartbeat
age, batches in flight). The last loss of each drafter is not known to the
target; it is read from the tail of ``runs/<name>/metrics.jsonl`` when the run
directory is known (from ``--config`` or ``--run-dir``) and shown as ``-``
otherwise. Drafters named in the config's ``[drafters.<id>]`` tables but not
registered are listed as ``not connected``.

``--config`` defaults to ``$DFLASH_CONFIG`` and ``$DFLASH_RUN_NAME`` overrides
``run.name``, so sourcing the systemd environment file is enough.

Exit status: 0 the target answered, 1 it did not, 2 bad config or arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import zmq

from common import protocol as P
from common.auth import read_key, status_credential
from common import cli
from common.config import ConfigError, drafter_ids_in
from common.metric_names import DRAFTER_SOURCE, Drafter
from common.sockets import SecurityError, SocketFactory

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
# How much of metrics.jsonl (from its end) is searched for the last losses.
LOSS_TAIL_BYTES = 8 << 20
# A line without this cannot hold a loss: skipped without parsing it (the tail can be 8 MiB).
_LOSS_KEY = json.dumps(Drafter.LOSS).encode()


class NoAnswer(RuntimeError):
    """The target did not answer: not running, still starting, or a wrong address."""


def query(address: str, timeout_s: float, sockets: SocketFactory, credential: str = "") -> P.Status:
    """One STATUS_REQUEST round trip; raises :class:`NoAnswer` after ``timeout_s``.

    ``sockets`` carries the job's security setting: with CURVE configured the
    target only answers clients holding the client key. ``credential`` is the
    run's status key (common.auth), without which the target refuses.
    """
    try:
        sock = sockets.connect(zmq.DEALER, address, LINGER=0)
    except zmq.ZMQError as exc:
        raise NoAnswer(f"cannot connect to {address}: {exc.strerror}") from None
    try:
        sock.send(P.StatusRequest(auth=credential).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise NoAnswer(
                f"no answer from the target at {address} within {timeout_s:g}s: it is not running, "
                "still starting up (loading the model), or listening elsewhere (check control.address)"
            )
        try:
            msg = P.decode(sock.recv())
        except P.ProtocolError as exc:
            raise NoAnswer(f"the peer at {address} sent an unreadable answer ({exc.message}); is it a dflash target?") from None
        if isinstance(msg, P.Error):
            raise NoAnswer(f"the target at {address} refused the status request: {msg.message}")
        if not isinstance(msg, P.Status):
            raise NoAnswer(f"the target at {address} answered {msg.TYPE} instead of STATUS")
        return msg
    finally:
        sock.close()


def last_losses(metrics_path: Path, drafter_ids: list[str], max_bytes: int = LOSS_TAIL_BYTES) -> dict[str, tuple[float, int]]:
    """``{drafter id: (loss, step)}`` from the newest records of ``metrics.jsonl``.

    Reads the file backwards in chunks and stops once every id is found (or after
    ``max_bytes``), so a long run's log costs the same as a short one's.
    """
    wanted = {DRAFTER_SOURCE(d): d for d in drafter_ids}
    found: dict[str, tuple[float, int]] = {}
    try:
        f = open(metrics_path, "rb")
    except OSError:
        return found
    with f:
        end = f.seek(0, os.SEEK_END)
        pos, carry, read = end, b"", 0
        while pos > 0 and read < max_bytes and len(found) < len(wanted):
            size = min(1 << 16, pos)
            pos -= size
            f.seek(pos)
            chunk = f.read(size) + carry
            read += size
            lines = chunk.split(b"\n")
            carry = lines[0] if pos > 0 else b""  # possibly cut; completed by the next chunk
            for line in reversed(lines[1:] if pos > 0 else lines):
                _take_loss(line, wanted, found)
    return found


def _take_loss(line: bytes, wanted: dict[str, str], found: dict[str, tuple[float, int]]) -> None:
    if _LOSS_KEY not in line:
        return
    try:
        rec = json.loads(line)
        drafter_id = wanted.get(rec["source"])
        loss = rec["values"][Drafter.LOSS]
        step = int(rec["step"])
    except (ValueError, KeyError, TypeError):
        return  # a line still being written, or not a drafter record
    if drafter_id is not None and drafter_id not in found and isinstance(loss, (int, float)):
        found[drafter_id] = (float(loss), step)


def format_duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_status(
    status: P.Status,
    *,
    address: str,
    run_name: str | None = None,
    bucket_lengths: list[int] | None = None,
    losses: dict[str, tuple[float, int]] | None = None,
    expected_ids: list[str] | None = None,
) -> str:
    """The status table as text (a pure function of its inputs, so tests need no target)."""
    losses = losses or {}
    header = f"dflash status  target {address}" + (f"  run {run_name}" if run_name else "")
    buckets = " ".join(
        f"{bucket_lengths[i] if bucket_lengths and i < len(bucket_lengths) else i}:{d}"
        for i, d in enumerate(status.bucket_depths)
    )
    lines = [
        header,
        f"target: up {format_duration(status.uptime_s)}, {status.tokens_per_s:.0f} tokens/s, "
        f"queue {status.queue_depth} ready batches (by bucket length {buckets or '-'})",
        "",
    ]
    columns = ["drafter", "group", "state", "step", "ckpt", "heartbeat", "in flight", "last loss", "pid"]
    rows = []
    seen = set()
    for d in sorted(status.drafters, key=lambda d: d.id):
        seen.add(d.id)
        loss = losses.get(d.id)
        rows.append([
            d.id, d.group, d.state, str(d.step), str(d.checkpoint_step), f"{d.heartbeat_age_s:.1f}s ago",
            str(d.inflight), f"{loss[0]:.4f} @{loss[1]}" if loss else "-", str(d.pid),
        ])
    for drafter_id in expected_ids or []:
        if drafter_id not in seen:
            loss = losses.get(drafter_id)
            rows.append([drafter_id, "-", "not connected", "-", "-", "-", "-", f"{loss[0]:.4f} @{loss[1]}" if loss else "-", "-"])
    if not rows:
        lines.append("no drafter registered")
        return "\n".join(lines)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    numeric = {3, 4, 5, 6, 7, 8}

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines.append(fmt(columns))
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-status", description=cli.help_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_config_args(p, config_help="TOML job config; gives the address, run directory and drafter ids",
                        set_example="run.name=exp2")
    p.add_argument("--address", help=f"control address of the target (default: control.address, else {DEFAULT_ADDRESS})")
    p.add_argument("--run-dir", type=Path, help="run directory whose metrics.jsonl gives the last losses and whose "
                   "auth/status.key proves the right to ask (default: from the config)")
    p.add_argument("--status-key", type=Path, help="file holding the run's status key (default: <run dir>/auth/status.key)")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh in place every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--timeout-s", type=float, default=2.0, help="how long to wait for the target's answer")
    p.add_argument("--json", action="store_true", help="print the raw STATUS message (plus last losses) as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    address, run_dir, run_name, bucket_lengths, expected_ids = args.address, args.run_dir, None, None, []
    curve_dir, curve_client = "", "client"
    if args.config or args.overrides or args.print_config:
        overrides = cli.config_overrides(args)
        cfg = cli.load_job_config("dflash-status", args.config, overrides)
        if cfg is None:
            return 2
        if args.print_config:
            return cli.print_config(cfg, "dflash-status", args.config, overrides)
        try:
            expected_ids = drafter_ids_in(args.config) if args.config else []
        except (ConfigError, OSError, ValueError) as exc:
            print(f"dflash-status: config error: {exc}", file=sys.stderr)
            return 2
        address = address or cfg.control.address
        run_dir = run_dir or cfg.run.path
        run_name = cfg.run.name
        bucket_lengths = list(cfg.data.bucket_lengths)
        curve_dir, curve_client = cfg.security.curve_dir, cfg.security.curve_client
    address = address or DEFAULT_ADDRESS
    if run_dir is not None and run_name is None:
        run_name = run_dir.name

    try:
        given_key = read_key(args.status_key) if args.status_key else ""
    except (OSError, ValueError) as exc:
        print(f"dflash-status: cannot read the status key: {exc}", file=sys.stderr)
        return 2
    ctx = zmq.Context()
    sockets = SocketFactory(ctx, curve_dir, curve_client)
    tty = sys.stdout.isatty()
    try:
        while True:
            # Read again every frame: a watch started before the target has no key yet.
            credential = given_key or _run_credential(run_dir)
            text, code = _one_frame(args, sockets, credential, address, run_dir, run_name, bucket_lengths, expected_ids)
            if args.watch is None:
                print(text, file=sys.stdout if code == 0 else sys.stderr)
                return code
            stamp = time.strftime("%H:%M:%S")
            if tty:
                sys.stdout.write("\x1b[H\x1b[J")  # home + clear: redraw in place
            sys.stdout.write(f"{text}\n\n(refreshed {stamp}, every {args.watch:g}s; Ctrl-C to quit)\n")
            if not tty:
                sys.stdout.write("\n")
            sys.stdout.flush()
            time.sleep(max(0.1, args.watch))
    except KeyboardInterrupt:
        return 0
    except SecurityError as exc:
        print(f"dflash-status: {exc}", file=sys.stderr)
        return 2
    finally:
        sockets.close()
        ctx.destroy(linger=0)


def _run_credential(run_dir: Path | None) -> str:
    """The run's status key; empty when there is none yet (the target, if up, then says what it needs)."""
    try:
        return status_credential(run_dir) if run_dir is not None else ""
    except (OSError, ValueError):
        return ""


def _one_frame(args, sockets, credential, address, run_dir, run_name, bucket_lengths, expected_ids) -> tuple[str, int]:
    try:
        status = query(address, args.timeout_s, sockets, credential)
    except NoAnswer as exc:
        return f"dflash-status: {exc}", 1
    ids = sorted({d.id for d in status.drafters} | set(expected_ids))
    losses = last_losses(run_dir / "metrics.jsonl", ids) if run_dir is not None else {}
    if args.json:
        body = asdict(status)
        body["last_loss"] = {k: {Drafter.LOSS: v[0], "step": v[1]} for k, v in losses.items()}
        return json.dumps(body, indent=1, sort_keys=True), 0
    return format_status(status, address=address, run_name=run_name, bucket_lengths=bucket_lengths,
                         losses=losses, expected_ids=expected_ids), 0


if __name__ == "__main__":
    sys.exit(main())
