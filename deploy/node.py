"""The processes of one node of a job: resolved from its config, checked, and their command lines.

    python -m deploy.node --config configs/node-8gpu.toml --check           # every process; exit 2 if it cannot work
    python -m deploy.node --config configs/node-8gpu.toml --print-commands  # the command line of each process
    python -m deploy.node --config FILE --shell          # TARGET_REPLICAS, NODE_REPLICAS, DRAFTER_NPROCS, NODE_SIDECAR
    python -m deploy.node --config FILE --run-group g0   # drafter g0's torchrun (deploy/run_process.sh drafter-group)

A node runs the metrics sidecar, its target replicas (replica r of
``target.replicas`` on ``target.devices[r]``, control address
``Config.replica_address(r)``, data-plane store on ``control.store_port + r *
control.replica_port_step``) and one drafter per ``[drafters.<id>]`` table. A
drafter whose table gives ``drafter.devices`` more than one entry is trained by
that many ranks under torchrun (``--nproc-per-node len(drafter.devices)``, rank
k on ``drafter.devices[k]``); any other runs as one ``dflash-drafter`` process.
``DFLASH_DRAFTER_<ID>_NPROC`` overrides the number of ranks (ranks then take
``cuda:<k>`` when ``drafter.device = "cuda"``).

The check refuses a layout that cannot work: two ranks of one drafter on one
GPU (DDP over NCCL), a target replica and a drafter rank on one GPU when their
pair would use NCCL, NCCL on a CPU device, a ``drafter.devices`` list shorter
than the ranks, two processes binding the same address (control addresses,
data-plane stores, the sidecar),
``shm`` across hosts, non-loopback addresses without CURVE keys, a device
``CUDA_VISIBLE_DEVICES`` hides. GPUs are compared as the physical GPUs each
process sees: the ``CUDA_VISIBLE_DEVICES`` deploy/run_process.sh gives it
(``DFLASH_TARGET_CUDA_VISIBLE_DEVICES`` with one replica,
``DFLASH_TARGET_<R>_CUDA_VISIBLE_DEVICES`` per replica,
``DFLASH_DRAFTER_<ID>_CUDA_VISIBLE_DEVICES``; ``--env-file`` reads them from
the systemd environment file), else the inherited one, else all GPUs.

With replicas on several hosts (``control.replica_addresses``) a node is one
host: ``--host HOST`` (or ``$DFLASH_NODE_HOST``) picks its replicas, and
``--drafters IDS`` (or ``$DFLASH_NODE_DRAFTERS``; default all, ``none`` for
none) the drafters it runs.

``--run-group ID`` runs the torchrun of drafter ID in the foreground and
stays its parent: SIGTERM/SIGINT/SIGHUP are passed to the ranks themselves
(each checkpoints and exits 0, so torchrun ends with 0; torchrun signalled
itself exits 1), ranks still running ``drafter.stop_timeout_s + 10`` s later
are killed, and torchrun gets SIGTERM should this process die.

Exit status: 0 fine, 2 bad config or a layout that cannot work; ``--run-group``
exits with torchrun's status.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # also run as a script: python deploy/node.py
    sys.path.insert(0, str(ROOT))

from common.config import Config, ConfigError, drafter_ids_in, load_config  # noqa: E402
from common.sockets import is_loopback  # noqa: E402

PROG = "deploy.node"
DEFAULT_MAX_RESTARTS = 3
STOP_GRACE_S = 10.0  # beyond drafter.stop_timeout_s before --run-group kills the ranks
_ID = re.compile(r"[A-Za-z0-9_-]+")  # the launchers' rule (tools/runinfo.py): a tmux window, a unit instance
_WILDCARD = {"*", "0.0.0.0", "::", ""}
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def env_key(drafter_id: str) -> str:
    """A drafter id as it appears in environment variable names (deploy/run_process.sh)."""
    return re.sub(r"[^A-Za-z0-9]", "_", drafter_id)


# ---------------------------------------------------------------------------
# The layout


@dataclass
class Target:
    replica: int
    replicas: int
    device: str
    address: str
    store_host: str
    store_port: int
    visible: str  # CUDA_VISIBLE_DEVICES it runs with; "" = every GPU
    gpu: str | None  # the physical GPU it uses; None on the CPU

    @property
    def name(self) -> str:
        return "target" if self.replicas == 1 else f"target-{self.replica}"

    @property
    def host(self) -> str:
        return endpoint(self.address)[0]


@dataclass
class Drafter:
    id: str
    nproc: int
    nproc_from: str  # where nproc comes from, for messages
    devices: list[str]  # per local rank
    gpus: list[str | None]
    visible: str
    stop_timeout_s: float
    listed_devices: list[str] = field(default_factory=list)  # drafter.devices of its table

    @property
    def torchrun(self) -> bool:
        return self.nproc > 1

    @property
    def log_names(self) -> list[str]:
        if not self.torchrun:
            return [f"drafter-{self.id}"]
        return [f"drafter-{self.id}.{k}" for k in range(self.nproc)]


@dataclass
class Node:
    config: str | None
    overrides: list[str]  # every override applied (environment, then --set)
    forwarded: list[str]  # those given with --set: repeated on the command lines
    cfg: Config
    host: str | None
    targets: list[Target]
    drafters: list[Drafter]
    sidecar_here: bool
    max_restarts: int
    problems: list[tuple[str, str]] = field(default_factory=list)  # (process or "", message)
    notes: list[str] = field(default_factory=list)

    def problems_of(self, process: str) -> list[str]:
        return [m for p, m in self.problems if p == process]


def endpoint(address: str) -> tuple[str, str]:
    """``(host, port)`` of a tcp:// address, ``("ipc", path)`` of an ipc:// one; hosts lower-cased."""
    if address.startswith("ipc://"):
        return "ipc", address[len("ipc://"):]
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    host = host.strip("[]").lower()
    return ("127.0.0.1" if host == "localhost" else host), port


def is_local(host: str) -> bool:
    """Loopback, wildcard or ipc: on whichever host the process runs."""
    return host in _LOOPBACK or host in _WILDCARD or host == "ipc"


def physical_gpu(device: str, visible: str) -> tuple[str | None, str]:
    """The GPU a ``cuda[:N]`` device is with ``CUDA_VISIBLE_DEVICES=visible``; ``(None, "")`` for the CPU,
    ``(None, message)`` when it cannot be resolved."""
    if not device.startswith("cuda"):
        return None, ""
    _, _, index_text = device.partition(":")
    if index_text and not index_text.isdigit():
        return None, f"device {device!r} is not cuda or cuda:N"
    index = int(index_text or 0)
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index >= len(ids):
            return None, f"{device} does not exist with CUDA_VISIBLE_DEVICES={visible} ({len(ids)} GPU(s) visible)"
        return ids[index], ""
    return str(index), ""


def _gpu_label(device: str, gpu: str | None, visible: str) -> str:
    if gpu is None:
        return device
    return f"{device} (GPU {gpu})" if visible else device


def read_env_file(path: str | Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a systemd environment file (comments and blank lines skipped, quotes removed)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def _env_int(environ: dict[str, str], key: str) -> int | None:
    text = environ.get(key, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ConfigError(f"{key}={text!r} must be a whole number")
    return int(text)


def resolve(config: str | None, overrides: list[str], *, forwarded: list[str] | None = None,
            environ: dict[str, str] | None = None, host: str | None = None, drafters: str | None = None,
            max_restarts: int | None = None) -> Node:
    """This node's processes, checked (``Node.problems``). Raises ConfigError when the job config does not load."""
    environ = dict(os.environ if environ is None else environ)
    cfg = load_config(config, overrides)
    inherited = environ.get("CUDA_VISIBLE_DEVICES", "")
    if max_restarts is None:
        max_restarts = _env_int(environ, "DFLASH_TORCHRUN_MAX_RESTARTS")
    node = Node(config, list(overrides), list(forwarded if forwarded is not None else overrides), cfg,
                endpoint(host)[0] if host and "://" in host else (host.lower() if host else None), [], [], True,
                DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts)

    # -- target replicas of this node
    replicas = cfg.target.replicas
    all_targets = []
    for r in range(replicas):
        rc = cfg.for_replica(r)
        var = "DFLASH_TARGET_CUDA_VISIBLE_DEVICES" if replicas == 1 else f"DFLASH_TARGET_{r}_CUDA_VISIBLE_DEVICES"
        visible = environ.get(var, "") or inherited
        gpu, problem = physical_gpu(rc.target.device, visible)
        t = Target(r, replicas, rc.target.device, rc.control.address, rc.control.store_host, rc.control.store_port,
                   visible, gpu)
        all_targets.append(t)
        if problem:
            node.problems.append((t.name, f"{t.name}: {problem}"))
    hosts = sorted({t.host for t in all_targets if not is_local(t.host)})
    if node.host is not None:
        node.targets = [t for t in all_targets if t.host == node.host or is_local(t.host)]
        if not node.targets:
            node.notes.append(f"no target replica listens on host {node.host} (replica hosts: {', '.join(hosts)})")
    elif len(hosts) > 1:
        node.targets = all_targets
        node.problems.append(("", f"the target replicas listen on {len(hosts)} hosts ({', '.join(hosts)}): check "
                                  "one host at a time with --host HOST (and that host's --set control.store_host=HOST)"))
    else:
        node.targets = all_targets
    node.problems = [(p, m) for p, m in node.problems if not p or p in {t.name for t in node.targets}]

    # -- drafters of this node
    ids = (drafter_ids_in(config) if config is not None else []) or [cfg.drafter.id]
    if drafters is not None and drafters.strip() != "all":
        wanted = [] if drafters.strip() in ("", "none") else [d.strip() for d in drafters.split(",") if d.strip()]
        unknown = [d for d in wanted if d not in ids]
        if unknown:
            node.problems.append(("", f"--drafters names {', '.join(unknown)}, which the config does not have "
                                      f"(its drafters: {', '.join(ids)})"))
        ids = [d for d in ids if d in wanted]
    for drafter_id in ids:
        name = f"drafter-{drafter_id}"
        if not _ID.fullmatch(drafter_id):
            node.problems.append((name, f"[drafters.{drafter_id}]: the launchers need a drafter id matching "
                                        f"{_ID.pattern} (it names a tmux window, a unit instance, a variable)"))
        try:
            dcfg = load_config(config, [f'drafter.id="{drafter_id}"', *overrides])
        except ConfigError as exc:
            node.problems.append((name, f"[drafters.{drafter_id}]: {exc}"))
            continue
        listed = list(dcfg.drafter.devices)
        nproc_var = f"DFLASH_DRAFTER_{env_key(drafter_id)}_NPROC"
        try:
            nproc_env = _env_int(environ, nproc_var)
        except ConfigError as exc:
            node.problems.append((name, str(exc)))
            nproc_env = None
        if nproc_env is not None and nproc_env >= 1:
            nproc, nproc_from = nproc_env, nproc_var
        else:
            nproc, nproc_from = max(1, len(listed)), f"len(drafter.devices) of [drafters.{drafter_id}]"
        visible = environ.get(f"DFLASH_DRAFTER_{env_key(drafter_id)}_CUDA_VISIBLE_DEVICES", "") or inherited
        d = Drafter(drafter_id, nproc, nproc_from, [], [], visible, dcfg.drafter.stop_timeout_s, listed)
        node.drafters.append(d)
        if listed and len(listed) < nproc:
            node.problems.append((name, f"drafter {drafter_id}: drafter.devices names {len(listed)} device(s) "
                                        f"({', '.join(listed)}) for {nproc} ranks ({nproc_from} = {nproc})"))
            continue
        if len(listed) > nproc:
            node.notes.append(f"drafter {drafter_id}: ranks use {nproc} of the {len(listed)} drafter.devices")
        for k in range(nproc):
            device = dcfg.for_local_rank(k).drafter.device
            gpu, problem = physical_gpu(device, visible)
            if problem:
                node.problems.append((name, f"drafter {drafter_id} rank {k}: {problem}"))
            d.devices.append(device)
            d.gpus.append(gpu)

    metrics_host = endpoint(cfg.metrics.address)[0]
    node.sidecar_here = is_local(metrics_host) or node.host is None or metrics_host == node.host
    _check(node, cfg, hosts)
    return node


def _uses_nccl(kind: str, *devices: str) -> bool:
    return kind == "nccl" or (kind == "auto" and all(d.startswith("cuda") for d in devices))


def _check(node: Node, cfg: Config, hosts: list[str]) -> None:
    kind = cfg.transport.kind
    problems, notes = node.problems, node.notes

    # NCCL needs CUDA on both sides of every pair.
    if kind == "nccl":
        for t in node.targets:
            if not t.device.startswith("cuda"):
                problems.append((t.name, f"{t.name}: transport.kind = 'nccl' needs a CUDA device, it is on {t.device}"))
        for d in node.drafters:
            for k, device in enumerate(d.devices):
                if not device.startswith("cuda"):
                    problems.append((f"drafter-{d.id}", f"drafter {d.id} rank {k}: transport.kind = 'nccl' needs a "
                                                        f"CUDA device, it is on {device}"))

    # GPUs: ranks of one drafter (DDP over NCCL), target/drafter pairs over NCCL.
    for d in node.drafters:
        seen: dict[str, int] = {}
        for k, gpu in enumerate(d.gpus):
            if gpu is None:
                continue
            if gpu in seen:
                problems.append((f"drafter-{d.id}", f"drafter {d.id}: ranks {seen[gpu]} and {k} are both on "
                                                    f"{_gpu_label(d.devices[k], gpu, d.visible)}; its ranks average "
                                                    "gradients over NCCL, which needs one GPU per rank"))
            else:
                seen[gpu] = k
    for t in node.targets:
        for d in node.drafters:
            for k, (device, gpu) in enumerate(zip(d.devices, d.gpus)):
                if gpu is None or gpu != t.gpu:
                    continue
                where = _gpu_label(t.device, t.gpu, t.visible or d.visible)
                if _uses_nccl(kind, t.device, device):
                    problems.append((t.name, f"{t.name} and drafter {d.id} rank {k} are both on {where}: their "
                                             "data-plane pair is NCCL, which needs two GPUs (move one, or use "
                                             "transport.kind = 'shm')"))
                else:
                    notes.append(f"{t.name} and drafter {d.id} rank {k} share {where}")
    by_gpu: dict[str, list[str]] = {}
    for t in node.targets:
        if t.gpu is not None:
            by_gpu.setdefault(t.gpu, []).append(t.name)
    for d in node.drafters:
        for gpu in sorted({g for g in d.gpus if g is not None}):
            by_gpu.setdefault(gpu, []).append(f"drafter {d.id}")
    for gpu, users in sorted(by_gpu.items()):
        targets = [u for u in users if u.startswith("target")]
        drafter_users = [u for u in users if u.startswith("drafter")]
        if len(targets) > 1:
            notes.append(f"GPU {gpu} holds {len(targets)} target replicas ({', '.join(targets)}): each loads the model")
        if len(drafter_users) > 1:
            notes.append(f"GPU {gpu} is shared by {', '.join(drafter_users)}")

    # Ports: everything this node binds.
    bound: list[tuple[str, str, str, bool]] = []  # (what, host, port, listens on every interface)
    for t in node.targets:
        h, p = endpoint(t.address)
        bound.append((f"{t.name} control {t.address}", h, p, h in _WILDCARD))
        sh = endpoint(f"tcp://{t.store_host}:{t.store_port}")[0]  # the store listens on store_host only
        bound.append((f"{t.name} data-plane store {t.store_host}:{t.store_port}", sh, str(t.store_port), sh in _WILDCARD))
    if node.sidecar_here:
        h, p = endpoint(cfg.metrics.address)
        bound.append((f"metrics sidecar {cfg.metrics.address}", h, p, h in _WILDCARD))
    for i, (what_a, host_a, port_a, any_a) in enumerate(bound):
        for what_b, host_b, port_b, any_b in bound[:i]:
            if port_a != port_b or (host_a == "ipc") != (host_b == "ipc"):
                continue
            if host_a == host_b or any_a or any_b:
                problems.append((what_a.split()[0] if what_a.startswith("target") else "",
                                 f"{what_b} and {what_a} would bind the same "
                                 f"{'path' if host_a == 'ipc' else 'port'}: change control.replica_port_step, "
                                 "control.store_port, control.replica_addresses or metrics.address"))

    # Across hosts: shm cannot, loopback stores cannot be reached, non-loopback binds need CURVE.
    multi_host = len(hosts) > 1 or (node.host is not None and not is_local(node.host))
    if kind == "shm" and multi_host:
        problems.append(("", "transport.kind = 'shm' works within one host only; the replicas span hosts "
                             f"({', '.join(hosts) or node.host}): use nccl or gloo"))
    for t in node.targets:
        if not is_local(t.host) and t.store_host in _LOOPBACK | {"localhost"}:
            message = (f"{t.name} listens on {t.host} but announces its data-plane store at {t.store_host} "
                       f"(control.store_host): drafters on other hosts cannot form pairs; "
                       f"--set control.store_host={t.host}")
            if multi_host:
                problems.append((t.name, message))
            else:
                notes.append(message)
    if not cfg.security.curve_dir:
        # What the processes themselves refuse to bind without keys (common.sockets.check_bind).
        exposed = [t.address for t in node.targets if not is_loopback(t.address)]
        exposed += sorted({f"the data-plane store at {t.store_host}" for t in node.targets
                           if not is_loopback(f"tcp://{t.store_host}:{t.store_port}")})
        if node.sidecar_here and not is_loopback(cfg.metrics.address):
            exposed.append(cfg.metrics.address)
        if exposed:
            problems.append(("", f"{', '.join(exposed)}: binding beyond loopback needs security.curve_dir "
                                 "(python -m common.sockets keys DIR; the same keys on every host)"))


# ---------------------------------------------------------------------------
# Command lines


def _config_args(node: Node) -> list[str]:
    args = ["--config", node.config] if node.config is not None else []
    for o in node.forwarded:
        args += ["--set", o]
    return args


def target_command(node: Node, t: Target) -> list[str]:
    return ["dflash-target", *_config_args(node), *(["--replica", str(t.replica)] if t.replicas > 1 else [])]


def metrics_command(node: Node) -> list[str]:
    return ["dflash-metrics", *_config_args(node)]


def torchrun_args(node: Node, d: Drafter) -> list[str]:
    """torchrun's arguments (after ``torchrun``) for drafter ``d``."""
    return ["--standalone", "--nproc-per-node", str(d.nproc), "--max-restarts", str(node.max_restarts),
            "-m", "drafter_worker", *_config_args(node), "--group", d.id]


def drafter_command(node: Node, d: Drafter) -> list[str]:
    if d.torchrun:
        return ["torchrun", *torchrun_args(node, d)]
    return ["dflash-drafter", *_config_args(node), "--id", d.id]


def _with_env(argv: list[str], visible: str) -> str:
    return (f"CUDA_VISIBLE_DEVICES={shlex.quote(visible)} " if visible else "") + shlex.join(argv)


def commands(node: Node) -> list[tuple[str, str]]:
    """``(process name, shell command line)`` of every process of the node, in start order."""
    out = []
    if node.sidecar_here:
        out.append(("metrics", shlex.join(metrics_command(node))))
    out += [(t.name, _with_env(target_command(node, t), t.visible)) for t in node.targets]
    out += [(f"drafter-{d.id}", _with_env(drafter_command(node, d), d.visible)) for d in node.drafters]
    return out


def describe(node: Node) -> str:
    """The node's processes, one block each, as --check prints them."""
    cfg = node.cfg
    lines = [f"node of job {cfg.run.name}" + (f" ({node.config})" if node.config else "")
             + (f", host {node.host}" if node.host else "") + f": run directory {cfg.run.path}, "
             f"transport {cfg.transport.kind}, {cfg.target.replicas} target replica(s) in the job"]
    if node.sidecar_here:
        lines.append(f"  metrics     sidecar at {cfg.metrics.address}, log logs/metrics.log")
    else:
        lines.append(f"  metrics     elsewhere ({cfg.metrics.address})")
    for t in node.targets:
        lines.append(f"  {t.name:<10}  replica {t.replica} of {t.replicas} on {_gpu_label(t.device, t.gpu, t.visible)}, "
                     f"control {t.address}, store {t.store_host}:{t.store_port}, log logs/{t.name}.log")
    for d in node.drafters:
        if d.torchrun:
            ranks = ", ".join(f"rank {k} {_gpu_label(dev, g, d.visible)}" for k, (dev, g) in enumerate(zip(d.devices, d.gpus)))
            lines.append(f"  {'drafter-' + d.id:<10}  {d.nproc} ranks under torchrun ({d.nproc_from}): {ranks or '-'}; "
                         f"logs logs/drafter-{d.id}.<rank>.log")
        else:
            where = _gpu_label(d.devices[0], d.gpus[0], d.visible) if d.devices else "-"
            lines.append(f"  {'drafter-' + d.id:<10}  one process on {where}, log logs/drafter-{d.id}.log")
        lines.append(f"              {_with_env(drafter_command(node, d), d.visible)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# --run-group: torchrun of one drafter, stopped the way the drafter expects


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _term_with_parent():
    """A preexec_fn giving the child SIGTERM when this process dies (Linux), so torchrun stops its ranks."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return preexec


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def supervise(argv: list[str], env: dict[str, str], stop_timeout_s: float, label: str) -> int:
    """Run ``argv`` (torchrun); on SIGTERM/SIGINT/SIGHUP pass SIGTERM to its children (the ranks), kill what
    is left ``stop_timeout_s + STOP_GRACE_S`` later. Returns its exit status (128 + N for signal N)."""
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        received.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    # Its own session: a Ctrl-C in the terminal reaches this process only, which stops the ranks cleanly.
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_term_with_parent())
    signalled: set[int] = set()
    stop_at: float | None = None
    killed = False
    while True:
        try:
            code = proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        if not received:
            continue
        if stop_at is None:
            stop_at = time.monotonic()
            print(f"{PROG}: {label}: {signal.Signals(received[0]).name}: stopping the ranks (SIGTERM), "
                  f"waiting up to {stop_timeout_s + STOP_GRACE_S:.0f}s", file=sys.stderr, flush=True)
        ranks = _children(proc.pid)
        if not ranks and not signalled:
            _signal(proc.pid, signal.SIGTERM)  # still in rendezvous: torchrun stops by itself
            signalled.add(proc.pid)
        for pid in ranks:
            if pid not in signalled:  # also ranks torchrun restarted meanwhile
                _signal(pid, signal.SIGTERM)
                signalled.add(pid)
        if not killed and time.monotonic() - stop_at > stop_timeout_s + STOP_GRACE_S:
            print(f"{PROG}: {label}: ranks still running {stop_timeout_s + STOP_GRACE_S:.0f}s after SIGTERM: killing "
                  "them", file=sys.stderr, flush=True)
            for pid in ranks:
                _signal(pid, signal.SIGKILL)
            _signal(proc.pid, signal.SIGKILL)
            killed = True
    code = 128 - code if code < 0 else code
    if received:
        print(f"{PROG}: {label}: torchrun exited with status {code}", file=sys.stderr, flush=True)
    return code


def run_group(node: Node, drafter_id: str, extra: list[str]) -> int:
    d = next((x for x in node.drafters if x.id == drafter_id), None)
    problems = node.problems_of(f"drafter-{drafter_id}")
    if d is None and not problems:
        problems = [m for p, m in node.problems if not p] or [f"no drafter {drafter_id} in the config"]
    if problems:
        for message in problems:
            print(f"{PROG}: {message}", file=sys.stderr)
        return 2
    args = torchrun_args(node, d) + list(extra)
    env = dict(os.environ)
    # torchrun's own grace period (when it stops the ranks itself: a failed rank, this process dying).
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(math.ceil(d.stop_timeout_s + STOP_GRACE_S)))
    ranks = ", ".join(d.devices)
    print(f"{PROG}: drafter {d.id}: {d.nproc} rank(s) on {ranks}: torchrun {shlex.join(args)}",
          file=sys.stderr, flush=True)
    return supervise([sys.executable, "-m", "torch.distributed.run", *args], env, d.stop_timeout_s,
                     f"drafter {d.id}")


# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.environ.get("DFLASH_CONFIG") or None, metavar="FILE",
                   help="TOML job config (default: $DFLASH_CONFIG)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable); repeated on every command line")
    p.add_argument("--host", default=os.environ.get("DFLASH_NODE_HOST") or None,
                   help="this node's host when the replicas span hosts (default: $DFLASH_NODE_HOST)")
    p.add_argument("--drafters", default=os.environ.get("DFLASH_NODE_DRAFTERS") or None, metavar="IDS",
                   help="comma-separated drafter ids this node runs; 'none' for none (default: "
                        "$DFLASH_NODE_DRAFTERS, else all)")
    p.add_argument("--env-file", help="read the DFLASH_*_CUDA_VISIBLE_DEVICES and DFLASH_DRAFTER_<ID>_NPROC "
                                      "variables from this environment file (e.g. /etc/dflash/dflash.env)")
    p.add_argument("--max-restarts", type=int, default=None,
                   help=f"torchrun --max-restarts (default: $DFLASH_TORCHRUN_MAX_RESTARTS, else {DEFAULT_MAX_RESTARTS})")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", action="store_true", help="list every process of the node; exit 2 if it cannot work")
    what.add_argument("--print-commands", action="store_true", help="print the command line of every process")
    what.add_argument("--shell", action="store_true", help="shell assignments for deploy/tmux/launch.sh")
    what.add_argument("--run-group", metavar="ID", help="run drafter ID's torchrun in the foreground")
    p.add_argument("--quiet", action="store_true", help="--check: print only the problems")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not args.run_group:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    environ = dict(os.environ)
    try:
        if args.env_file:
            environ.update(read_env_file(args.env_file))
        env_name = os.environ.get("DFLASH_RUN_NAME", "")
        from common.cli import toml_value

        overrides = [*([f"run.name={toml_value(env_name)}"] if env_name else []), *args.overrides]
        # A group runs wherever its unit or window is started: --drafters does not apply to it.
        node = resolve(args.config, overrides, forwarded=args.overrides, environ=environ, host=args.host,
                       drafters=args.run_group or args.drafters, max_restarts=args.max_restarts)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"{PROG}: config error: {exc}", file=sys.stderr)
        return 2

    if args.run_group:
        return run_group(node, args.run_group, extra)
    if args.shell:
        info = {
            "TARGET_REPLICAS": str(node.cfg.target.replicas),
            "NODE_REPLICAS": " ".join(str(t.replica) for t in node.targets),
            "DRAFTER_NPROCS": " ".join(f"{d.id}:{d.nproc}" for d in node.drafters),
            "NODE_SIDECAR": "1" if node.sidecar_here else "0",
        }
        for key, value in info.items():
            print(f"{key}={shlex.quote(value)}")
        return 0
    if args.print_commands:
        for _, line in commands(node):
            print(line)
        return 0 if not node.problems else _report_problems(node)
    if not args.quiet:
        print(describe(node))
        for note in node.notes:
            print(f"note: {note}")
    if node.problems:
        return _report_problems(node)
    if not args.quiet:
        gpus = {t.gpu for t in node.targets if t.gpu is not None} | {g for d in node.drafters for g in d.gpus if g is not None}
        ranks = sum(d.nproc for d in node.drafters)
        print(f"layout ok: {len(node.targets)} target replica(s), {len(node.drafters)} drafter(s) "
              f"({ranks} rank(s)), {len(gpus)} GPU(s) in use")
    return 0


def _report_problems(node: Node) -> int:
    for _, message in node.problems:
        print(f"{PROG}: problem: {message}", file=sys.stderr)
    print(f"{PROG}: this layout cannot work ({len(node.problems)} problem(s))", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
