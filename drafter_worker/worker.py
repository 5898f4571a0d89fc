"""The drafter worker: one rank of a drafter; registers with every target replica, trains, checkpoints.

One control thread runs everything except the data-plane receives, which a
:class:`~drafter_worker.data_plane.Receiver` thread per target replica waits
on, so receiving the next batch overlaps the training step on the current one
(credits >= 2). The rank keeps one :class:`~drafter_worker.replica_link.ReplicaLink`
per target replica (``target.replicas``); each registers, fails and retries on
its own, so a dead replica stalls only its share of the batches, and the worker
never exits because of a target.

Training goes in rounds (:mod:`drafter_worker.rank_group`): before each batch
every rank of the drafter says what it brings; each batch is trained once,
ranks without one take a zero-gradient step, and every rank records the same
coverage. A drafter of one process (no torchrun) has rounds of one.

The transport is behind :mod:`drafter_worker.data_plane` (attach, receive,
abort/close); nothing here branches on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace

import torch
import zmq

from common import protocol as P
from common.auth import hello_proof, load_or_create_control_key
from common.config import Config
from common.devices import head_dtype, use_device
from common.durable_io import replace_durably
from common.metric_names import Drafter, drafter_source
from common.metrics_client import MetricsPusher
from common.packing import BatchLayout, dtype_from_name
from common.sockets import SocketFactory
from common.streams import record_current, wait_current
from common.transport import TransportError
from drafter_worker import model_setup
from drafter_worker.checkpoint import CheckpointStore, Coverage, Ledger, TrainerState, ledger_name, pack_rng
from drafter_worker.connection import Connection, FatalError, TargetUnavailable, handshake_reply
from drafter_worker.data_plane import Receiver, attach, gpu_for_hello
from drafter_worker.model.dflash_model import init_feature_scale, init_logit_scale
from drafter_worker.rank_group import (
    BATCH, EXHAUSTED, STOPPING, Entry, RankGroup, RunIdentity, SoloGroup, make_group, trained_in_round,
)
from drafter_worker.replica_link import HELLO, LIVE, ReplicaLink
from drafter_worker.trainer import MAX_NONFINITE_STREAK, NONFINITE_STREAK, DrafterTrainer, make_optimizer, summarize

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """Training cannot go on without losing or corrupting work; the last good checkpoint is kept (exit code 3)."""


class NonFiniteTraining(TrainingStopped):
    """Training produced nothing but non-finite losses or gradients for too long."""


# Checkpoint saves that may fail in a row (full disk, I/O error) before the worker stops.
MAX_SAVE_FAILURES = 3


class CheckpointSaveFailed(TrainingStopped):
    """MAX_SAVE_FAILURES checkpoint saves in a row failed."""


def _heartbeating(work, heartbeat, every_s: float):
    """``work()`` on a thread of its own while this thread calls ``heartbeat()`` every ``every_s``.

    The control sockets stay on this thread (ZeroMQ sockets are not thread-safe);
    ``work``'s result or exception comes back here.
    """
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # re-raised on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="checkpoint-save")
    thread.start()
    while thread.is_alive():
        thread.join(every_s)
        if thread.is_alive():
            heartbeat()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def weights_digest(model: torch.nn.Module) -> str:
    """A short hash of every parameter's bytes (identical weights, identical digest)."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _crossed(before: int, after: int, every: int) -> bool:
    """A multiple of ``every`` lies in (before, after]: a batch of several steps passed a period boundary."""
    return after // every > before // every


@dataclass
class _Window:
    """Host-side values of the current metrics window."""

    start: float = field(default_factory=time.monotonic)
    tokens: int = 0
    samples: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    steps: int = 0


@dataclass
class _Received:
    """A received batch this rank brings to the next round."""

    link: ReplicaLink
    session: int  # the link's registration it came from: its ACK goes nowhere else
    meta: P.Batch
    buf: torch.Tensor
    ready_event: object


class DrafterWorker:
    def __init__(self, cfg: Config, identity: RunIdentity | None = None):
        self.identity = identity or RunIdentity.from_env()
        self.rank, self.world_size = self.identity.rank, self.identity.world_size
        self.cfg = cfg
        self.dcfg = cfg.drafter
        self.device = torch.device(self.dcfg.device)
        self._default_threads = torch.get_num_threads()  # what drafter.threads = 0 means (_set_threads)
        self.transport = cfg.transport.resolve(self.dcfg.device)
        self.run_dir = cfg.run.path
        self.replicas = cfg.target.replicas
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sockets = SocketFactory(self._ctx, cfg.security.curve_dir, cfg.security.curve_client)
        self._metrics = MetricsPusher(cfg.metrics.address, drafter_source(self.dcfg.id, self.rank, self.world_size),
                                      sockets=self._sockets)
        # Rank 0 writes the drafter's checkpoints; every rank reads them.
        self.checkpoints = CheckpointStore(self.run_dir, self.dcfg.id, self.dcfg.keep_checkpoints,
                                           writer=self.rank == 0)
        self.ledger = Ledger(self.run_dir, ledger_name(self.dcfg.id, self.rank, self.world_size))  # cuts a torn line
        self._save_failures = 0  # checkpoint saves failed in a row
        self.trainer: DrafterTrainer | None = None
        self.state: TrainerState | None = None
        self._resume_path = self.checkpoints.latest()
        if self._resume_path is not None:
            self.state = self.checkpoints.read_state(self._resume_path)
            logger.info("[resume] drafter %s: checkpoint %s (step %d, training clock %.3f s)", self.dcfg.id,
                        self._resume_path, self.state.step, self.state.train_seconds)
        self.ledger.resumed(self.state.step if self.state else 0)
        self._checkpoint_step = self.state.step if self.state else 0
        self.group: SoloGroup | RankGroup = SoloGroup()  # the torchrun group is joined in run()
        self.generation = 0
        self._save_error = ""  # why rank 0's last save failed
        self._topology = self.state.topology_id if self.state else ""
        self._embed: torch.Tensor | None = None
        self._head: torch.Tensor | None = None
        self._zero_batch: tuple | None = None  # views of an all-padding batch, for zero-gradient steps
        self._fresh_model = False  # built this run (not resumed): its logit scale is set once the LM head arrives
        self._scale_features = False  # a fresh model's fc is scaled on its first batch (drafter.feature_scale_init)
        self._fc_from_target = False  # drafter.init_target_layers set fc to pass a captured layer through
        self._buffers: dict[int, list[tuple[torch.Tensor, object]]] = {}  # free receive buffers per bucket
        self._layouts: dict[int, BatchLayout] = {}
        self._pending: _Received | None = None
        self._links: list[ReplicaLink] = []
        self._next_link = 0  # the replica whose received batches are taken first next time
        self._wrapped = False  # the model is wrapped for the ranks' gradient all-reduce (at the first round)
        self._idle_since = time.monotonic()
        self._window = _Window()
        self._window_host: tuple[_Window, int, float] | None = None
        self._first_step_at: float | None = None
        self._clock_origin: float | None = None  # monotonic time where the training clock reads 0 (first round)
        self.outcome = "running"
        self.threads_left: list[str] = []

    @property
    def stop_event(self) -> threading.Event:
        return self._stop

    def request_stop(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- outer loop
    def run(self) -> str:
        """Train until max_steps, the end of the data, or a stop request; returns why it ended."""
        use_device(self.device)  # before any CUDA work of this process (the current device is per thread)
        if self.state is not None and len(self.state.coverage) != self.replicas:
            raise FatalError(
                f"checkpoint {self._resume_path} was trained with {len(self.state.coverage)} target replicas, the "
                f"config has target.replicas = {self.replicas}: its coverage would name other batches; go back to "
                f"{len(self.state.coverage)} replicas or start a new run (another run.name)")
        if self.world_size > 1:
            self.group = make_group(self.identity, self.device, self.cfg.transport.timeout_s)
        self.generation = self._next_generation()
        links = self._links = [
            ReplicaLink(r, self.cfg.replica_address(r), name=f"{self.dcfg.id}.{self.rank}", sockets=self._sockets,
                        handshake_timeout_s=self.cfg.control.handshake_timeout_s,
                        backoff_max_s=self.cfg.control.reconnect_backoff_max_s)
            for r in range(self.replicas)
        ]
        try:
            self.outcome = self._train(links)
            if self.trainer is not None and self.trainer.step > self._checkpoint_step:
                self._checkpoint(links)  # every rank takes part (rank 0 writes)
            if self.trainer is not None and self.world_size > 1:
                # Ranks that stepped together hold the same weights: one host read at the end shows it.
                logger.info("[group] rank %d of %d ends at step %d with weights %s", self.rank, self.world_size,
                            self.trainer.step, weights_digest(self.trainer.model))
        finally:
            join_s = min(self.cfg.transport.timeout_s, 0.3 * self.dcfg.stop_timeout_s)
            with contextlib.ExitStack() as teardown:  # every link and the group closed, even if one fails
                teardown.callback(self.group.close)
                for link in reversed(links):  # callbacks run last-in first-out: links in order, then the group
                    teardown.callback(lambda link=link: self.threads_left.extend(link.close(self.outcome, join_s)))
        return self.outcome

    def _next_generation(self) -> int:
        """One more than the drafter's last start, agreed by all its ranks (rank 0 counts, durably)."""
        value = 0
        if self.rank == 0:
            path = self.run_dir / "checkpoints" / self.dcfg.id / "generation"
            try:
                value = int(path.read_text()) + 1
            except (FileNotFoundError, ValueError):
                value = 1
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_durably(path, str(value).encode())
        value = self.group.broadcast_int(value, pump=lambda: None)
        logger.info("[group] drafter %s rank %d of %d: generation %d", self.dcfg.id, self.rank, self.world_size, value)
        return value

    # ---------------------------------------------------------------- rounds
    def _train(self, links: list[ReplicaLink]) -> str:
        max_steps = self.dcfg.max_steps
        while True:
            self._pump(links, wait_ms=0 if self._pending else 5)
            entry = self._entry(links)
            if entry is None:
                continue
            entry = replace(entry, clock_ms=self._clock_ms())
            entries = self.group.round(entry, pump=lambda: self._pump(links, wait_ms=0))
            kinds = {e.kind for e in entries}
            if STOPPING in kinds:
                return "stopped"
            if kinds == {EXHAUSTED}:
                return "max_steps" if max_steps and self.trainer.step >= max_steps else "done"
            self._train_round(links, entries)

    def _entry(self, links: list[ReplicaLink]) -> Entry | None:
        """What this rank brings to the next round, or None when it is not ready for one yet."""
        if self._stop.is_set():
            return Entry(STOPPING)
        if self.trainer is None or self._head is None:
            return None  # no WELCOME yet (no model to step), or no frozen weights yet
        if self.dcfg.max_steps and self.trainer.step >= self.dcfg.max_steps:
            return Entry(EXHAUSTED)  # batches still in flight go back to the replicas with the BYE
        if self._pending is None:
            self._pending = self._take_received(links)
        if self._pending is not None:
            meta = self._pending.meta
            return Entry(BATCH, self._pending.link.replica, meta.batch_id, meta.num_tokens)
        if all(link.exhausted for link in links):
            return Entry(EXHAUSTED)
        return None

    def _clock_ms(self) -> int:
        """The training clock: the checkpoint's seconds, then the time since this process's first round."""
        if self._clock_origin is None:
            return int(self.state.train_seconds * 1000) if self.state else 0
        return int((time.monotonic() - self._clock_origin) * 1000)

    def _take_received(self, links: list[ReplicaLink]) -> _Received | None:
        """The next received batch of any replica (each in turn)."""
        start = self._next_link
        for k in range(len(links)):
            link = links[(start + k) % len(links)]
            item = link.ready()
            if item is None:
                continue
            if isinstance(item, TransportError):
                self._fail(link, f"data plane failed: {item}")
                continue
            self._next_link = (start + k + 1) % len(links)
            meta, buf, ready_event = item
            return _Received(link, link.session, meta, buf, ready_event)
        return None

    def _train_round(self, links: list[ReplicaLink], entries: list[Entry]) -> None:
        trainer = self.trainer
        plan = trained_in_round(entries, self.state.trained)
        if all(index is None for index in plan):
            # Nothing new on any rank (only batches the drafter has): no step at all, on every rank alike
            # (a zero-gradient AdamW step would still move the weights by its momentum).
            self._skip_round()
            return
        if not self._wrapped:
            # Collective (DDP broadcasts rank 0's weights): at the first round every rank has its model.
            trainer.forward_model = self.group.wrap(trainer.model, self.device)
            self._wrapped = True
        mine, self._pending = self._pending, None
        contribute = plan[self.rank] is not None
        # Every rank steps with rank 0's clock, so the ranks' learning rates (and weights) stay equal.
        trainer.train_seconds = entries[0].clock_ms / 1000.0
        if self._clock_origin is None:
            self._clock_origin = time.monotonic() - trainer.train_seconds
        if mine is not None and not contribute:
            logger.warning("[round] batch %d of replica %d is one the drafter has trained already (a replica "
                           "restarted, or another rank brought it): not trained again", mine.meta.batch_id,
                           mine.link.replica)
        wait_s = time.monotonic() - self._idle_since
        start = time.perf_counter()
        if contribute:
            wait_current(self.device, mine.ready_event)  # device-side: the receive's stream filled buf
            views = self._layouts[mine.meta.bucket].views(mine.buf)
            self._set_threads(mine.meta)
        else:
            views = self._zero_batch
        before = trainer.step
        first_step, lr = self._train_batch(views, contribute)
        compute_s = time.perf_counter() - start
        self._first_step_at = self._first_step_at or time.monotonic()
        self._idle_since = time.monotonic()
        if mine is not None:  # reusable once the step just issued has read it (device-side order)
            self._buffers[mine.meta.bucket].append((mine.buf, record_current(self.device)))
        self._record_round(entries, plan, mine if contribute else None, first_step)
        if contribute:
            self._account(mine.meta, lr, wait_s, compute_s, before)
        if _crossed(before, trainer.step, self.dcfg.checkpoint_every_steps):
            self._checkpoint(links)
        if mine is not None and mine.link.state == LIVE and mine.link.session == mine.session:
            mine.link.send(mine.link.conn.on_trained(mine.meta.batch_id, trainer.step, self._checkpoint_step))

    def _skip_round(self) -> None:
        """ACK this rank's batch, which the drafter has trained already, without training it."""
        mine, self._pending = self._pending, None
        if mine is None:
            return
        logger.warning("[round] batch %d of replica %d is one the drafter has trained already (a replica restarted "
                       "between a HELLO and an ACK): not trained again", mine.meta.batch_id, mine.link.replica)
        self._buffers[mine.meta.bucket].append((mine.buf, record_current(self.device)))
        if mine.link.state == LIVE and mine.link.session == mine.session:
            mine.link.send(mine.link.conn.on_trained(mine.meta.batch_id, self.trainer.step, self._checkpoint_step))

    def _record_round(self, entries: list[Entry], plan: list[int | None], mine: _Received | None,
                      first_step: int) -> None:
        """Every rank alike: the drafter's coverage and tokens; this rank's ledger line."""
        step = self.trainer.step
        for index in plan:
            if index is not None:
                e = entries[index]
                self.state.coverage[e.replica].add(e.batch_id // self.replicas)
                self.state.tokens_trained += e.tokens
        self.state.step = step
        self.state.train_seconds = self.trainer.train_seconds
        if mine is None:
            self.ledger.idle(step, first_step)
        else:
            self.ledger.trained(step, mine.meta.batch_id, mine.meta.epoch, mine.meta.sample_ids, first_step=first_step,
                                rank=self.rank if self.world_size > 1 else None)

    def _set_threads(self, meta: P.Batch) -> None:
        """drafter.threads_while_capturing while the target runs a forward pass for each batch (on a
        shared CPU it needs its cores), drafter.threads once it serves them from its feature cache."""
        if not self.dcfg.threads_while_capturing or self.device.type != "cpu":
            return
        want = (self.dcfg.threads or self._default_threads) if meta.from_cache else self.dcfg.threads_while_capturing
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
            logger.info("[threads] %d torch threads from batch %d on: the target %s", want, meta.batch_id,
                        "serves it from its feature cache" if meta.from_cache else "computes it")

    def _train_batch(self, views: tuple, contribute: bool) -> tuple[int, float]:
        """drafter.steps_per_batch optimizer steps on one batch, each on freshly sampled anchors
        (never past max_steps); returns (first step number, last learning rate)."""
        trainer = self.trainer
        features, input_ids, loss_mask, lengths = views
        if self._scale_features:
            if contribute:
                init_feature_scale(trainer.model, features, lengths)
            self.group.broadcast_parameters(trainer.model)  # rank 0's scale on every rank
            self._scale_features = False
            logger.info("[model] fc columns scaled by 1/RMS of each feature dimension of the first batch")
        first_step = trainer.step + 1
        steps = self.dcfg.steps_per_batch
        if self.dcfg.max_steps:
            steps = max(1, min(steps, self.dcfg.max_steps - trainer.step))
        for _ in range(steps):
            lr = trainer.train_step(features.float(), input_ids, loss_mask, lengths, self._embed, self._head,
                                    contribute=contribute)
        return first_step, lr

    # ---------------------------------------------------------------- control traffic
    def _pump(self, links: list[ReplicaLink], wait_ms: int) -> None:
        """Registrations, messages, heartbeats and liveness of every replica link; never blocks on training."""
        now = time.monotonic()
        for link in links:
            if link.hello_due(now) and not self._stop.is_set():
                link.send_hello(self._hello(link.replica), now)
            elif link.handshake_expired(now):
                self._fail(link, f"no WELCOME within {self.cfg.control.handshake_timeout_s:.0f}s (is it running? raise "
                                 "control.handshake_timeout_s if it is still loading)")
        poller = zmq.Poller()
        for link in links:
            if link.sock is not None:
                poller.register(link.sock, zmq.POLLIN)
        ready = dict(poller.poll(wait_ms)) if poller.sockets else {}
        if not poller.sockets and wait_ms:
            time.sleep(wait_ms / 1000)
        for link in links:
            if link.sock is not None and link.sock in ready:
                self._read(link)
        now = time.monotonic()
        step = self.trainer.step if self.trainer else 0
        for link in links:
            if link.state == LIVE:
                try:
                    link.send(link.conn.heartbeat(now, step))
                    link.conn.check_alive(now)
                except TargetUnavailable as exc:
                    self._fail(link, str(exc))

    def _read(self, link: ReplicaLink) -> None:
        try:
            while link.sock is not None and link.sock.poll(0):
                msg = self._decode(link.sock.recv())
                if link.state == HELLO:
                    welcome = handshake_reply(msg)
                    if welcome is not None:
                        self._on_welcome(link, welcome)
                    continue
                batch = link.conn.on_message(msg, time.monotonic())
                if batch is not None:
                    link.check_batch(batch)
                    self._post_receive(link, batch)
        except (TargetUnavailable, TransportError) as exc:
            self._fail(link, str(exc))

    def _fail(self, link: ReplicaLink, why: str) -> None:
        # A batch already taken for the next round stays: it is whole in our buffer and may already be
        # in a round; only its ACK is lost (the replica serves it again, and the round skips it).
        self.threads_left += link.fail(why, time.monotonic(), min(self.cfg.transport.timeout_s,
                                                                  0.3 * self.dcfg.stop_timeout_s))

    def _decode(self, frame: bytes) -> P.Message | None:
        try:
            return P.decode(frame, max_bytes=self.cfg.control.max_message_bytes)
        except P.ProtocolError as exc:
            logger.warning("ignoring a bad message from the target: %s", exc.message)
            return None

    def _hello(self, replica: int) -> P.Hello:
        coverage = self.state.coverage[replica] if self.state else Coverage()
        return P.Hello(
            drafter_id=self.dcfg.id, config_hash=self.cfg.shared_hash(), transport=self.transport, pid=os.getpid(),
            rank=self.rank, world_size=self.world_size, generation=self.generation, replica=replica,
            topology_id=self._topology, covered_watermark=coverage.watermark, covered_extra=sorted(coverage.extra),
            step=self.state.step if self.state else 0,
            # Read at every HELLO: whichever process of the run starts first creates the key.
            auth=hello_proof(load_or_create_control_key(self.run_dir), self.dcfg.id),
            gpu_uuid=gpu_for_hello(self.transport, self.device),
            # The frozen embedding and head travel once, from one replica: asked again only if that one failed.
            need_weights=self._head is None and not any(l.asked_weights and l.state == HELLO for l in self._links),
        )

    # ---------------------------------------------------------------- registration
    def _on_welcome(self, link: ReplicaLink, welcome: P.Welcome) -> None:
        """Registered with ``link``'s replica: check it, build the model at the first, attach its data plane."""
        self._check_topology(link, welcome)
        logger.info("[hello] registered with target %s replica %d/%d as epoch %d (pair %s)", welcome.model_id,
                    welcome.replica, welcome.replicas, welcome.registration_epoch, welcome.pair_prefix)
        if self.trainer is None:
            start = time.monotonic()
            self._ensure_model(welcome)
            # Building and warming up the model can outlast a replica's wait for our data plane
            # (transport.timeout_s from its WELCOME): a registration that old is renewed, so its
            # pair forms right after a fresh WELCOME.
            now, stale_after = time.monotonic(), 0.5 * self.cfg.transport.timeout_s
            renewed = [other for other in self._links if other.state == HELLO and other.hello_age(now) > stale_after]
            for other in renewed:
                other.register_again(now)
            logger.info("[hello] model ready after %.1fs%s", now - start,
                        f"; registering again with {', '.join(map(repr, renewed))}" if renewed else "")
            if link in renewed:
                return
        else:
            self._ensure_model(welcome)
        link.sock.send(P.Heartbeat(step=self.trainer.step).encode())
        asked = link.asked_weights  # what our HELLO said (another replica may have sent them since)
        attachment, embed, head = attach(
            self.transport, welcome, drafter_id=f"{self.dcfg.id}.{self.rank}", device=self.device,
            timeout_s=self.cfg.transport.timeout_s, stop=self._stop, weights=asked,
        )
        if asked and self._head is None:
            self._embed, self._head = embed, head
            if self._fresh_model:
                self._initial_scales()
        conn = Connection(credits=self.dcfg.credits, steps_per_batch=self.dcfg.steps_per_batch,
                          max_steps=self.dcfg.max_steps, heartbeat_interval_s=welcome.heartbeat_interval_s,
                          heartbeat_timeout_s=welcome.heartbeat_timeout_s, label=repr(link), now=time.monotonic())
        link.go_live(welcome, attachment, Receiver(attachment, self.device), conn)

    def _check_topology(self, link: ReplicaLink, welcome: P.Welcome) -> None:
        """The replica is the one we addressed, and every replica (and our checkpoint) cuts the same plan alike."""
        if welcome.replica != link.replica or welcome.replicas != self.replicas:
            raise FatalError(f"{link} answered as replica {welcome.replica} of {welcome.replicas}; this drafter "
                             f"expects replica {link.replica} of target.replicas = {self.replicas} there")
        if self._topology and welcome.topology_id != self._topology:
            raise FatalError(
                f"{link} serves topology {welcome.topology_id} (its plan over {welcome.replicas} replicas), but this "
                f"drafter's {'checkpoint' if self._resume_path else 'other replicas'} use topology {self._topology}: "
                "every replica must serve the same data and plan; a checkpoint cannot move to another topology "
                "(start a new run, another run.name)")
        self._topology = welcome.topology_id
        if self.state is not None:
            self.state.topology_id = self._topology

    def _ensure_model(self, welcome: P.Welcome) -> None:
        if self.trainer is not None:
            model_setup.check_layers(self.trainer.model, welcome, "this drafter")
            model_setup.check_data(self.state, welcome, "this drafter's weights")
            self._set_plan(self.trainer, welcome)
            return
        if self.dcfg.threads:
            torch.set_num_threads(self.dcfg.threads)
        torch.set_float32_matmul_precision(self.dcfg.matmul_precision)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.dcfg.seed + self.rank)  # each rank samples its own anchors
        if self._resume_path is not None:
            model, optimizer = self._resume(welcome, generator)
        else:
            if self.dcfg.init_from:
                # Trained weights: the fresh-model scaling (logit std, feature RMS) must not touch them.
                model = model_setup.model_from_init(self.dcfg, welcome, self.device)
            else:
                model = model_setup.fresh_model(self.dcfg, welcome, self.device)
                if self.dcfg.init_target_layers:
                    # Rank 0 loads the target's layers; DDP's first round hands its weights to the other ranks.
                    self._fc_from_target = model_setup.copy_target_layers_into(
                        model, self.cfg.target, self.dcfg, welcome, load=self.rank == 0)
                self._fresh_model = True
            optimizer = make_optimizer(self.dcfg, model)
            self.state = model_setup.new_state(self.dcfg, welcome, model_setup.init_from_path(self.dcfg))
        self.state.world_size = self.world_size
        trainer = DrafterTrainer(self.dcfg, model, optimizer, generator, self.state.step)
        trainer.teacher_norm = model_setup.teacher_norm(self.dcfg, welcome, self.device)
        self._set_plan(trainer, welcome)
        self._warm_up(trainer, welcome)  # before the DDP wrap: its hooks expect every backward through its forward
        self.trainer = trainer
        logger.info("[model] drafter %s: %.2fM parameters, %d layers, block %d, starting at step %d", self.dcfg.id,
                    sum(p.numel() for p in model.parameters()) / 1e6, len(model.layers), model.block_size,
                    self.state.step)

    def _set_plan(self, trainer: DrafterTrainer, welcome: P.Welcome) -> None:
        """The plan length the target announced sets the schedule when max_steps is 0."""
        plan_steps = model_setup.plan_steps(welcome, self.dcfg, self.world_size)
        if plan_steps == trainer.plan_steps:
            return
        trainer.plan_steps = plan_steps
        if not (self.dcfg.max_steps or self.dcfg.decay_steps):
            logger.info("[schedule] learning rate: warm-up %d, cosine over the plan's %s batches x %d steps each "
                        "over %d ranks", self.dcfg.warmup_steps, welcome.plan_batches or "unlimited (constant after "
                        "warm-up)", self.dcfg.steps_per_batch, self.world_size)

    def _resume(self, welcome: P.Welcome, generator: torch.Generator):
        what = f"checkpoint {self._resume_path}"
        if self.state.world_size != self.world_size:
            # Its RNG states and ledgers are per rank: another rank count could not continue them exactly.
            raise FatalError(f"{what} was trained by {self.state.world_size} ranks, this drafter has {self.world_size}; "
                             f"resume with torchrun --nproc-per-node {self.state.world_size}, or start a new run "
                             "(another run.name) and drafter.init_from an export of this one")
        model_setup.check_data(self.state, welcome, what)
        model, optimizer, gen_state, torch_rng = self.checkpoints.load(
            self._resume_path, self.device, lambda m: make_optimizer(self.dcfg, m), self.rank, self.world_size)
        generator.set_state(gen_state.to(generator.get_state().device))
        torch.set_rng_state(torch_rng)
        model_setup.check_layers(model, welcome, what)
        if self.dcfg.init_from:
            logger.info("[model] drafter.init_from ignored: resuming this drafter's own checkpoint")
        return model, optimizer

    def _warm_up(self, trainer: DrafterTrainer, welcome: P.Welcome) -> None:
        """Run every bucket shape once (allocator, kernels, Triton's compilation), not on a CPU, where
        a shape's first step costs what the next one does. Before the data plane forms: the target does
        not hold an unpaired registration to the heartbeat timeout, so a slow start-up is not fatal."""
        start = time.perf_counter()
        if self.device.type != "cpu":
            stand_in = torch.zeros(welcome.vocab_size, welcome.hidden_size, device=self.device,
                                   dtype=head_dtype(self.device, dtype_from_name(welcome.dtype)))  # as the real head
            trainer.warm_up([tuple(b) for b in welcome.buckets], trainer.model.feature_size, stand_in, stand_in)
            logger.info("[startup] warm-up of %d bucket shapes took %.1fs", len(welcome.buckets),
                        time.perf_counter() - start)
        b, t = welcome.buckets[0]
        zero = BatchLayout(b, t, trainer.model.feature_size, dtype_from_name(welcome.dtype))
        # A zero-gradient step's input (its loss is multiplied by 0): as the warm-up's, finite everywhere.
        features, ids, mask, lengths = zero.views(zero.allocate(self.device))
        mask.fill_(1)
        lengths.fill_(t)
        self._zero_batch = (features, ids, mask, lengths)

    def _initial_scales(self) -> None:
        """A model built this run: its own LM head and logit scale now that the target's head is here, feature
        scale at the first batch."""
        if self.trainer.model.draft_head is not None:
            self.trainer.model.init_draft_head(self._head)
        if self.dcfg.logit_std_init > 0:
            factor = init_logit_scale(self.trainer.model, self._embed, self._head,
                                      self.dcfg.logit_std_init, seed=self.dcfg.seed)
            logger.info("[model] final norm scaled by %.4f: initial draft logits have std %.2f over the vocabulary",
                        factor, self.dcfg.logit_std_init)
        # An fc that passes a target layer through to copied target layers keeps that layer's scale.
        self._scale_features = self.dcfg.feature_scale_init and not self._fc_from_target
        self._fresh_model = False

    def _post_receive(self, link: ReplicaLink, msg: P.Batch) -> None:
        """Hand the link's receiver a free buffer of the batch's bucket (allocated on first use) to fill."""
        layout = self._layouts.setdefault(
            msg.bucket, BatchLayout(msg.batch_size, msg.seq_len, msg.feature_dim, dtype_from_name(msg.dtype))
        )
        pool = self._buffers.setdefault(msg.bucket, [])
        if pool:
            buf, free_event = pool.pop()
        else:
            buf = layout.allocate(self.device)
            free_event = record_current(self.device)
        link.receiver.inbox.put((msg, buf, free_event))

    # ---------------------------------------------------------------- checkpoints
    def _checkpoint(self, links: list[ReplicaLink] = ()) -> None:
        """Every rank: ledger lines durable, RNG states to rank 0; rank 0 saves; all learn the outcome."""
        trainer = self.trainer

        def pump() -> None:  # the targets keep hearing from us however long the save takes
            self._pump(links, wait_ms=0)

        ledger_ok = 1
        self._save_error = ""
        try:
            self.ledger.make_durable()
        except OSError as exc:
            ledger_ok = 0
            self._save_error = f"ledger {self.ledger.path}: {exc}"
        packed = torch.cat([pack_rng(trainer.generator), torch.tensor([ledger_ok], dtype=torch.uint8)])
        gathered = self.group.gather_bytes(packed, pump)
        saved = -1
        if self.rank == 0:
            saved = self._save(links, [g[:-1] for g in gathered], all(int(g[-1]) for g in gathered))
        saved = self.group.broadcast_int(saved, pump)
        if saved >= 0:
            self._save_failures = 0
            self._checkpoint_step = saved
            return
        # The previous checkpoint stays the durable one (and the one ACKs name);
        # unwritten ledger lines stay pending for the next save.
        self._save_failures += 1
        why = self._save_error or "rank 0's log says why"
        what = (f"stopping after {MAX_SAVE_FAILURES} failures in a row" if self._save_failures >= MAX_SAVE_FAILURES
                else f"retrying at the next checkpoint (failure {self._save_failures} of {MAX_SAVE_FAILURES})")
        message = (f"drafter {self.dcfg.id}: saving step {trainer.step} under {self.checkpoints.root} failed ({why}); "
                   f"kept checkpoint step {self._checkpoint_step}, {what}")
        if self._save_failures >= MAX_SAVE_FAILURES:
            raise CheckpointSaveFailed(message)
        logger.error("[checkpoint] %s", message)

    def _save(self, links: list[ReplicaLink], rank_rng: list[torch.Tensor], ledgers_ok: bool) -> int:
        """Rank 0's half: the checkpoint of step ``trainer.step``; returns it, or -1 when it was not written."""
        trainer = self.trainer
        # Bad steps never change the weights (found_inf), so this holds unless something else
        # broke them; then keep the last finite checkpoint rather than write over it.
        # One host read per checkpoint, which copies every weight to the host anyway.
        finite = torch.stack([torch.isfinite(p).all() for p in trainer.model.parameters()]).all()
        if not bool(finite):
            raise NonFiniteTraining(f"drafter {self.dcfg.id} has non-finite weights at step {trainer.step}; "
                                    f"kept the last finite checkpoint (step {self._checkpoint_step})")
        if not ledgers_ok:
            self._save_error = self._save_error or "another rank's ledger could not be made durable"
            return -1  # a checkpoint must never count batches no ledger holds
        self.state.step = trainer.step
        rngs = rank_rng if self.world_size > 1 else None

        def save():
            return self.checkpoints.save(self.state, trainer.model, trainer.optimizer, trainer.generator, rngs)

        try:
            path = _heartbeating(save, lambda: self._pump(links, wait_ms=0), 0.05)
        except OSError as exc:
            self._save_error = str(exc)
            return -1
        logger.info("[checkpoint] drafter %s: step %d -> %s", self.dcfg.id, trainer.step, path)
        return trainer.step

    # ---------------------------------------------------------------- metrics
    def _account(self, meta: P.Batch, lr: float, wait_s: float, compute_s: float, step_before: int) -> None:
        w = self._window
        w.tokens += meta.num_tokens
        w.samples += len(meta.sample_ids)
        w.wait_s += wait_s
        w.compute_s += compute_s
        w.steps += self.trainer.step - step_before
        trainer = self.trainer
        if _crossed(step_before, trainer.step, self.cfg.metrics.log_every_steps) and trainer.metrics.snapshot():
            self._window_host = (w, trainer.step, lr)
            self._window = _Window()
        self._flush_metrics()

    def _flush_metrics(self) -> None:
        if self._window_host is None:
            return
        values = self.trainer.metrics.poll()
        if values is None:
            return
        w, step, lr = self._window_host
        self._window_host = None
        record = summarize(values)
        streak = record.pop(NONFINITE_STREAK)
        self._send_record(record, w, step, lr)
        if streak >= MAX_NONFINITE_STREAK:
            raise NonFiniteTraining(
                f"drafter {self.dcfg.id}: {int(streak)} steps in a row had a non-finite loss or gradient norm "
                f"(none of them changed the weights); stopping at step {self.trainer.step}, the last checkpoint "
                f"is step {self._checkpoint_step}. Lower drafter.learning_rate or check the target's features."
            )

    def _send_record(self, record: dict, w: _Window, step: int, lr: float) -> None:
        elapsed = max(time.monotonic() - w.start, 1e-9)
        record.update({
            Drafter.LR: lr,
            Drafter.TOKENS_PER_S: w.tokens / elapsed,
            Drafter.SAMPLES_PER_S: w.samples / elapsed,
            Drafter.DATA_WAIT_FRAC: w.wait_s / elapsed,
            Drafter.COMPUTE_MS: 1000.0 * w.compute_s / max(1, w.steps),
            Drafter.TOKENS_TRAINED: self.state.tokens_trained,
            Drafter.CHECKPOINT_STEP: self._checkpoint_step,
        })
        if self.device.type == "cuda":
            record[Drafter.MEM_ALLOCATED_GB] = torch.cuda.memory_allocated(self.device) / 1e9
            record[Drafter.MEM_PEAK_GB] = torch.cuda.max_memory_allocated(self.device) / 1e9
        self._metrics.send(record, step=step)

    def close(self) -> None:
        self._metrics.close()
        self._sockets.close()
        # Closed sockets keep their linger (a BYE still goes out); one a crash left open is
        # dropped instead of blocking term() forever.
        self._ctx.destroy(linger=0)
