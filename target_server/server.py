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

The decisions (who may register, who gets which batch, drop/redo, DONE) are
the sans-I/O :class:`target_server.coordinator.Coordinator`'s; the transport is
behind :mod:`target_server.data_plane`. This module is the shell: sockets,
threads, the clock, the model and the metrics.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Iterable

import torch
import zmq

from common import protocol as P
from common.auth import load_or_create_control_key
from common.config import Config
from common.devices import resolve_dtype, use_device
from common.layer_ids import build_target_layer_ids
from common.metric_names import Target, target_source
from common.plan_shard import Shard, plan_fingerprint, topology_id
from common.metrics_client import MetricsPusher
from common.sockets import SecurityError, SocketFactory, check_bind
from common.packing import BatchLayout, WeightsLayout, dtype_from_name
from common.progress import Progress
from common.streams import SideStream
from common.transport import TransportError, gpu_uuid, host_store
from target_server.admission import PeerRateLimiter
from target_server.bucketing import BatchPlan, BucketSpec, pack_batch
from target_server.capture import LayerCapture
from target_server.coordinator import Admission, Coordinator
from target_server.data import build_dataset, fingerprint, token_ranking
from target_server.data_plane import DataPlane, Endpoint, make_data_plane
from target_server.feature_cache import FeatureCache
from target_server.memory_headroom import available_bytes
from common.model_loader import embedding_weights, final_norm_weight, load_target, pick_mask_token_id
from target_server.scheduler import BatchScheduler, ReadyBatch

logger = logging.getLogger(__name__)
# STATUS's tokens/s (dflash-status, the demo's and make quality's progress lines) is over the last
# minute: one 10-s metrics window holds one or two of a CPU target's 4-6-s batches, so its rate
# swung between about 150 and 300 from one progress line to the next.
STATUS_RATE_SPAN_S = 60.0


def rate_over(history: Iterable[tuple[float, int]], span_s: float) -> float:
    """Units a second between the newest ``(time, total)`` point and the newest one ``span_s`` before it
    (the oldest point where the history is shorter)."""
    points = list(history)
    (t1, n1), (t0, n0) = points[-1], points[0]
    for t, n in reversed(points):
        if t1 - t >= span_s:
            t0, n0 = t, n
            break
    return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


# Inbound queue per peer: a drafter has a few messages in flight (ACK, REQUEST, HEARTBEAT);
# beyond this a flooding peer's own sends block instead of growing our memory.
_RCVHWM = 128
# Message budgets per peer (messages/s, burst); a frame costs 1 plus 1 per 64 KiB.
_REGISTERED_BUDGET = (1000.0, 2000.0)
_STRANGER_BUDGET = (20.0, 40.0)
_LOOP_BUDGET_S = 0.02  # control-loop time spent on messages before timers run, every turn


class StartupError(RuntimeError):
    """A user-fixable start-up failure (port taken, bad model, bad data); the message says what to do."""


class TargetServer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = torch.device(cfg.target.device)
        # The wire dtype of features and weights: target.dtype with "auto" resolved on this device (peers
        # only ever see a concrete name, in WELCOME and in every batch message).
        self.dtype_name = resolve_dtype(cfg.target.dtype, cfg.target.device)
        self.dtype = dtype_from_name(self.dtype_name)
        self.transport = cfg.transport.resolve(cfg.target.device)
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sockets = SocketFactory(self._ctx, cfg.security.curve_dir, cfg.security.curve_client)
        self._sock: zmq.Socket | None = None
        self._store = None
        self.plane: DataPlane | None = None
        self.coord: Coordinator | None = None
        self._registered_budget = PeerRateLimiter(*_REGISTERED_BUDGET)
        self._stranger_budget = PeerRateLimiter(*_STRANGER_BUDGET)
        self._control_key = ""
        self._capture_tick = time.monotonic()  # the capture thread's last sign of progress
        self._started_at = time.monotonic()
        self._capture_thread: threading.Thread | None = None
        self._capture_error: BaseException | None = None
        self.threads_left: list[str] = []
        # Host-side counters written by the capture thread, read by the control thread.
        self._stats_lock = threading.Lock()
        self._captured_batches = 0
        self._forward_batches = 0  # batches that ran the model (the rest came from the feature cache)
        self._cached_batches = 0
        self.feature_cache = FeatureCache(int(cfg.target.feature_cache_gb * 1e9),
                                          int(cfg.target.feature_cache_keep_free_gb * 1e9),
                                          lambda: available_bytes(self.device))
        self._captured_tokens = 0
        self._padded_tokens = 0
        self._forward_s = 0.0
        self._bytes_sent = 0
        self._send_s = 0.0
        self._window_start = time.monotonic()
        self._last_totals: tuple = (0, 0.0, 0, 0, 0, 0.0, 0.0, 0, 0)
        # (time, tokens captured so far) at each metrics push, for STATUS's tokens/s.
        self._token_history: deque[tuple[float, int]] = deque([(self._window_start, 0)], maxlen=256)
        self._status_tokens_per_s = 0.0

    # ---------------------------------------------------------------- start-up
    def start(self) -> None:
        use_device(self.device)  # before any CUDA work (the current device is per thread; new ones start on GPU 0)
        cfg = self.cfg
        if cfg.target.threads:
            torch.set_num_threads(cfg.target.threads)
        self._bind()
        self._metrics = MetricsPusher(cfg.metrics.address, target_source(cfg.target.replica, cfg.target.replicas),
                                      sockets=self._sockets)
        self._control_key = load_or_create_control_key(cfg.run.path)
        self._load_model()
        self._load_data()
        self._build_data_plane()
        self._build_scheduler()
        self._build_coordinator()
        self._warm_up()
        self._capture_thread = threading.Thread(target=self._capture_loop, name="capture", daemon=True)
        self._capture_thread.start()
        self._started_at = time.monotonic()
        logger.info("[startup] serving on %s (store %s:%d)", cfg.control.address, cfg.control.store_host, cfg.control.store_port)

    def _bind(self) -> None:
        """The control socket and the data-plane store, first: a taken port fails in a second, not after loading the model."""
        cfg = self.cfg
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

    def _load_model(self) -> None:
        """The target, its captured layers, mask token and layer capture."""
        cfg = self.cfg
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
        final_norm = final_norm_weight(loaded.model)
        self.final_norm_weight = [] if final_norm is None else final_norm[0].float().cpu().tolist()
        logger.info(
            "[startup] target %s (%s): %d layers, hidden %d, vocab %d; capturing layers %s; mask token %d; transport %s",
            loaded.model_id, self.dtype_name, loaded.num_layers, loaded.hidden_size, loaded.vocab_size, self.layer_ids,
            self.mask_token_id, self.transport,
        )

    def _load_data(self) -> None:
        """Tokenized data, its fingerprint and token ranking, the bucket shapes and the epoch plan."""
        cfg = self.cfg
        self.dataset = build_dataset(
            self.loaded.tokenizer, cfg.data.source, max_seq_len=cfg.data.max_seq_len, seed=cfg.data.seed,
            heldout_fraction=cfg.data.heldout_fraction, max_samples=cfg.data.max_samples,
            data_format=cfg.data.format, chat_template_kwargs=cfg.data.chat_template_kwargs,
            num_proc=cfg.data.num_proc, cache_dir=cfg.data.cache_dir,
        )
        self.token_ranking = token_ranking(self.dataset.train, self.loaded.vocab_size, P.TOKEN_RANKING_MAX)
        self.data_fingerprint = fingerprint(self.dataset, self.loaded.tokenizer)
        logger.info("[data] fingerprint %s (token ids, masks, tokenizer, chat template)", self.data_fingerprint)
        self.spec = BucketSpec(tuple(cfg.data.bucket_lengths), cfg.data.tokens_per_batch)
        self.plan = BatchPlan(self.dataset.train_lengths(), self.spec, cfg.data.seed)
        self._total_batches = self.plan.batches_per_epoch * cfg.data.num_epochs if cfg.data.num_epochs else None
        self.layouts = [BatchLayout(b, t, self.feature_dim, self.dtype) for b, t in self.spec.shapes()]

    def _build_data_plane(self) -> None:
        """The frozen weights in one buffer and the transport's data plane around them."""
        cfg = self.cfg
        embed, head, tied = embedding_weights(self.loaded.model)
        self.weights_layout = WeightsLayout(self.loaded.vocab_size, self.loaded.hidden_size, tied, self.dtype)
        self.weights_buf = self.weights_layout.allocate(self.device)
        w_embed, w_head = self.weights_layout.views(self.weights_buf)
        w_embed.copy_(embed)
        if not tied:
            w_head.copy_(head)
        try:
            self.plane = make_data_plane(
                transport=self.transport, device=self.device, layouts=self.layouts,
                ready_batches=cfg.target.ready_batches, shm_slots_per_bucket=cfg.transport.shm_slots_per_bucket,
                store_host=cfg.control.store_host, store_port=cfg.control.store_port,
                timeout_s=cfg.transport.timeout_s, weights=self.weights_buf,
            )
        except TransportError as exc:
            raise StartupError(str(exc)) from None

    def _build_scheduler(self) -> None:
        """This replica's shard of the plan, the scheduler, the plan fingerprint and topology id."""
        cfg = self.cfg
        self.shard = Shard(cfg.target.replica, cfg.target.replicas)
        self.scheduler = BatchScheduler(
            bucket_of=lambda i: self.plan.batch(i).bucket,
            layouts=self.layouts,
            slots_per_bucket=cfg.target.ready_batches,
            total_batches=self._total_batches,
            device=self.device,
            buffers=self.plane.batch_buffers(),
            shard=self.shard,
        )
        self.plan_fingerprint = plan_fingerprint(self.data_fingerprint, self.plan.batches_per_epoch, self._total_batches,
                                                 [list(s) for s in self.spec.shapes()], cfg.data.seed)
        self.topology_id = topology_id(self.plan_fingerprint, self.shard.replicas)
        logger.info(
            "[startup] plan: %d batches per epoch, buckets %s, epochs %s (plan %s); replica %d of %d serves every "
            "plan index i with i mod %d == %d (topology %s)",
            self.plan.batches_per_epoch, self.spec.shapes(), cfg.data.num_epochs or "unlimited", self.plan_fingerprint,
            self.shard.replica, self.shard.replicas, self.shard.replicas, self.shard.replica, self.topology_id,
        )

    def _build_coordinator(self) -> None:
        """The sans-I/O coordinator with what a HELLO must match."""
        cfg = self.cfg
        self.coord = Coordinator(
            admission=Admission(
                control_key=self._control_key, config_hash=cfg.shared_hash(), transport=self.transport,
                gpu_uuid=gpu_uuid(self.device), max_drafters=cfg.control.max_drafters,
                heartbeat_timeout_s=cfg.control.heartbeat_timeout_s, ack_timeout_s=cfg.control.ack_timeout_s,
                pair_timeout_s=cfg.transport.timeout_s, replica=self.shard.replica, replicas=self.shard.replicas,
                topology_id=self.topology_id,
            ),
            scheduler=self.scheduler, data_plane=self.plane, welcome=self._welcome,
        )

    def _warm_up(self) -> None:
        """Run every bucket shape once so allocator/kernel set-up is not in the first measured batch.

        Not on a CPU: there a shape's first forward pass takes what the next one does, and the
        drafters would wait for nothing (10 s for the demo's three shapes)."""
        if self.device.type == "cpu":
            return
        start = time.perf_counter()
        with Progress("target warm-up", total=len(self.layouts), unit="shapes", every_s=10.0, logger=logger) as progress:
            for layout in self.layouts:
                buf = layout.allocate(self.device)
                features, ids, _, _ = layout.views(buf)
                self.capture.run(ids.long(), features)
                progress.update()
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
                try:
                    ready, elapsed = self._capture_batch(stream, index, buf, pad_id)
                except Exception:
                    self.scheduler.abandon(index, buf)
                    raise
                self.scheduler.publish(ready)
                self._count_captured(ready, elapsed)
        except BaseException as exc:  # surfaced by the control loop, which exits non-zero
            self._capture_error = exc
            logger.exception("capture thread failed")
            self._stop.set()

    def _capture_batch(self, stream: SideStream, index: int, buf: torch.Tensor,
                       pad_id: int) -> tuple[ReadyBatch, float]:
        """Fill ``buf`` with plan batch ``index`` (from the feature cache or a forward pass) and
        publish it to the data plane; returns the batch (``from_cache`` says which) and the seconds taken."""
        planned = self.plan.batch(index)
        layout = self.layouts[planned.bucket]
        self.plane.begin_write(planned.bucket, buf)
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
                self._cache_features(planned.sample_ids, [min(len(s), layout.seq_len) for s in samples], features)
        ready_event = stream.record()
        elapsed = time.perf_counter() - start
        pool_slot, shm_tag = self.plane.publish(planned.bucket, buf)
        ready = ReadyBatch(index, planned.epoch, planned.bucket, list(planned.sample_ids), real, buf, layout,
                           from_cache=cached, ready_event=ready_event, shm_slot=pool_slot, shm_tag=shm_tag)
        return ready, elapsed

    def _cache_features(self, sample_ids: list[int], lengths: list[int], features: torch.Tensor) -> None:
        cache = self.feature_cache
        was_full = cache.full
        cache.store(sample_ids, lengths, features)
        if cache.full and not was_full:
            why = (f"{cache.stopped_for_memory / 1e9:.1f} GB of memory were left and it keeps "
                   f"target.feature_cache_keep_free_gb = {self.cfg.target.feature_cache_keep_free_gb:g} free"
                   if cache.stopped_for_memory is not None else
                   f"target.feature_cache_gb = {self.cfg.target.feature_cache_gb:g} is spent")
            logger.warning("[cache] the feature cache stops growing at %.2f GB (%d samples): %s; "
                           "batches with other samples run the target's forward pass in every epoch",
                           cache.nbytes / 1e9, len(cache), why)

    def _count_captured(self, ready: ReadyBatch, elapsed: float) -> None:
        with self._stats_lock:
            self._captured_batches += 1
            self._captured_tokens += ready.num_tokens
            self._padded_tokens += ready.layout.batch_size * ready.layout.seq_len
            if ready.from_cache:
                self._cached_batches += 1
            else:
                self._forward_s += elapsed
                self._forward_batches += 1

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
            now = time.monotonic()
            self._drain_link_events(now)
            self.coord.release_due(now)
            self._send_all(self.coord.dispatch(now, self.dtype_name))
            if now >= next_hb:
                next_hb = now + hb_every
                self._heartbeat_and_reap(now)
                self._sockets.reload_authorized()  # a revoked client key stops connecting
            if now >= next_metrics:
                next_metrics = now + metrics_every
                self._push_metrics(now)
        if self._capture_error is not None:
            raise RuntimeError(f"capture thread failed: {self._capture_error}") from self._capture_error

    def _send_all(self, outbox: list[tuple[bytes, P.Message]]) -> None:
        for identity, msg in outbox:
            try:
                self._sock.send_multipart([identity, msg.encode()], flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("control send to %r dropped (peer not reading)", identity[:16])

    def _receive_one(self) -> None:
        frames = self._sock.recv_multipart()
        identity = frames[0]
        now = time.monotonic()
        # Charged before anything is decoded: a flooding peer's excess is dropped unread.
        budget = self._registered_budget if self.coord.is_registered(identity) else self._stranger_budget
        if not budget.allow(identity, now, cost=1.0 + sum(len(f) for f in frames[1:]) / 65536):
            return
        if len(frames) != 2:
            self._send_all(self.coord.complain(
                identity, P.E_MALFORMED, f"a control message is exactly one frame, got {len(frames) - 1}"))
            return
        try:
            P.check_inbound_size(frames[1])
            msg = P.decode(frames[1], max_bytes=self.cfg.control.max_message_bytes)
        except P.ProtocolError as exc:
            self._send_all(self.coord.complain(identity, exc.code, exc.message))
            return
        self._send_all(self.coord.handle(identity, msg, now, self._status))

    def _welcome(self, endpoint: Endpoint, epoch: int) -> P.Welcome:
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
            dtype=self.dtype_name,
            embed_tied=self.weights_layout.tied,
            target_arch=P.TargetArch(
                num_attention_heads=int(cfg_model.num_attention_heads),
                num_key_value_heads=int(getattr(cfg_model, "num_key_value_heads", cfg_model.num_attention_heads)),
                head_dim=int(head_dim),
                intermediate_size=int(cfg_model.intermediate_size),
                rms_norm_eps=float(getattr(cfg_model, "rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(getattr(cfg_model, "max_position_embeddings", 4096)),
            ),
            buckets=[list(s) for s in self.spec.shapes()],
            store_host=self.cfg.control.store_host,
            store_port=self.cfg.control.store_port,
            registration_epoch=epoch,
            heartbeat_interval_s=self.cfg.control.heartbeat_interval_s,
            heartbeat_timeout_s=self.cfg.control.heartbeat_timeout_s,
            plan_batches=self.scheduler.total_batches or 0,
            token_ranking=self.token_ranking,
            batches_per_epoch=self.plan.batches_per_epoch,
            train_samples=len(self.dataset.train),
            data_fingerprint=self.data_fingerprint,
            replica=self.shard.replica,
            replicas=self.shard.replicas,
            plan_fingerprint=self.plan_fingerprint,
            topology_id=self.topology_id,
            final_norm_weight=self.final_norm_weight,
            **endpoint.welcome_fields(),
        )

    def _drain_link_events(self, now: float) -> None:
        while True:
            try:
                event = self.plane.events.get_nowait()
            except queue.Empty:
                return
            if event.kind == "sent":
                with self._stats_lock:
                    self._bytes_sent += event.nbytes
                    self._send_s += event.seconds
            self.coord.on_link_event(event, now)

    def _heartbeat_and_reap(self, now: float) -> None:
        # A capture stuck inside one batch is reported, so drafters do not wait on it forever.
        stalled = now - self._capture_tick
        stalled = round(stalled, 1) if stalled > self.cfg.transport.timeout_s else 0.0
        self._send_all(self.coord.heartbeat_and_reap(now, self._captured_batches, stalled))

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
        self._token_history.append((now, totals[2]))
        self._status_tokens_per_s = rate_over(self._token_history, STATUS_RATE_SPAN_S)
        depth, per_bucket = self.scheduler.depths()
        values = {
            Target.TOKENS_PER_S: tokens / elapsed,
            Target.BATCHES_PER_S: batches / elapsed,
            Target.FORWARD_MS: 1000.0 * forward_s / forwards if forwards else 0.0,
            Target.CACHE_HIT_FRAC: cached / batches if batches else 0.0,
            Target.FEATURE_CACHE_GB: self.feature_cache.nbytes / 1e9,
            Target.PADDING_FRAC: 1.0 - tokens / padded if padded else 0.0,
            Target.SEND_GBPS: sent / send_s / 1e9 if send_s > 0 else 0.0,
            Target.BYTES_SENT: totals[4],
            Target.TOKENS_TOTAL: totals[2],
            Target.BACKPRESSURE_FRAC: blocked_s / elapsed,
            Target.QUEUE_DEPTH: depth,
            Target.DRAFTERS_CONNECTED: len(self.coord.regs),
        }
        for i, d in enumerate(per_bucket):
            values[Target.BUCKET_DEPTH(i)] = d
        self._metrics.send(values, step=totals[0])

    def _status(self) -> P.Status:
        now = time.monotonic()
        depth, per_bucket = self.scheduler.depths()
        return P.Status(
            uptime_s=now - self._started_at,
            tokens_per_s=self._status_tokens_per_s,
            queue_depth=depth,
            bucket_depths=per_bucket,
            drafters=self.coord.status_rows(now),
        )

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        self._stop.set()
        if hasattr(self, "scheduler"):
            self.scheduler.close()
        endpoints = []
        if self.coord is not None:
            outbox = self.coord.close(time.monotonic())
            if self._sock is not None:
                self._send_all(outbox)
            endpoints = self.coord.stopped_endpoints
        # Paired link threads own process groups; let them finish before the interpreter does.
        # One still forming its pair has sent nothing and may sit in an uninterruptible wait of
        # up to transport.timeout_s (a drafter that re-sent its HELLO while this target was
        # loading leaves one behind): not waited for, it goes with the process.
        deadline = time.monotonic() + self.cfg.target.stop_timeout_s - 5
        forming = [e for e in endpoints if not e.paired]
        threads = [t for t in (self._capture_thread, *endpoints) if t is not None and t not in forming]
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.threads_left = [t.name for t in (*threads, *forming) if t.is_alive()]
        if self.plane is not None:
            self.plane.close()
            self.plane = None
        if hasattr(self, "_metrics"):
            self._metrics.close()
        if self._sock is not None:
            self._sock.close(linger=200)
            self._sock = None
        self._sockets.close()
        self._ctx.destroy(linger=0)  # a socket left open by a failure above must not block term() forever

