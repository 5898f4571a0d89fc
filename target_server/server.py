"""The target server: control socket, registrations, dispatch, capture thread.

Threads:
- control (the caller of :meth:`TargetServer.serve`): the ZeroMQ ROUTER loop.
  It owns every registration, grants batches against credits, sends BATCH
  metadata, heartbeats, and reaps dead drafters. It never waits on the data
  plane or the model.
- capture: asks the scheduler which batch some group needs, runs the target
  forward into a pre-allocated bucket buffer (transport "shm": a slot of the
  shared batch pool, which drafters copy out), publishes it.
- one link thread per registration (gloo/NCCL): forms the pair group and sends
  buffers. With shm there is nothing to send: the BATCH names the pool slot.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from common import protocol as P
from common.auth import hello_proof, load_or_create_control_key, proof_ok, status_proof
from common.config import Config
from common.devices import use_device
from common.dflash_model import build_target_layer_ids
from common.metrics_client import MetricsPusher
from common.sockets import SecurityError, SocketFactory, check_bind
from common.packing import BatchLayout, WeightsLayout, dtype_from_name
from common.shm_transport import ShmRing, segment_name, sweep_stale
from common.streams import SideStream
from common.transport import TransportError, gpu_uuid, host_store, local_address_towards, same_gpu_refusal
from target_server.admission import PeerRateLimiter
from target_server.bucketing import BatchPlan, BucketSpec, pack_batch
from target_server.capture import LayerCapture
from target_server.data import build_dataset, fingerprint, token_ranking
from target_server.feature_cache import FeatureCache
from target_server.link import DrafterLink, LinkEvent
from target_server.model_loader import embedding_weights, load_target, pick_mask_token_id
from target_server.scheduler import BatchScheduler, ReadyBatch
from target_server.shm_pool import PoolLink, ShmBatchPool

logger = logging.getLogger(__name__)

# Inbound queue per peer: a drafter has a few messages in flight (ACK, REQUEST, HEARTBEAT);
# beyond this a flooding peer's own sends block instead of growing our memory.
_RCVHWM = 128
# Message budgets per peer (messages/s, burst); a frame costs 1 plus 1 per 64 KiB.
_REGISTERED_BUDGET = (1000.0, 2000.0)
_STRANGER_BUDGET = (20.0, 40.0)
_LOOP_BUDGET_S = 0.02  # control-loop time spent on messages before timers run, every turn


class StartupError(RuntimeError):
    """A user-fixable start-up failure (port taken, bad model, bad data); the message says what to do."""


@dataclass
class Registration:
    identity: bytes
    drafter_id: str
    group: str
    epoch: int
    link: DrafterLink | PoolLink
    pid: int
    registered_at: float
    last_seen: float
    last_progress: float  # last ACK, or the dispatch that ended an idle spell: bounds how long batches are held
    credits: int = 0
    inflight: set[int] = field(default_factory=set)  # dispatched, not acknowledged
    step: int = 0
    checkpoint_step: int = 0
    next_tag: int = 1  # tag 0 carries the weights
    done_sent: bool = False
    held: dict[int, ReadyBatch] = field(default_factory=dict)  # transport "shm": pool slots it may read, by batch id


class TargetServer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = torch.device(cfg.target.device)
        self.dtype = dtype_from_name(cfg.target.dtype)
        self.transport = cfg.transport.resolve(cfg.target.device)
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sockets = SocketFactory(self._ctx, cfg.security.curve_dir, cfg.security.curve_client)
        self._sock: zmq.Socket | None = None
        self._store = None
        self._regs: dict[bytes, Registration] = {}
        self._stopped_links: list[DrafterLink | PoolLink] = []  # joined at close
        self._shm_weights: ShmRing | None = None
        self._shm_pool: ShmBatchPool | None = None
        # transport "shm": pool slots of dropped registrations, handed back at the given time.
        self._deferred_release: list[tuple[float, list[ReadyBatch]]] = []
        self._offenders: set[bytes] = set()
        self._registered_budget = PeerRateLimiter(*_REGISTERED_BUDGET)
        self._stranger_budget = PeerRateLimiter(*_STRANGER_BUDGET)
        self._control_key = ""
        self._capture_tick = time.monotonic()  # the capture thread's last sign of progress
        self._last_hello: dict[str, float] = {}
        self._events: queue.Queue[LinkEvent] = queue.Queue()
        self._epoch_counter = 0
        self._started_at = time.monotonic()
        self._capture_thread: threading.Thread | None = None
        self._capture_error: BaseException | None = None
        self.threads_left: list[str] = []
        # Host-side counters written by the capture thread, read by the control thread.
        self._stats_lock = threading.Lock()
        self._captured_batches = 0
        self._forward_batches = 0  # batches that ran the model (the rest came from the feature cache)
        self._cached_batches = 0
        self.feature_cache = FeatureCache(int(cfg.target.feature_cache_gb * 1e9))
        self._captured_tokens = 0
        self._padded_tokens = 0
        self._forward_s = 0.0
        self._bytes_sent = 0
        self._send_s = 0.0
        self._window_start = time.monotonic()
        self._last_totals: tuple = (0, 0.0, 0, 0, 0, 0.0, 0.0, 0, 0)
        self._tokens_per_s = 0.0

    # ---------------------------------------------------------------- start-up
    def start(self) -> None:
        use_device(self.device)  # before any CUDA work (the current device is per thread; new ones start on GPU 0)
        cfg = self.cfg
        if cfg.target.threads:
            torch.set_num_threads(cfg.target.threads)
        # Bind first: a taken port should fail in a second, not after loading the model.
        try:
            check_bind(f"tcp://{cfg.control.store_host}:{cfg.control.store_port}", cfg.security.curve_dir, "data-plane store")
            # Peers that stop reading lose messages (SNDHWM) instead of growing our memory.
            self._sock = self._sockets.bind(
                zmq.ROUTER, cfg.control.address, "control socket", LINGER=0, ROUTER_MANDATORY=0,
                MAXMSGSIZE=min(cfg.control.max_message_bytes, max(P.INBOUND_BYTES.values())),
                RCVHWM=_RCVHWM, SNDHWM=1000,
            )
        except SecurityError as exc:
            raise StartupError(f"{exc}; is another target running? change control.address") from None
        try:
            self._store = host_store(cfg.control.store_host, cfg.control.store_port, cfg.transport.timeout_s)
        except RuntimeError as exc:
            raise StartupError(str(exc)) from None
        self._metrics = MetricsPusher(cfg.metrics.address, "target", sockets=self._sockets)
        self._control_key = load_or_create_control_key(cfg.run.path)

        loaded = load_target(
            cfg.target.model, device=cfg.target.device, dtype=self.dtype, tokenizer_source=cfg.target.tokenizer or None
        )
        self.loaded = loaded
        self.layer_ids = cfg.target.target_layer_ids or build_target_layer_ids(
            loaded.num_layers, cfg.target.num_captured_layers
        )
        if max(self.layer_ids) >= loaded.num_layers:
            raise StartupError(
                f"target.target_layer_ids {self.layer_ids} exceed the model's {loaded.num_layers} layers"
            )
        self.mask_token_id = pick_mask_token_id(
            loaded.tokenizer, cfg.target.mask_token_id if cfg.target.mask_token_id >= 0 else None,
            vocab_size=loaded.vocab_size,
        )
        self.capture = LayerCapture(loaded.model, self.layer_ids)
        self.feature_dim = len(self.layer_ids) * loaded.hidden_size
        logger.info(
            "[startup] target %s: %d layers, hidden %d, vocab %d; capturing layers %s; mask token %d; transport %s",
            loaded.model_id, loaded.num_layers, loaded.hidden_size, loaded.vocab_size, self.layer_ids,
            self.mask_token_id, self.transport,
        )

        self.dataset = build_dataset(
            loaded.tokenizer, cfg.data.source, max_seq_len=cfg.data.max_seq_len, seed=cfg.data.seed,
            heldout_fraction=cfg.data.heldout_fraction, max_samples=cfg.data.max_samples,
        )
        self.token_ranking = token_ranking(self.dataset.train, loaded.vocab_size, P.TOKEN_RANKING_MAX)
        self.data_fingerprint = fingerprint(self.dataset, loaded.tokenizer)
        logger.info("[data] fingerprint %s (token ids, masks, tokenizer, chat template)", self.data_fingerprint)
        self.spec = BucketSpec(tuple(cfg.data.bucket_lengths), cfg.data.tokens_per_batch)
        self.plan = BatchPlan(self.dataset.train_lengths(), self.spec, cfg.data.seed)
        total = self.plan.batches_per_epoch * cfg.data.num_epochs if cfg.data.num_epochs else None
        self.layouts = [BatchLayout(b, t, self.feature_dim, self.dtype) for b, t in self.spec.shapes()]
        if self.transport == "shm":
            self._create_shm_pool()
        self.scheduler = BatchScheduler(
            bucket_of=lambda i: self.plan.batch(i).bucket,
            layouts=self.layouts,
            slots_per_bucket=cfg.target.ready_batches,
            total_batches=total,
            device=self.device,
            buffers=self._shm_pool.buffers if self._shm_pool is not None else None,
        )
        logger.info(
            "[startup] plan: %d batches per epoch, buckets %s, epochs %s",
            self.plan.batches_per_epoch, self.spec.shapes(), cfg.data.num_epochs or "unlimited",
        )

        embed, head, tied = embedding_weights(loaded.model)
        self.weights_layout = WeightsLayout(loaded.vocab_size, loaded.hidden_size, tied, self.dtype)
        self.weights_buf = self.weights_layout.allocate(self.device)
        w_embed, w_head = self.weights_layout.views(self.weights_buf)
        w_embed.copy_(embed)
        if not tied:
            w_head.copy_(head)
        if self.transport == "shm":
            self._publish_shm_weights()
        self._warm_up()
        self._capture_thread = threading.Thread(target=self._capture_loop, name="capture", daemon=True)
        self._capture_thread.start()
        self._started_at = time.monotonic()
        logger.info("[startup] serving on %s (store %s:%d)", cfg.control.address, cfg.control.store_host, cfg.control.store_port)

    def _create_shm_pool(self) -> None:
        """The batch buffers in shared memory: captured into in place, copied out by the drafters."""
        if self.device.type != "cpu":
            raise StartupError(
                f"transport shm needs the target on the CPU (its batch buffers are host shared memory), "
                f"target.device is {self.cfg.target.device}; use transport.kind = \"nccl\""
            )
        sweep_stale()  # segments of targets that died without cleaning up
        per_bucket = self.cfg.target.ready_batches + self.cfg.transport.shm_slots_per_bucket
        try:
            self._shm_pool = ShmBatchPool(segment_name(os.getpid(), "pool"), self.layouts, per_bucket)
        except TransportError as exc:
            raise StartupError(str(exc)) from None
        logger.info("[startup] shm transport: batch pool /dev/shm/%s (%d buckets x %d slots, %.1f MiB)",
                    self._shm_pool.name, len(self.layouts), per_bucket, self._shm_pool.nbytes / 2**20)

    def _publish_shm_weights(self) -> None:
        """One segment of frozen weights for every shm registration of this target (drafters copy it)."""
        try:
            ring = ShmRing.create(segment_name(os.getpid(), "weights"), [self.weights_layout.nbytes], 1)
        except TransportError as exc:
            raise StartupError(str(exc)) from None
        ring.payload(0, 0).copy_(self.weights_buf)
        ring.publish(0, 0, tag=1)
        self._shm_weights = ring
        logger.info("[startup] shm transport: weights in /dev/shm/%s (%.1f MiB)", ring.name, ring.nbytes / 2**20)

    def _warm_up(self) -> None:
        """Run every bucket shape once so allocator/kernel set-up is not in the first measured batch."""
        start = time.perf_counter()
        for layout in self.layouts:
            buf = layout.allocate(self.device)
            features, ids, _, _ = layout.views(buf)
            self.capture.run(ids.long(), features)
        logger.info("[startup] warm-up of %d bucket shapes took %.1fs", len(self.layouts), time.perf_counter() - start)

    # ---------------------------------------------------------------- capture thread
    def _capture_loop(self) -> None:
        use_device(self.device)  # a new thread starts on GPU 0
        pad_id = self.loaded.pad_token_id
        # The capture runs on a stream of its own, so the links' sends (each on its own
        # stream, ordered after a batch by its ready_event) overlap the next forward.
        stream = SideStream(self.device)
        stream.wait_default()  # weights and buffers were written on the default stream
        try:
            while not self._stop.is_set():
                self._capture_tick = time.monotonic()  # waits return every 0.5 s: only a hung batch stops this
                got = self.scheduler.next_to_capture(timeout_s=0.5)
                if got is None:
                    continue
                index, buf = got
                for event in self.scheduler.reader_events(buf):
                    stream.wait(event)  # device-side: the previous batch's sends have read buf
                pool_slot = -1
                try:
                    planned = self.plan.batch(index)
                    layout = self.layouts[planned.bucket]
                    if self._shm_pool is not None:
                        pool_slot = self._shm_pool.slot_of(buf)
                        self._shm_pool.begin_write(planned.bucket, pool_slot)
                    features, ids, mask, lengths = layout.views(buf)
                    samples = [self.dataset.train[i] for i in planned.sample_ids]
                    input_ids, loss_mask, lens = pack_batch(samples, layout.batch_size, layout.seq_len, pad_id)
                    if self.device.type == "cuda":  # pinned sources make the uploads asynchronous
                        input_ids, loss_mask, lens = input_ids.pin_memory(), loss_mask.pin_memory(), lens.pin_memory()
                    real = sum(min(len(s), layout.seq_len) for s in samples)
                    cached = self.feature_cache.covers(planned.sample_ids)
                    start = time.perf_counter()
                    with stream.active():
                        ids.copy_(input_ids, non_blocking=True)
                        mask.copy_(loss_mask, non_blocking=True)
                        lengths.copy_(lens, non_blocking=True)
                        if cached:
                            self.feature_cache.fill(planned.sample_ids, features)
                        else:
                            self.capture.run(ids.long(), features)
                            self.feature_cache.store(planned.sample_ids, [min(len(s), layout.seq_len) for s in samples],
                                                     features)
                    ready_event = stream.record()
                    elapsed = time.perf_counter() - start
                    shm_tag = self._shm_pool.publish(planned.bucket, pool_slot) if pool_slot >= 0 else 0
                except Exception:
                    self.scheduler.abandon(index, buf)
                    raise
                self.scheduler.publish(
                    ReadyBatch(index, planned.epoch, planned.bucket, list(planned.sample_ids), real, buf, layout,
                               ready_event=ready_event, shm_slot=pool_slot, shm_tag=shm_tag)
                )
                with self._stats_lock:
                    self._captured_batches += 1
                    self._captured_tokens += real
                    self._padded_tokens += layout.batch_size * layout.seq_len
                    if cached:
                        self._cached_batches += 1
                    else:
                        self._forward_s += elapsed
                        self._forward_batches += 1
        except BaseException as exc:  # surfaced by the control loop, which exits non-zero
            self._capture_error = exc
            logger.exception("capture thread failed")
            self._stop.set()

    # ---------------------------------------------------------------- control loop
    @property
    def stop_event(self) -> threading.Event:
        return self._stop

    def request_stop(self) -> None:
        self._stop.set()

    def serve(self) -> None:
        assert self._sock is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        hb_every = self.cfg.control.heartbeat_interval_s
        next_hb = time.monotonic() + hb_every
        # Throughput is a rate over the metrics window: one batch can take longer than a second on CPU.
        metrics_every = max(1.0, self.cfg.metrics.window_s)
        next_metrics = time.monotonic() + metrics_every
        while not self._stop.is_set():
            # Messages for a bounded time, then the timers, on every turn whatever the traffic.
            turn_end = time.monotonic() + _LOOP_BUDGET_S
            timeout_ms = 20
            while poller.poll(timeout=timeout_ms):
                self._receive_one()
                timeout_ms = 0
                if time.monotonic() >= turn_end:
                    break
            self._drain_link_events()
            self._release_deferred(time.monotonic())
            self._dispatch()
            now = time.monotonic()
            if now >= next_hb:
                next_hb = now + hb_every
                self._heartbeat_and_reap(now)
                self._sockets.reload_authorized()  # a revoked client key stops connecting
            if now >= next_metrics:
                next_metrics = now + metrics_every
                self._push_metrics(now)
        if self._capture_error is not None:
            raise RuntimeError(f"capture thread failed: {self._capture_error}") from self._capture_error

    def _send(self, identity: bytes, msg: P.Message) -> None:
        try:
            self._sock.send_multipart([identity, msg.encode()], flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("control send to %r dropped (peer not reading)", identity[:16])

    def _receive_one(self) -> None:
        frames = self._sock.recv_multipart()
        identity = frames[0]
        reg = self._regs.get(identity)
        now = time.monotonic()
        # Charged before anything is decoded: a flooding peer's excess is dropped unread.
        budget = self._registered_budget if reg is not None else self._stranger_budget
        if not budget.allow(identity, now, cost=1.0 + sum(len(f) for f in frames[1:]) / 65536):
            return
        if len(frames) != 2:
            self._complain(identity, reg, P.E_MALFORMED, f"a control message is exactly one frame, got {len(frames) - 1}")
            return
        try:
            P.check_inbound_size(frames[1])
            msg = P.decode(frames[1], max_bytes=self.cfg.control.max_message_bytes)
        except P.ProtocolError as exc:
            self._complain(identity, reg, exc.code, exc.message)
            return
        if reg is not None:
            reg.last_seen = now
        if isinstance(msg, P.Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, P.StatusRequest):
            if proof_ok(status_proof(self._control_key), msg.auth):
                self._send(identity, self._status())
            else:
                self._complain(identity, reg, P.E_AUTH, "STATUS needs the run's status key (<run_dir>/auth/status.key)")
        elif reg is None:
            self._complain(identity, reg, P.E_STATE, f"{msg.TYPE} before HELLO: register first")
        elif isinstance(msg, P.Request):
            reg.credits = min(reg.credits + msg.credits, P.MAX_CREDITS)
            if isinstance(reg.link, PoolLink):
                reg.link.paired = True  # a drafter asks for batches only once it has mapped the pool
        elif isinstance(msg, P.Ack):
            for batch_id in msg.batch_ids:
                if batch_id in reg.inflight:
                    reg.inflight.discard(batch_id)
                    reg.last_progress = now
                held = reg.held.pop(batch_id, None)
                if held is not None:
                    self.scheduler.release(held)
            reg.step = msg.step
            reg.checkpoint_step = msg.checkpoint_step
        elif isinstance(msg, P.Heartbeat):
            reg.step = max(reg.step, msg.step)
        elif isinstance(msg, P.Bye):
            logger.info("[bye] drafter %s (epoch %d): %s", reg.drafter_id, reg.epoch, msg.reason or "no reason")
            self._drop(reg, "said BYE")
        else:
            self._complain(identity, reg, P.E_STATE, f"{msg.TYPE} is not something a drafter sends")

    def _complain(self, identity: bytes, reg: Registration | None, code: str, message: str) -> None:
        """Reply ERROR; log only the first offence of each peer so a flood cannot flood the log."""
        self._send(identity, P.Error(code, message))
        if identity in self._offenders:
            return
        if len(self._offenders) >= 4096:  # bounded memory under a flood of fresh identities
            self._offenders.clear()
        self._offenders.add(identity)
        who = f"drafter {reg.drafter_id}" if reg else f"peer {identity[:24]!r}"
        logger.warning("[bad-message] %s: %s (%s); later offences of this peer are not logged", who, message, code)

    def _on_hello(self, identity: bytes, hello: P.Hello) -> None:
        if self._hello_refused(identity, hello):
            return
        for old in list(self._regs.values()):
            if old.drafter_id == hello.drafter_id or old.identity == identity:
                self._drop(old, "replaced by a new registration")
        self._epoch_counter += 1
        epoch = self._epoch_counter
        link, prefix, shm = self._new_link(hello.drafter_id, epoch)
        now = time.monotonic()
        reg = Registration(identity, hello.drafter_id, hello.group, epoch, link, hello.pid, now, now, now,
                           step=hello.step)
        self._regs[identity] = reg
        self.scheduler.join(hello.group, hello.covered_watermark, hello.covered_extra)
        link.start()
        self._send(identity, self._welcome(prefix, epoch, shm))
        logger.info(
            "[hello] drafter %s (group %s, pid %d) registered as epoch %d; covers < %d (+%d more), step %d",
            hello.drafter_id, hello.group, hello.pid, epoch, hello.covered_watermark, len(hello.covered_extra), hello.step,
        )

    def _hello_refused(self, identity: bytes, hello: P.Hello) -> bool:
        """Answer ERROR and return True when this HELLO may not register."""
        # First the proof (cheap, and nothing below is told to a stranger), then the rate limit.
        if not proof_ok(hello_proof(self._control_key, hello.drafter_id), hello.auth):
            self._complain(identity, None, P.E_AUTH,
                           f"HELLO for drafter {hello.drafter_id} without the run's control key "
                           f"(<run_dir>/auth/control.key, same run directory as the target)")
            return True
        now = time.monotonic()
        if now - self._last_hello.get(hello.drafter_id, -1e9) < 1.0:
            self._complain(identity, None, P.E_BUSY, f"drafter {hello.drafter_id} re-registers too fast; retry in a second")
            return True
        known = {r.drafter_id for r in self._regs.values()}
        if hello.drafter_id not in known and len(known) >= self.cfg.control.max_drafters:
            self._complain(identity, None, P.E_BUSY, f"target already serves control.max_drafters={len(known)} drafters")
            return True
        self._last_hello[hello.drafter_id] = now
        if len(self._last_hello) > 4 * self.cfg.control.max_drafters:
            self._last_hello = {k: v for k, v in self._last_hello.items() if now - v < 1.0}
        expected = self.cfg.shared_hash()
        if hello.config_hash != expected:
            return self._refuse(identity, P.E_CONFIG, (
                f"config hash mismatch: drafter {hello.drafter_id} has {hello.config_hash}, target has {expected}; "
                "start both from the same config file ([data] and [target] must match)"))
        if hello.transport != self.transport:
            return self._refuse(identity, P.E_TRANSPORT, (
                f"transport mismatch: drafter {hello.drafter_id} uses {hello.transport}, target uses {self.transport}"))
        if message := same_gpu_refusal(self.transport, gpu_uuid(self.device), hello.gpu_uuid, hello.drafter_id):
            return self._refuse(identity, P.E_TRANSPORT, message)
        total = self.scheduler.total_batches
        if total is not None and not (hello.covered_watermark <= total and all(i < total for i in hello.covered_extra)):
            self._complain(identity, None, P.E_RANGE, f"HELLO coverage lies beyond the plan's {total} batches")
            return True
        return False

    def _refuse(self, identity: bytes, code: str, message: str) -> bool:
        """A refusal an operator must see every time (a misconfigured drafter, not a flood)."""
        logger.warning("[hello] refused %s", message)
        self._send(identity, P.Error(code, message))
        return True

    def _new_link(self, drafter_id: str, epoch: int) -> tuple[DrafterLink | PoolLink, str, dict]:
        """The registration's data plane: (link, WELCOME.pair_prefix, WELCOME's shm fields)."""
        name = f"{drafter_id}-{epoch}"
        if self._shm_pool is not None:
            pool = self._shm_pool
            shm = {"shm_name": pool.name, "shm_slot_bytes": pool.slot_bytes, "shm_slots_per_bucket": pool.slots_per_bucket,
                   "shm_weights_name": self._shm_weights.name}
            return PoolLink(name, pool.name), pool.name, shm
        # Unguessable: only the drafter told in WELCOME can join (or spoof) this pair.
        prefix = f"pair/{secrets.token_hex(16)}/{epoch}"
        link = DrafterLink(
            name=name, transport=self.transport,
            store_address=(self.cfg.control.store_host, self.cfg.control.store_port), prefix=prefix,
            device=self.device, timeout_s=self.cfg.transport.timeout_s, weights=self.weights_buf,
            events=self._events, local_host=local_address_towards(self.cfg.control.store_host),
        )
        return link, prefix, {}

    def _welcome(self, prefix: str, epoch: int, shm: dict) -> P.Welcome:
        cfg_model = self.loaded.config
        head_dim = getattr(cfg_model, "head_dim", None) or cfg_model.hidden_size // cfg_model.num_attention_heads
        rope_theta = getattr(cfg_model, "rope_theta", None)
        if rope_theta is None:
            rope_theta = (getattr(cfg_model, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return P.Welcome(
            model_id=self.loaded.model_id,
            hidden_size=self.loaded.hidden_size,
            num_target_layers=self.loaded.num_layers,
            target_layer_ids=list(self.layer_ids),
            vocab_size=self.loaded.vocab_size,
            mask_token_id=self.mask_token_id,
            block_size=self.cfg.drafter.block_size,
            dtype=self.cfg.target.dtype,
            embed_tied=self.weights_layout.tied,
            target_arch={
                "num_attention_heads": int(cfg_model.num_attention_heads),
                "num_key_value_heads": int(getattr(cfg_model, "num_key_value_heads", cfg_model.num_attention_heads)),
                "head_dim": int(head_dim),
                "intermediate_size": int(cfg_model.intermediate_size),
                "rms_norm_eps": float(getattr(cfg_model, "rms_norm_eps", 1e-6)),
                "rope_theta": float(rope_theta),
                "max_position_embeddings": int(getattr(cfg_model, "max_position_embeddings", 4096)),
            },
            buckets=[list(s) for s in self.spec.shapes()],
            store_host=self.cfg.control.store_host,
            store_port=self.cfg.control.store_port,
            pair_prefix=prefix,
            registration_epoch=epoch,
            heartbeat_interval_s=self.cfg.control.heartbeat_interval_s,
            heartbeat_timeout_s=self.cfg.control.heartbeat_timeout_s,
            plan_batches=self.scheduler.total_batches or 0,
            token_ranking=self.token_ranking,
            batches_per_epoch=self.plan.batches_per_epoch,
            train_samples=len(self.dataset.train),
            data_fingerprint=self.data_fingerprint,
            gpu_uuid=gpu_uuid(self.device) if self.transport == "nccl" else "",
            **shm,
        )

    def _drop(self, reg: Registration, why: str) -> None:
        if self._regs.pop(reg.identity, None) is None:
            return
        self._registered_budget.forget(reg.identity)
        reg.link.stop()
        self._stopped_links = [l for l in self._stopped_links if l.is_alive()] + [reg.link]
        self.scheduler.leave(reg.group, sorted(reg.inflight))
        pool = self._shm_pool
        reader_alive = pool is not None and pool.reader_alive(reg.drafter_id, reg.epoch)
        if pool is not None:
            pool.forget_reader(reg.drafter_id, reg.epoch)  # after the check: the file is what it asks
        if reg.held:
            # A live drafter may still be inside a step on these slots: keep them a heartbeat
            # timeout longer unless it is gone (its liveness lock is free: the kernel dropped it).
            grace = self.cfg.control.heartbeat_timeout_s if reader_alive else 0.0
            self._deferred_release.append((time.monotonic() + grace, list(reg.held.values())))
            reg.held.clear()
        logger.info(
            "[drop] drafter %s (epoch %d) %s; %d unacknowledged batches go back to group %s",
            reg.drafter_id, reg.epoch, why, len(reg.inflight), reg.group,
        )

    def _release_deferred(self, now: float) -> None:
        due = [item for item in self._deferred_release if item[0] <= now]
        if not due:
            return
        self._deferred_release = [item for item in self._deferred_release if item[0] > now]
        for _, readies in due:
            for ready in readies:
                self.scheduler.release(ready)

    def _drain_link_events(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if event.ready is not None:
                if event.done_event is not None:
                    event.ready.reader_events.append(event.done_event)  # before the release makes it reusable
                self.scheduler.release(event.ready)
            if event.kind == "sent":
                with self._stats_lock:
                    self._bytes_sent += event.nbytes
                    self._send_s += event.seconds
            elif event.kind == "failed":
                reg = next((r for r in self._regs.values() if r.link is event.link), None)
                if reg is not None:
                    self._drop(reg, f"data plane failed ({event.error})")

    def _dispatch(self) -> None:
        for reg in list(self._regs.values()):
            while reg.credits > 0:
                ready = self.scheduler.take_for(reg.group)
                if ready is None:
                    break
                if ready.shm_slot >= 0:
                    # shm: the drafter copies the pool slot out; it stays pinned until the ACK.
                    tag, slot = ready.shm_tag, ready.shm_slot
                    reg.held[ready.plan_index] = ready
                    with self._stats_lock:
                        self._bytes_sent += ready.layout.nbytes  # handed over without a copy
                else:
                    tag, slot = reg.next_tag, -1
                    reg.next_tag = tag + 1 if tag < (1 << 30) else 1
                layout = ready.layout
                self._send(reg.identity, P.Batch(
                    batch_id=ready.plan_index, epoch=ready.epoch, bucket=ready.bucket, sample_ids=ready.sample_ids,
                    batch_size=layout.batch_size, seq_len=layout.seq_len, feature_dim=layout.feature_dim,
                    dtype=self.cfg.target.dtype, nbytes=layout.nbytes, tag=tag, num_tokens=ready.num_tokens,
                    slot=slot,
                ))
                if slot < 0:
                    reg.link.enqueue(ready, tag)
                reg.credits -= 1
                if not reg.inflight:
                    reg.last_progress = time.monotonic()  # the ACK clock starts with the first batch held
                reg.inflight.add(ready.plan_index)
            if not reg.done_sent and not reg.inflight and self.scheduler.finished(reg.group):
                reg.done_sent = True
                self._send(reg.identity, P.Done(batches_served=self.scheduler.total_batches or 0))
                logger.info("[done] group %s has been served every batch; told drafter %s", reg.group, reg.drafter_id)

    def _heartbeat_and_reap(self, now: float) -> None:
        timeout = self.cfg.control.heartbeat_timeout_s
        ack_timeout = self.cfg.control.ack_timeout_s
        # A capture stuck inside one batch is reported, so drafters do not wait on it forever.
        stalled = now - self._capture_tick
        stalled = round(stalled, 1) if stalled > self.cfg.transport.timeout_s else 0.0
        for reg in list(self._regs.values()):
            if not reg.link.paired and now - reg.registered_at < self.cfg.transport.timeout_s:
                # Still building its model / warming up / forming the pair: bounded by the
                # data-plane timeout instead (a pair that never forms fails its link).
                continue
            if now - reg.last_seen > timeout:
                self._drop(reg, f"silent for {now - reg.last_seen:.1f}s (heartbeat timeout {timeout:.1f}s)")
            elif reg.inflight and now - reg.last_progress > ack_timeout:
                self._drop(reg, f"held {len(reg.inflight)} batches for {now - reg.last_progress:.0f}s without an ACK "
                                f"(control.ack_timeout_s {ack_timeout:.0f}s)")
            else:
                self._send(reg.identity, P.Heartbeat(step=self._captured_batches, capture_stalled_s=stalled))

    # ---------------------------------------------------------------- observability
    def _push_metrics(self, now: float) -> None:
        """Window values (deltas since the last push) plus running totals; all host-side numbers."""
        with self._stats_lock:
            totals = (self._captured_batches, self._forward_s, self._captured_tokens, self._padded_tokens,
                      self._bytes_sent, self._send_s, self.scheduler.blocked_s, self._forward_batches,
                      self._cached_batches)
        batches, forward_s, tokens, padded, sent, send_s, blocked_s, forwards, cached = (
            a - b for a, b in zip(totals, self._last_totals)
        )
        elapsed = max(now - self._window_start, 1e-9)
        self._last_totals, self._window_start = totals, now
        self._tokens_per_s = tokens / elapsed
        depth, per_bucket = self.scheduler.depths()
        values = {
            "tokens_per_s": self._tokens_per_s,
            "batches_per_s": batches / elapsed,
            "forward_ms": 1000.0 * forward_s / forwards if forwards else 0.0,
            "cache_hit_frac": cached / batches if batches else 0.0,
            "feature_cache_gb": self.feature_cache.nbytes / 1e9,
            "padding_frac": 1.0 - tokens / padded if padded else 0.0,
            "send_gbps": sent / send_s / 1e9 if send_s > 0 else 0.0,
            "bytes_sent": totals[4],
            "tokens_total": totals[2],
            "backpressure_frac": blocked_s / elapsed,
            "queue_depth": depth,
            "drafters_connected": len(self._regs),
        }
        for i, d in enumerate(per_bucket):
            values[f"bucket_depth/{i}"] = d
        self._metrics.send(values, step=totals[0])

    def _status(self) -> P.Status:
        now = time.monotonic()
        depth, per_bucket = self.scheduler.depths()
        return P.Status(
            uptime_s=now - self._started_at,
            tokens_per_s=self._tokens_per_s,
            queue_depth=depth,
            bucket_depths=per_bucket,
            drafters=[
                {
                    "id": r.drafter_id, "group": r.group, "epoch": r.epoch, "pid": r.pid, "step": r.step,
                    "checkpoint_step": r.checkpoint_step, "inflight": len(r.inflight),
                    "heartbeat_age_s": round(now - r.last_seen, 2),
                    "state": _drafter_state(r),
                }
                for r in self._regs.values()
            ],
        )

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        self._stop.set()
        if hasattr(self, "scheduler"):
            self.scheduler.close()
        for reg in list(self._regs.values()):
            self._send(reg.identity, P.Bye(reason="target shutting down"))
            self._drop(reg, "target shutting down")
        # Link threads own process groups; let them finish before the interpreter does
        # (one still forming a pair may sit in an uninterruptible wait of up to transport.timeout_s,
        # which the config keeps below stop_timeout_s; the rest of the shutdown needs little).
        deadline = time.monotonic() + self.cfg.target.stop_timeout_s - 5
        threads = [t for t in (self._capture_thread, *self._stopped_links) if t is not None]
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.threads_left = [t.name for t in threads if t.is_alive()]
        if self._shm_pool is not None:  # a capture still running keeps its own views of the mapping
            self._shm_pool.close()
            self._shm_pool = None
        if self._shm_weights is not None:
            self._shm_weights.unlink()
            self._shm_weights.close()
            self._shm_weights = None
        if hasattr(self, "_metrics"):
            self._metrics.close()
        if self._sock is not None:
            self._sock.close(linger=200)
            self._sock = None
        self._sockets.close()
        self._ctx.term()


def _drafter_state(reg: Registration) -> str:
    """One word for STATUS: where this registration is in its life."""
    if reg.done_sent:
        return "done"
    if not reg.link.paired:
        return "forming pair"
    return "training"
