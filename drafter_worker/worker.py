"""The drafter worker: registers with the target, receives batches, trains, checkpoints.

One control thread runs everything except the data-plane receives, which a
:class:`Receiver` thread waits on, so the receive of the next batch overlaps
the training step on the current one (credits >= 2). When the target goes
away the worker keeps its state, retries with backoff and continues when the
target is back; it never exits because of the target.

With transport "shm" there is no pair group: the worker maps the target's batch
pool named in WELCOME, the receiver waits for the slot named in each BATCH to
carry its tag, copies the batch out and checks the tag again (a slot rewritten
under the copy means the target dropped us: register again); the ACK hands the
slot back.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
import zmq

from common import protocol as P
from common.auth import hello_proof, load_or_create_control_key
from common.config import Config
from common.devices import head_dtype, use_device
from drafter_worker.model.dflash_model import (
    DFlashDrafter, init_feature_scale, init_logit_scale, make_drafter_config, resolve_layer_types,
)
from common.metric_names import DRAFTER_SOURCE, Drafter
from common.metrics_client import MetricsPusher
from common.sockets import SocketFactory
from common.packing import BatchLayout, WeightsLayout, dtype_from_name
from common.shm_transport import ShmRing
from common.streams import SideStream, record_current, wait_current
from common.transport import (
    DRAFTER_RANK, PairGroup, TransportError, connect_store, gpu_uuid, local_address_towards, same_gpu_refusal,
)
from drafter_worker.connection import Connection, FatalError, TargetUnavailable, handshake_reply
from drafter_worker.checkpoint import CheckpointStore, Coverage, InitFromError, Ledger, TrainerState, load_init_from
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


class Receiver(threading.Thread):
    """Waits on posted receives in order and hands completed batches to the control thread.

    Over a pair group it receives into the posted buffer. Over an shm ring it
    waits until the batch's slot carries its tag, copies the slot into the posted
    buffer and checks the tag again: a batch rewritten while it was copied (the
    target had dropped this registration) is never trained on. The copy costs a
    memcpy per batch, small against a training step.

    On a GPU the receives run on a stream of this thread's own: each waits only
    on its buffer's ``free_event`` (recorded after the last training step that
    read the buffer), so receiving batch n+1 overlaps training on batch n, and
    the batch is handed over with an event the training stream waits on.
    """

    def __init__(self, pair: PairGroup | None, ring: ShmRing | None = None, timeout_s: float = 0.0,
                 device: torch.device = torch.device("cpu")):
        super().__init__(name="receiver", daemon=True)
        self.pair = pair
        self.ring = ring
        self.timeout_s = timeout_s
        self.device = device
        self._stopped = threading.Event()
        # (BATCH, buffer to fill, event after which the buffer may be written)
        self.inbox: queue.Queue[tuple[P.Batch, torch.Tensor, object] | None] = queue.Queue()
        # (BATCH, filled buffer, event after which it may be read)
        self.ready: queue.Queue[tuple[P.Batch, torch.Tensor, object] | TransportError] = queue.Queue()

    def run(self) -> None:
        # Every failure ends on ``ready`` as a TransportError (the drop/re-register path):
        # a receive thread that died silently would leave the training loop waiting forever.
        try:
            use_device(self.device)  # a new thread starts on GPU 0
            stream = SideStream(self.device)
            stream.wait_default()  # buffers allocated (zeroed) on the default stream
            while True:
                item = self.inbox.get()
                if item is None:
                    return
                meta, buf, free_event = item
                stream.wait(free_event)
                with stream.active():
                    if self.ring is None:
                        self.pair.recv(buf[: meta.nbytes], meta.tag)
                    else:
                        buf = self._from_ring(meta, buf)
                self.ready.put((meta, buf, stream.record()))
        except TransportError as exc:
            self.ready.put(exc)
        except Exception as exc:
            logger.warning("[receive] unexpected failure of the receive thread", exc_info=True)
            self.ready.put(TransportError(f"receive thread failed: {type(exc).__name__}: {exc}"))

    def _from_ring(self, meta: P.Batch, buf: torch.Tensor) -> torch.Tensor:
        ring = self.ring
        if not (0 <= meta.bucket < len(ring.slot_bytes) and 0 <= meta.slot < ring.slots_per_bucket):
            raise TransportError(f"BATCH {meta.batch_id} names slot {meta.bucket}/{meta.slot}, which ring {ring.name} lacks")
        ring.wait_ready(meta.bucket, meta.slot, meta.tag, self.timeout_s, stop=self._stopped)
        slot = ring.payload(meta.bucket, meta.slot)
        buf[: meta.nbytes].copy_(slot[: meta.nbytes])
        _check_slot_kept(ring, meta)
        return buf

    def stop(self) -> None:
        self._stopped.set()
        self.inbox.put(None)


def _check_slot_kept(ring: ShmRing, meta: P.Batch) -> None:
    """Raise when the batch's pool slot was rewritten while it was read (sequence-lock check).

    The target recaptures a slot only after every drafter it went to has ACKed it,
    or after dropping such a drafter's registration; so this fires only for a
    drafter the target had already given up on, whose read may be torn.
    """
    if ring.tag(meta.bucket, meta.slot) != meta.tag:
        raise TransportError(
            f"slot {meta.bucket}/{meta.slot} of the target's pool was rewritten while batch {meta.batch_id} was read "
            "from it: the target had dropped this registration"
        )


def _heartbeating(work, heartbeat, every_s: float):
    """``work()`` on a thread of its own while this thread calls ``heartbeat()`` every ``every_s``.

    The control socket stays on this thread (ZeroMQ sockets are not thread-safe);
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


class DrafterWorker:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.dcfg = cfg.drafter
        self.device = torch.device(self.dcfg.device)
        self.transport = cfg.transport.resolve(self.dcfg.device)
        self.run_dir = cfg.run.path
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sockets = SocketFactory(self._ctx, cfg.security.curve_dir, cfg.security.curve_client)
        self._metrics = MetricsPusher(cfg.metrics.address, DRAFTER_SOURCE(self.dcfg.id), sockets=self._sockets)
        self.checkpoints = CheckpointStore(self.run_dir, self.dcfg.id, self.dcfg.keep_checkpoints, writer=True)
        self.ledger = Ledger(self.run_dir, self.dcfg.id)  # cuts a line a kill left unfinished
        self._save_failures = 0  # checkpoint saves failed in a row
        self.trainer: DrafterTrainer | None = None
        self.state: TrainerState | None = None
        self._resume_path = self.checkpoints.latest()
        if self._resume_path is not None:
            self.state = self.checkpoints.read_state(self._resume_path)
            logger.info("[resume] drafter %s: checkpoint %s (step %d)", self.dcfg.id, self._resume_path, self.state.step)
        self.ledger.resumed(self.state.step if self.state else 0)
        self._checkpoint_step = self.state.step if self.state else 0
        self._embed: torch.Tensor | None = None
        self._warmed_up = False
        self._fresh_model = False  # built this run (not resumed): its logit scale is set once the LM head arrives
        self._scale_features = False  # a fresh model's fc is scaled on its first batch (drafter.feature_scale_init)
        self._head: torch.Tensor | None = None
        self._window = _Window()
        self._window_host: tuple[_Window, int, float] | None = None
        self._started = time.monotonic()
        self._first_step_at: float | None = None
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
        backoff = 0.5
        while not self._stop.is_set():
            try:
                outcome = self._session()
            except TargetUnavailable as exc:
                logger.warning("[target] %s; retrying in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.cfg.control.reconnect_backoff_max_s)
                continue
            backoff = 0.5
            if outcome != "reconnect":
                self.outcome = outcome
                break
        else:
            self.outcome = "stopped"
        if self.trainer is not None and self.trainer.step > self._checkpoint_step:
            self._checkpoint()
        return self.outcome

    # ---------------------------------------------------------------- one registration
    def _session(self) -> str:
        sock = self._sockets.connect(
            zmq.DEALER, self.cfg.control.address, LINGER=500,
            IDENTITY=f"{self.dcfg.id}-{uuid.uuid4().hex[:8]}".encode(),
        )
        receiver: Receiver | None = None
        pair: PairGroup | None = None
        ring: ShmRing | None = None
        said_bye = False
        try:
            welcome = self._handshake(sock)
            self._ensure_model(welcome)
            if not self._warmed_up:
                self._warm_up(welcome)
            sock.send(P.Heartbeat(step=self.trainer.step).encode())
            if self.transport == "shm":
                ring = self._attach_shm(welcome)
            else:
                pair = self._form_pair(welcome)
                self._receive_weights(pair, welcome)
            if self._fresh_model:
                self._initial_scales()
            receiver = Receiver(pair, ring, self.cfg.transport.timeout_s, self.device)
            receiver.start()
            outcome = self._train_loop(sock, receiver, welcome)
            if outcome != "reconnect":
                sock.send(P.Bye(reason=outcome).encode())
                said_bye = True
            return outcome
        except TransportError as exc:
            raise TargetUnavailable(f"data plane failed: {exc}") from None
        finally:
            if receiver is not None:
                receiver.stop()
            if pair is not None:
                pair.abort()
            if receiver is not None:
                # Join so the process group is released on this thread: a daemon thread
                # freeing it during interpreter shutdown aborts the process.
                receiver.join(timeout=min(self.cfg.transport.timeout_s, 0.3 * self.dcfg.stop_timeout_s))
                if receiver.is_alive():
                    self.threads_left.append(receiver.name)
            if ring is not None:
                ring.close()  # the target unlinks it; this only drops our mapping
            if not said_bye and self._stop.is_set():
                try:
                    sock.send(P.Bye(reason="stopping").encode(), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            sock.close(linger=200 if said_bye else 0)

    def _warm_up(self, welcome: P.Welcome) -> None:
        """Run every bucket shape once. Before the data plane forms: the target does not hold an
        unpaired registration to the heartbeat timeout, so a slow start-up is not fatal."""
        start = time.perf_counter()
        stand_in = torch.zeros(welcome.vocab_size, welcome.hidden_size, device=self.device,
                               dtype=head_dtype(self.device, dtype_from_name(welcome.dtype)))  # as the real head
        self.trainer.warm_up([tuple(b) for b in welcome.buckets], self.trainer.model.feature_size, stand_in, stand_in)
        self._warmed_up = True
        logger.info("[startup] warm-up of %d bucket shapes took %.1fs", len(welcome.buckets), time.perf_counter() - start)

    def _form_pair(self, welcome: P.Welcome) -> PairGroup:
        # A target that predates HELLO.gpu_uuid does not check: refuse here too.
        if refusal := same_gpu_refusal(self.transport, welcome.gpu_uuid, gpu_uuid(self.device), self.dcfg.id):
            raise FatalError(refusal)
        store = connect_store(welcome.store_host, welcome.store_port, self.cfg.transport.timeout_s)
        return PairGroup(
            kind=self.transport, store=store, prefix=welcome.pair_prefix, rank=DRAFTER_RANK,
            device=self.device, timeout_s=self.cfg.transport.timeout_s,
            local_host=local_address_towards(welcome.store_host),
        )

    def _initial_scales(self) -> None:
        """A model built this run: logit scale now that the LM head is here, feature scale at the first batch."""
        if self.dcfg.logit_std_init > 0:
            factor = init_logit_scale(self.trainer.model, self._embed, self._head,
                                      self.dcfg.logit_std_init, seed=self.dcfg.seed)
            logger.info("[model] final norm scaled by %.4f: initial draft logits have std %.2f over the vocabulary",
                        factor, self.dcfg.logit_std_init)
        self._scale_features = self.dcfg.feature_scale_init
        self._fresh_model = False

    def _hello(self) -> P.Hello:
        coverage = self.state.coverage if self.state else Coverage()
        return P.Hello(
            drafter_id=self.dcfg.id, group=self.dcfg.group, config_hash=self.cfg.shared_hash(),
            transport=self.transport, pid=os.getpid(), covered_watermark=coverage.watermark,
            covered_extra=sorted(coverage.extra), step=self.state.step if self.state else 0,
            # Read at every HELLO: whichever process of the run starts first creates the key.
            auth=hello_proof(load_or_create_control_key(self.run_dir), self.dcfg.id),
            gpu_uuid=gpu_uuid(self.device) if self.transport == "nccl" else "",
        )

    def _handshake(self, sock: zmq.Socket) -> P.Welcome:
        sock.send(self._hello().encode())
        deadline = time.monotonic() + self.cfg.control.handshake_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if not sock.poll(100):
                continue
            welcome = handshake_reply(self._decode(sock.recv()))
            if welcome is not None:
                logger.info(
                    "[hello] registered with target %s as epoch %d (pair %s)",
                    welcome.model_id, welcome.registration_epoch, welcome.pair_prefix,
                )
                return welcome
        if self._stop.is_set():
            raise TargetUnavailable("stopping before the target answered")
        raise TargetUnavailable(
            f"no WELCOME from {self.cfg.control.address} within {self.cfg.control.handshake_timeout_s:.0f}s "
            "(is the target running? raise control.handshake_timeout_s if it is still loading)"
        )

    def _decode(self, frame: bytes) -> P.Message | None:
        try:
            return P.decode(frame, max_bytes=self.cfg.control.max_message_bytes)
        except P.ProtocolError as exc:
            logger.warning("ignoring a bad message from the target: %s", exc.message)
            return None

    def _ensure_model(self, welcome: P.Welcome) -> None:
        if self.trainer is not None:
            model = self.trainer.model
            if list(model.target_layer_ids) != list(welcome.target_layer_ids):
                raise FatalError(
                    f"the target now captures layers {welcome.target_layer_ids} but this drafter was built for "
                    f"{list(model.target_layer_ids)}"
                )
            self._check_data(welcome, "this drafter's weights")
            self._set_plan(welcome)
            return
        if self.dcfg.threads:
            torch.set_num_threads(self.dcfg.threads)
        torch.set_float32_matmul_precision(self.dcfg.matmul_precision)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.dcfg.seed)
        if self._resume_path is not None:
            self._check_data(welcome, f"checkpoint {self._resume_path}")
            model, optimizer, gen_state, torch_rng = self.checkpoints.load(
                self._resume_path, self.device, lambda m: make_optimizer(self.dcfg, m)
            )
            generator.set_state(gen_state)
            torch.set_rng_state(torch_rng)
            if list(model.target_layer_ids) != list(welcome.target_layer_ids):
                raise FatalError(
                    f"checkpoint {self._resume_path} was trained on layers {list(model.target_layer_ids)}, "
                    f"the target captures {welcome.target_layer_ids}"
                )
            step = self.state.step
            if self.dcfg.init_from:
                logger.info("[model] drafter.init_from ignored: resuming this drafter's own checkpoint")
        elif self.dcfg.init_from:
            model = self._init_from(welcome)
            optimizer = make_optimizer(self.dcfg, model)
            step = 0
            # Trained weights: the fresh-model scaling (logit std, feature RMS) must not touch them.
            self._fresh_model = False
            self.state = TrainerState(0, Coverage(), self.dcfg.id, self.dcfg.group, welcome.model_id,
                                      train_samples=welcome.train_samples, data_fingerprint=welcome.data_fingerprint,
                                      batches_per_epoch=welcome.batches_per_epoch,
                                      init_from=os.path.abspath(self.dcfg.init_from))
        else:
            arch = welcome.target_arch
            config = make_drafter_config(
                hidden_size=welcome.hidden_size,
                num_attention_heads=arch.num_attention_heads,
                num_key_value_heads=arch.num_key_value_heads,
                head_dim=arch.head_dim,
                intermediate_size=arch.intermediate_size,
                vocab_size=welcome.vocab_size,
                rms_norm_eps=arch.rms_norm_eps,
                rope_theta=arch.rope_theta,
                max_position_embeddings=arch.max_position_embeddings,
                num_hidden_layers=self.dcfg.num_layers,
                num_target_layers=welcome.num_target_layers,
                target_layer_ids=welcome.target_layer_ids,
                block_size=self.dcfg.block_size,
                mask_token_id=welcome.mask_token_id,
                draft_vocab_size=min(self.dcfg.draft_vocab_size, welcome.vocab_size),
                layer_types=self.dcfg.layer_types,
                sliding_window=self.dcfg.sliding_window,
            )
            torch.manual_seed(self.dcfg.seed)
            model = DFlashDrafter(config).to(self.device)
            if model.draft_vocab_size:
                self._set_draft_vocab(model, welcome)
            optimizer = make_optimizer(self.dcfg, model)
            step = 0
            self._fresh_model = True
            self.state = TrainerState(0, Coverage(), self.dcfg.id, self.dcfg.group, welcome.model_id,
                                      train_samples=welcome.train_samples, data_fingerprint=welcome.data_fingerprint,
                                      batches_per_epoch=welcome.batches_per_epoch)
        self.trainer = DrafterTrainer(self.dcfg, model, optimizer, generator, step)
        self._set_plan(welcome)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info("[model] drafter %s: %.2fM parameters, %d layers, block %d, starting at step %d",
                    self.dcfg.id, n_params / 1e6, len(model.layers), model.block_size, step)

    def _init_from(self, welcome: P.Welcome) -> DFlashDrafter:
        """A fresh start from the trained drafter ``drafter.init_from`` names, checked against this target."""
        try:
            model = load_init_from(
                self.dcfg.init_from, self.device, hidden_size=welcome.hidden_size, vocab_size=welcome.vocab_size,
                target_layer_ids=welcome.target_layer_ids, mask_token_id=welcome.mask_token_id,
                block_size=self.dcfg.block_size,
            )
        except InitFromError as exc:
            raise FatalError(str(exc)) from None
        dcfg, config = self.dcfg, model.config
        theirs = (len(model.layers), list(config.layer_types or []), getattr(config, "sliding_window", None) or 0)
        ours = (dcfg.num_layers, resolve_layer_types(dcfg.num_layers, dcfg.layer_types, dcfg.sliding_window),
                dcfg.sliding_window)
        if ours != theirs or (dcfg.draft_vocab_size and dcfg.draft_vocab_size != model.draft_vocab_size):
            logger.warning("[model] drafter.init_from %s sets the architecture: %d layers %s, sliding window %s, "
                           "draft vocabulary %s (drafter.num_layers, layer_types, sliding_window and "
                           "draft_vocab_size are not used)", dcfg.init_from, theirs[0], theirs[1], theirs[2] or "none",
                           model.draft_vocab_size or "none")
        logger.info("[model] drafter %s starts from the trained drafter %s", self.dcfg.id, self.dcfg.init_from)
        return model

    def _check_data(self, welcome: P.Welcome, what: str) -> None:
        """Refuse to continue training made on other data; otherwise record the target's data in the state."""
        ours, theirs = self.state.data_fingerprint, welcome.data_fingerprint
        if ours and ours != theirs:
            raise FatalError(
                f"{what} was trained on data with fingerprint {ours}, but the target serves data with fingerprint "
                f"{theirs or '(none)'}; start a new run (another run.name) or restore the data this run was started with"
            )
        self.state.data_fingerprint = theirs
        self.state.train_samples = welcome.train_samples
        self.state.batches_per_epoch = welcome.batches_per_epoch

    def _set_draft_vocab(self, model: DFlashDrafter, welcome: P.Welcome) -> None:
        """The K tokens the target's training answers use most; ids the data never uses fill the rest."""
        k = model.draft_vocab_size
        ranked = list(dict.fromkeys(welcome.token_ranking))[:k]
        if any(not 0 <= t < welcome.vocab_size for t in ranked):
            raise FatalError("the target's token ranking holds ids outside its vocabulary")
        seen = set(ranked)
        ranked += [t for t in range(welcome.vocab_size) if t not in seen][: k - len(ranked)]
        model.set_draft_vocab(ranked)
        logger.info("[model] draft vocabulary: the %d most used of %d answer tokens (of %d)", k,
                    len(welcome.token_ranking), welcome.vocab_size)

    def _set_plan(self, welcome: P.Welcome) -> None:
        """The plan length the target announced sets the schedule when max_steps is 0."""
        if welcome.plan_batches < 0:
            raise TargetUnavailable(f"target announced a negative plan length ({welcome.plan_batches})")
        plan_steps = welcome.plan_batches * self.dcfg.steps_per_batch
        if plan_steps != self.trainer.plan_steps:
            self.trainer.plan_steps = plan_steps
            if not (self.dcfg.max_steps or self.dcfg.decay_steps):
                logger.info("[schedule] learning rate: warm-up %d, cosine over the plan's %s batches x %d steps each",
                            self.dcfg.warmup_steps, welcome.plan_batches or "unlimited (constant after warm-up)",
                            self.dcfg.steps_per_batch)

    def _receive_weights(self, pair: PairGroup, welcome: P.Welcome) -> None:
        layout = WeightsLayout(welcome.vocab_size, welcome.hidden_size, welcome.embed_tied, dtype_from_name(welcome.dtype))
        buf = layout.allocate(self.device)
        pair.recv(buf, tag=0)
        embed, head = layout.views(buf)
        dtype = head_dtype(self.device, layout.dtype)  # the wire dtype on a GPU (no fp32 copy), fp32 on the CPU
        self._embed, self._head = embed.to(dtype), head.to(dtype)

    def _attach_shm(self, welcome: P.Welcome) -> ShmRing:
        """Map the target's batch pool and copy the frozen weights from its weights segment."""
        if not welcome.shm_name or not welcome.shm_weights_name or welcome.shm_slots_per_bucket < 1:
            raise FatalError("the target uses transport shm but its WELCOME names no shared-memory ring")
        timeout_s = self.cfg.transport.timeout_s
        layout = WeightsLayout(welcome.vocab_size, welcome.hidden_size, welcome.embed_tied, dtype_from_name(welcome.dtype))
        # Both segments exist before WELCOME is sent: one missing now means the target
        # has ended this registration (or does not share our /dev/shm), so no waiting.
        weights = ShmRing.attach(welcome.shm_weights_name, [layout.nbytes], 1)
        try:
            weights.wait_ready(0, 0, 1, timeout_s, stop=self._stop)
            embed, head = layout.views(weights.payload(0, 0))
            # Own copies: the segment is the target's, shared with every drafter.
            dtype = head_dtype(self.device, layout.dtype)  # the wire dtype on a GPU (no fp32 copy), fp32 on the CPU
            self._embed = embed.to(self.device, dtype, copy=True)
            self._head = self._embed if welcome.embed_tied else head.to(self.device, dtype, copy=True)
        finally:
            weights.close()
        ring = ShmRing.attach(welcome.shm_name, welcome.shm_slot_bytes, welcome.shm_slots_per_bucket)
        try:
            # Before our first REQUEST, so before we read any slot: the target frees the slots
            # we hold at once when it can take this lock (we died), else after a grace period.
            ring.hold_liveness(self.dcfg.id, welcome.registration_epoch)
        except BaseException:
            ring.close()
            raise
        logger.info("[shm] mapped the target's batch pool /dev/shm/%s (%d buckets x %d slots, %.1f MiB)",
                    ring.name, len(ring.slot_bytes), ring.slots_per_bucket, ring.nbytes / 2**20)
        return ring

    # ---------------------------------------------------------------- steady state
    def _train_loop(self, sock: zmq.Socket, receiver: Receiver, welcome: P.Welcome) -> str:
        trainer = self.trainer
        # Free buffers per bucket, each with the event after which it may be overwritten.
        buffers: dict[int, list[tuple[torch.Tensor, object]]] = {}
        layouts: dict[int, BatchLayout] = {}
        conn = Connection(credits=self.dcfg.credits, steps_per_batch=self.dcfg.steps_per_batch,
                          max_steps=self.dcfg.max_steps, heartbeat_interval_s=welcome.heartbeat_interval_s,
                          heartbeat_timeout_s=welcome.heartbeat_timeout_s, group=self.dcfg.group, now=time.monotonic())

        def send(messages: list[P.Message]) -> None:
            for msg in messages:
                sock.send(msg.encode())

        send(conn.start())
        self._window = _Window()  # throughput windows start with training, not with start-up
        idle_since = time.monotonic()
        while True:
            if self._stop.is_set():
                return "stopped"
            if outcome := conn.outcome(trainer.step):
                return outcome
            send(conn.heartbeat(time.monotonic(), trainer.step))
            # Control messages (before the silence check: after a long step they are queued, not lost).
            while sock.poll(0 if conn.inflight and not receiver.ready.empty() else 5):
                batch = conn.on_message(self._decode(sock.recv()), time.monotonic())
                if batch is not None:
                    self._post_receive(batch, receiver, buffers, layouts)
            conn.check_alive(time.monotonic())
            # A completed receive: train on it.
            try:
                item = receiver.ready.get_nowait()
            except queue.Empty:
                continue
            if isinstance(item, TransportError):
                raise item
            meta, buf, ready_event = item
            wait_s = time.monotonic() - idle_since
            start = time.perf_counter()
            wait_current(self.device, ready_event)  # device-side: the receive's stream filled buf
            first_step, lr = self._train_batch(layouts[meta.bucket].views(buf))
            compute_s = time.perf_counter() - start
            if self._first_step_at is None:
                self._first_step_at = time.monotonic()
            idle_since = time.monotonic()
            # Reusable once the step just issued has read it (device-side order).
            buffers[meta.bucket].append((buf, record_current(self.device)))
            self._record_trained(meta, first_step)
            self._account(meta, lr, wait_s, compute_s, first_step - 1)
            if _crossed(first_step - 1, trainer.step, self.dcfg.checkpoint_every_steps):
                # The target keeps hearing from us however long the save takes.
                self._checkpoint(heartbeat=lambda: sock.send(P.Heartbeat(step=trainer.step).encode()),
                                 heartbeat_every_s=welcome.heartbeat_interval_s)
            send(conn.on_trained(meta.batch_id, trainer.step, self._checkpoint_step))

    def _post_receive(self, msg: P.Batch, receiver: Receiver, buffers: dict, layouts: dict) -> None:
        """Hand the receiver a free buffer of the batch's bucket (allocated on first use) to fill."""
        layout = layouts.setdefault(
            msg.bucket, BatchLayout(msg.batch_size, msg.seq_len, msg.feature_dim, dtype_from_name(msg.dtype))
        )
        pool = buffers.setdefault(msg.bucket, [])
        if pool:
            buf, free_event = pool.pop()
        else:
            buf = layout.allocate(self.device)
            free_event = record_current(self.device)
        receiver.inbox.put((msg, buf, free_event))

    def _train_batch(self, views: tuple) -> tuple[int, float]:
        """drafter.steps_per_batch optimizer steps on one batch, each on freshly sampled anchors
        (never past max_steps); returns (first step number, last learning rate)."""
        trainer = self.trainer
        features, input_ids, loss_mask, lengths = views
        if self._scale_features:
            init_feature_scale(trainer.model, features, lengths)
            self._scale_features = False
            logger.info("[model] fc columns scaled by 1/RMS of each feature dimension of the first batch")
        first_step = trainer.step + 1
        steps = self.dcfg.steps_per_batch
        if self.dcfg.max_steps:
            steps = max(1, min(steps, self.dcfg.max_steps - trainer.step))
        for _ in range(steps):
            lr = trainer.train_step(features.float(), input_ids, loss_mask, lengths, self._embed, self._head)
        return first_step, lr

    def _record_trained(self, meta: P.Batch, first_step: int) -> None:
        """The batch is in the weights: the data cursor and the ledger (durable with the next checkpoint)."""
        step = self.trainer.step
        self.state.coverage.add(meta.batch_id)
        self.state.step = step
        self.state.tokens_trained += meta.num_tokens
        self.ledger.trained(step, meta.batch_id, meta.epoch, meta.sample_ids, first_step=first_step)

    def _checkpoint(self, heartbeat=None, heartbeat_every_s: float = 1.0) -> None:
        trainer = self.trainer
        # Bad steps never change the weights (found_inf), so this holds unless something else
        # broke them; then keep the last finite checkpoint rather than write over it.
        # One host read per checkpoint, which copies every weight to the host anyway.
        finite = torch.stack([torch.isfinite(p).all() for p in trainer.model.parameters()]).all()
        if not bool(finite):
            raise NonFiniteTraining(f"drafter {self.dcfg.id} has non-finite weights at step {trainer.step}; "
                                    f"kept the last finite checkpoint (step {self._checkpoint_step})")
        self.state.step = trainer.step
        def save():
            self.ledger.make_durable()
            return self.checkpoints.save(self.state, trainer.model, trainer.optimizer, trainer.generator)

        try:
            path = save() if heartbeat is None else _heartbeating(save, heartbeat, heartbeat_every_s)
        except OSError as exc:
            # The previous checkpoint stays the durable one (and the one ACKs name);
            # unwritten ledger lines stay pending for the next save.
            self._save_failures += 1
            what = (f"stopping after {MAX_SAVE_FAILURES} failures in a row" if self._save_failures >= MAX_SAVE_FAILURES
                    else f"retrying at the next checkpoint (failure {self._save_failures} of {MAX_SAVE_FAILURES})")
            message = (f"drafter {self.dcfg.id}: saving step {trainer.step} under {self.checkpoints.root} failed ({exc}); "
                       f"kept checkpoint step {self._checkpoint_step}, {what}")
            if self._save_failures >= MAX_SAVE_FAILURES:
                raise CheckpointSaveFailed(message) from None
            logger.error("[checkpoint] %s", message)
            return
        self._save_failures = 0
        self._checkpoint_step = trainer.step
        logger.info("[checkpoint] drafter %s: step %d -> %s", self.dcfg.id, trainer.step, path)

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
        self._ctx.term()
