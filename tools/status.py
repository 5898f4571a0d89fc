"""``dflash-status``: ask every target replica over its control socket and print a table.

    dflash-status --config configs/demo.toml            # once
    dflash-status --config configs/demo.toml --watch    # refresh in place every 2 s

Each target replica (``target.replicas`` of them, at ``control.replica_addresses``
or at control.address with the port raised by ``replica * control.replica_port_step``)
answers STATUS_REQUEST with its uptime, tokens/s, queue and bucket depths and
one entry per registration it holds (drafter id, rank, generation, state, step,
heartbeat age, batches in flight). All replicas are asked at once; one that
does not answer is shown as such and the others are still listed. The last
loss of each drafter is not known to the targets; it is read from the tail of
``runs/<name>/metrics.jsonl`` when the run directory is known (from
``--config`` or ``--run-dir``) and shown as ``-`` otherwise. Drafters named in
the config's ``[drafters.<id>]`` tables but registered nowhere are listed as
``not connected``, as is a rank registered at some replicas but missing from
another that answered.

``--config`` defaults to ``$DFLASH_CONFIG`` and ``$DFLASH_RUN_NAME`` overrides
``run.name``, so sourcing the systemd environment file is enough.

Exit status: 0 every replica answered, 1 one or more did not (those that did
are still shown), 2 bad config or arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
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


@dataclass
class ReplicaAnswer:
    """What one target replica said: its STATUS, or why there is none (``error``)."""

    replica: int
    address: str
    status: P.Status | None = None
    error: str = ""


def _no_answer(address: str, timeout_s: float) -> str:
    return (f"no answer from the target at {address} within {timeout_s:g}s: it is not running, "
            "still starting up (loading the model), or listening elsewhere (check control.address)")


def _read_answer(address: str, frame: bytes) -> P.Status:
    try:
        msg = P.decode(frame)
    except P.ProtocolError as exc:
        raise NoAnswer(f"the peer at {address} sent an unreadable answer ({exc.message}); is it a dflash target?") from None
    if isinstance(msg, P.Error):
        raise NoAnswer(f"the target at {address} refused the status request: {msg.message}")
    if not isinstance(msg, P.Status):
        raise NoAnswer(f"the target at {address} answered {msg.TYPE} instead of STATUS")
    return msg


def query(address: str, timeout_s: float, sockets: SocketFactory, credential: str = "") -> P.Status:
    """One STATUS_REQUEST round trip; raises :class:`NoAnswer` after ``timeout_s``.

    ``sockets`` carries the job's security setting: with CURVE configured the
    target only answers clients holding the client key. ``credential`` is the
    run's status key (common.auth), without which the target refuses.
    """
    (answer,) = query_all([address], timeout_s, sockets, credential)
    if answer.status is None:
        raise NoAnswer(answer.error)
    return answer.status


def query_all(addresses: list[str], timeout_s: float, sockets: SocketFactory, credential: str = "") -> list[ReplicaAnswer]:
    """Ask every address at once (replica r at ``addresses[r]``) and wait up to ``timeout_s`` in all.

    Never raises for one replica: each answer holds its STATUS or the reason it has none.
    """
    answers = [ReplicaAnswer(r, a) for r, a in enumerate(addresses)]
    pending: dict[zmq.Socket, ReplicaAnswer] = {}
    poller = zmq.Poller()
    try:
        for answer in answers:
            try:
                sock = sockets.connect(zmq.DEALER, answer.address, LINGER=0)
            except zmq.ZMQError as exc:
                answer.error = f"cannot connect to {answer.address}: {exc.strerror}"
                continue
            pending[sock] = answer
            sock.send(P.StatusRequest(auth=credential).encode())
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while any(a.status is None and not a.error for a in pending.values()):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            for sock, _ in poller.poll(left_ms):
                answer = pending[sock]
                try:
                    answer.status = _read_answer(answer.address, sock.recv())
                except NoAnswer as exc:
                    answer.error = str(exc)
                poller.unregister(sock)
        for answer in pending.values():
            if answer.status is None and not answer.error:
                answer.error = _no_answer(answer.address, timeout_s)
    finally:
        for sock in pending:
            sock.close()
    return answers


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


def _target_summary(status: P.Status, bucket_lengths: list[int] | None) -> str:
    buckets = " ".join(
        f"{bucket_lengths[i] if bucket_lengths and i < len(bucket_lengths) else i}:{d}"
        for i, d in enumerate(status.bucket_depths)
    )
    return (f"up {format_duration(status.uptime_s)}, {status.tokens_per_s:.0f} tokens/s, "
            f"queue {status.queue_depth} ready batches (by bucket length {buckets or '-'})")


# The drafter first: a row starts with its id (the rows of one drafter, rank by rank, replica by replica).
COLUMNS = ["drafter", "rank", "replica", "gen", "state", "step", "ckpt", "heartbeat", "in flight", "last loss", "pid"]
_NUMERIC = {1, 2, 3, 5, 6, 7, 8, 9, 10}


def format_status(
    answers: list[ReplicaAnswer] | P.Status,
    *,
    address: str | None = None,
    run_name: str | None = None,
    bucket_lengths: list[int] | None = None,
    losses: dict[str, tuple[float, int]] | None = None,
    expected_ids: list[str] | None = None,
) -> str:
    """The status table as text (a pure function of its inputs, so tests need no target).

    ``answers`` holds one entry per replica; a bare ``Status`` (with ``address``)
    stands for a job of one replica.
    """
    if isinstance(answers, P.Status):
        answers = [ReplicaAnswer(0, address or DEFAULT_ADDRESS, answers)]
    losses = losses or {}
    up = [a for a in answers if a.status is not None]
    if len(answers) == 1:
        (only,) = answers
        lines = [f"dflash status  target {only.address}" + (f"  run {run_name}" if run_name else "")]
        lines.append(f"target: {_target_summary(only.status, bucket_lengths)}" if only.status is not None
                     else f"target: {only.error}")
    else:
        total = sum(a.status.tokens_per_s for a in up)
        lines = ["dflash status" + (f"  run {run_name}" if run_name else "")
                 + f"  {len(answers)} target replicas, {len(up)} answering, {total:.0f} tokens/s in all"]
        for a in answers:
            what = _target_summary(a.status, bucket_lengths) if a.status is not None else f"NOT ANSWERING: {a.error}"
            lines.append(f"target {a.replica} ({a.address}): {what}")
    lines.append("")

    def loss_cell(drafter_id: str) -> str:
        loss = losses.get(drafter_id)
        return f"{loss[0]:.4f} @{loss[1]}" if loss else "-"

    rows: list[tuple[tuple, list[str]]] = []
    seen_ids: set[str] = set()
    ranks: dict[tuple[str, int], set[int]] = {}  # (id, rank) -> replicas holding it
    for a in up:
        for d in a.status.drafters:
            seen_ids.add(d.id)
            ranks.setdefault((d.id, d.rank), set()).add(a.replica)
            rows.append(((d.id, d.rank, a.replica), [
                d.id, str(d.rank), str(a.replica), str(d.generation), d.state, str(d.step), str(d.checkpoint_step),
                f"{d.heartbeat_age_s:.1f}s ago", str(d.inflight), loss_cell(d.id), str(d.pid),
            ]))
    # A rank every other replica knows but this one does not: its link to this replica is down.
    for (drafter_id, rank), held in ranks.items():
        for a in up:
            if a.replica not in held:
                rows.append(((drafter_id, rank, a.replica), [drafter_id, str(rank), str(a.replica), "-", "not connected",
                                                             "-", "-", "-", "-", loss_cell(drafter_id), "-"]))
    for drafter_id in expected_ids or []:
        if drafter_id not in seen_ids:
            rows.append(((drafter_id, -1, -1), [drafter_id, "-", "-", "-", "not connected", "-", "-", "-", "-",
                                                loss_cell(drafter_id), "-"]))
    if not rows:
        lines.append("no drafter registered")
        return "\n".join(lines)
    cells = [r for _, r in sorted(rows, key=lambda item: item[0])]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(COLUMNS)]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in _NUMERIC else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    lines.append(fmt(COLUMNS))
    lines += [fmt(r) for r in cells]
    return "\n".join(lines)


def status_json(answers: list[ReplicaAnswer], losses: dict[str, tuple[float, int]]) -> dict:
    """``--json``: every replica's answer (``targets``), every registration with its replica (``drafters``)."""
    targets, drafters = [], []
    for a in answers:
        entry = {"replica": a.replica, "address": a.address, "answered": a.status is not None, "error": a.error}
        if a.status is not None:
            body = asdict(a.status)
            drafters += [{**d, "replica": a.replica} for d in body.pop("drafters")]
            entry.update(body)
        targets.append(entry)
    return {"targets": targets, "drafters": drafters,
            "last_loss": {k: {Drafter.LOSS: v[0], "step": v[1]} for k, v in losses.items()}}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-status", description=cli.help_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_config_args(p, config_help="TOML job config; gives the replicas' addresses, the run directory and drafter ids",
                        set_example="run.name=exp2")
    p.add_argument("--address", action="append", default=[],
                   help="control address of a target replica; repeat it for each replica, in replica order "
                        f"(default: the config's replica addresses, else {DEFAULT_ADDRESS})")
    p.add_argument("--run-dir", type=Path, help="run directory whose metrics.jsonl gives the last losses and whose "
                   "auth/status.key proves the right to ask (default: from the config)")
    p.add_argument("--status-key", type=Path, help="file holding the run's status key (default: <run dir>/auth/status.key)")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh in place every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--timeout-s", type=float, default=2.0, help="how long to wait for the replicas' answers")
    p.add_argument("--json", action="store_true", help="print every replica's STATUS (plus last losses) as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    addresses, run_dir, run_name, bucket_lengths, expected_ids = list(args.address), args.run_dir, None, None, []
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
            addresses = addresses or [cfg.replica_address(r) for r in range(cfg.target.replicas)]
        except (ConfigError, OSError, ValueError) as exc:
            print(f"dflash-status: config error: {exc}", file=sys.stderr)
            return 2
        run_dir = run_dir or cfg.run.path
        run_name = cfg.run.name
        bucket_lengths = list(cfg.data.bucket_lengths)
        curve_dir, curve_client = cfg.security.curve_dir, cfg.security.curve_client
    addresses = addresses or [DEFAULT_ADDRESS]
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
            text, code, to_stderr = _one_frame(args, sockets, credential, addresses, run_dir, run_name,
                                               bucket_lengths, expected_ids)
            if args.watch is None:
                print(text, file=sys.stderr if to_stderr else sys.stdout)
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


def _one_frame(args, sockets, credential, addresses, run_dir, run_name, bucket_lengths,
               expected_ids) -> tuple[str, int, bool]:
    """The text of one refresh, the exit status, and whether the text goes to stderr (nothing answered)."""
    answers = query_all(addresses, args.timeout_s, sockets, credential)
    code = 0 if all(a.status is not None for a in answers) else 1
    if not any(a.status is not None for a in answers):
        # Nothing to show: one line per replica, as one error.
        if len(answers) == 1:
            return f"dflash-status: {answers[0].error}", 1, True
        return "\n".join(f"dflash-status: target replica {a.replica}: {a.error}" for a in answers), 1, True
    ids = sorted({d.id for a in answers if a.status is not None for d in a.status.drafters} | set(expected_ids))
    losses = last_losses(run_dir / "metrics.jsonl", ids) if run_dir is not None else {}
    if args.json:
        return json.dumps(status_json(answers, losses), indent=1, sort_keys=True), code, False
    return format_status(answers, run_name=run_name, bucket_lengths=bucket_lengths, losses=losses,
                         expected_ids=expected_ids), code, False


if __name__ == "__main__":
    sys.exit(main())
