"""Every control-plane message, as small typed classes encoded with msgpack.

A message on the wire is one msgpack map ``{"type": <name>, "v": PROTOCOL_VERSION,
...fields}``. Decoding checks the version, the type and every field's type, and
raises :class:`ProtocolError` (with an error code a server can send back)
instead of handing half-valid data to the caller. Pickle is never used:
msgpack is configured to refuse anything but plain maps, lists, strings,
numbers, booleans and nil. Nested maps are typed too (:class:`Payload`): every
key known, every value checked, decoded into its dataclass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 4  # 2: WELCOME.block_size gone, typed payloads; 3: target replicas, ranks and generations; 4: WELCOME.final_norm_weight
TOKEN_RANKING_MAX = 32768  # ids in WELCOME.token_ranking (about 100 KB of msgpack)

# Value bounds, checked by decode() before a message reaches any state.
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # drafter ids (also file names)
MAX_RANKS = 4096  # ranks of one drafter (torchrun world size)
MAX_REPLICAS = 1024  # target replicas of one job
MAX_INT = 1 << 53  # counters, steps, plan indices: far beyond any run, exact in every JSON reader
MAX_PID = (1 << 22)  # Linux pid_max ceiling
MAX_CREDITS = 64  # batches one registration may hold at once
MAX_ACK_IDS = 1024  # a drafter ACKs at most its credits; room for several steps per ACK
MAX_COVERED_EXTRA = 65536  # plan indices a checkpoint covers beyond its watermark
MAX_COVERAGE_SPAN = 1 << 20  # how far past the watermark such an index may lie
MAX_TEXT = 256  # hashes, transports, reasons, proofs
MAX_ITEMS = MAX_COVERED_EXTRA  # longest list any message may hold: msgpack refuses longer ones unread
# Largest frame of each type a drafter or operator may send, checked before decoding.
INBOUND_BYTES = {
    "HELLO": 16 * 1024 + 9 * MAX_COVERED_EXTRA, "REQUEST": 256, "ACK": 1024 + 9 * MAX_ACK_IDS,
    "HEARTBEAT": 256, "BYE": 1024, "STATUS_REQUEST": 1024,
}

# Error codes carried by ERROR messages.
E_MALFORMED = "malformed"
E_UNKNOWN_TYPE = "unknown_type"
E_VERSION = "version_mismatch"
E_CONFIG = "config_mismatch"
E_TRANSPORT = "transport_mismatch"
E_STATE = "bad_state"
E_TOO_LARGE = "too_large"
E_BUSY = "busy"
E_RANGE = "out_of_range"
E_AUTH = "not_authorized"
E_STALE = "stale_generation"


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def optional(default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field added after version 1: left out of the frame while it holds its default.

    So a message that does not use the field encodes exactly as it did before the
    field existed, and peers built before it still decode it (no version bump).
    """
    return field(default=default, default_factory=default_factory, metadata={"omit_if_default": True})


@dataclass
class Payload:
    """A typed map nested inside a message: decoded from a msgpack map, every key known and typed."""


@dataclass
class TargetArch(Payload):
    """WELCOME.target_arch: what a fresh drafter copies from the target's architecture."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int


@dataclass
class DrafterStatus(Payload):
    """STATUS.drafters: one registration as the target sees it."""

    id: str
    rank: int
    generation: int
    epoch: int
    pid: int
    step: int
    checkpoint_step: int
    inflight: int
    heartbeat_age_s: float
    state: str  # "forming pair" | "training" | "done"


@dataclass
class Message:
    TYPE: ClassVar[str] = ""

    def encode(self) -> bytes:
        body = {"type": self.TYPE, "v": PROTOCOL_VERSION}
        body.update(dataclasses.asdict(self))
        for f in dataclasses.fields(self):
            if f.metadata.get("omit_if_default"):
                default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                if body[f.name] == default:
                    del body[f.name]
        return msgpack.packb(body, use_bin_type=True)

    def check_values(self) -> None:
        """Raise ProtocolError(E_RANGE) when a well-typed field holds a value no honest peer sends."""


@dataclass
class Hello(Message):
    """Drafter -> target: register (or re-register after a restart)."""

    TYPE: ClassVar[str] = "HELLO"
    drafter_id: str
    config_hash: str
    transport: str
    pid: int
    # This process is rank ``rank`` of the ``world_size`` ranks training drafter ``drafter_id``
    # (1 without torchrun); ``generation`` grows with every (re)start of the drafter (all ranks
    # of one start share it): a newer one resets what the target served the drafter to its coverage.
    rank: int
    world_size: int
    generation: int
    # The target replica the drafter meant to reach, and the topology (plan x replica count) its
    # coverage refers to ("" before its first WELCOME): a target that disagrees refuses.
    replica: int
    topology_id: str
    # This replica's local indices (common.plan_shard) the drafter's checkpoint already covers:
    # all below ``covered_watermark`` plus ``covered_extra``.
    covered_watermark: int = 0
    covered_extra: list[int] = field(default_factory=list)
    step: int = 0
    # Whether the target should send the frozen embedding and LM head: a rank takes them
    # from the first replica it registers with, not from every one.
    need_weights: bool = True
    # Proof that the sender holds the run's control key (common.auth): only the owner
    # of a drafter id can register it, so a stranger cannot take over a live drafter.
    auth: str = optional("")
    # The drafter's GPU (torch.cuda.get_device_properties(d).uuid) when it uses nccl: two
    # ranks of one pair on the same physical GPU are refused by NCCL, so the target refuses first.
    gpu_uuid: str = optional("")

    def check_values(self) -> None:
        _require(NAME.fullmatch(self.drafter_id) is not None, f"HELLO.drafter_id must match {NAME.pattern}")
        _require(0 < self.world_size <= MAX_RANKS and 0 <= self.rank < self.world_size,
                 f"HELLO needs 0 <= rank < world_size <= {MAX_RANKS}")
        _require(0 <= self.generation < MAX_INT, "HELLO.generation must be >= 0")
        _require(0 <= self.replica < MAX_REPLICAS, f"HELLO.replica must be in [0, {MAX_REPLICAS})")
        for name in ("config_hash", "transport", "auth", "gpu_uuid", "topology_id"):
            _require(len(getattr(self, name)) <= MAX_TEXT, f"HELLO.{name} is longer than {MAX_TEXT}")
        _require(0 < self.pid < MAX_PID, f"HELLO.pid must be in (0, {MAX_PID})")
        _require(0 <= self.step < MAX_INT, "HELLO.step must be >= 0")
        _require(0 <= self.covered_watermark < MAX_INT, "HELLO.covered_watermark must be >= 0")
        _require(len(self.covered_extra) <= MAX_COVERED_EXTRA, f"HELLO.covered_extra holds more than {MAX_COVERED_EXTRA}")
        top = self.covered_watermark + MAX_COVERAGE_SPAN
        _require(all(self.covered_watermark < i <= top for i in self.covered_extra),
                 f"HELLO.covered_extra must lie in (covered_watermark, covered_watermark + {MAX_COVERAGE_SPAN}]")


@dataclass
class Welcome(Message):
    """Target -> drafter: what the target is and where to form the data-plane pair."""

    TYPE: ClassVar[str] = "WELCOME"
    model_id: str
    hidden_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    vocab_size: int
    mask_token_id: int
    dtype: str
    embed_tied: bool
    target_arch: TargetArch
    # [batch_size, seq_len] of every length bucket, in bucket order.
    buckets: list[list[int]]
    store_host: str
    store_port: int
    pair_prefix: str
    registration_epoch: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    # transport "shm" only: the ring of batch slots (/dev/shm/<shm_name>) with
    # shm_slots_per_bucket slots of shm_slot_bytes[bucket] bytes each, and the
    # one-slot segment holding the frozen embedding/LM head (common.shm_transport).
    shm_name: str = optional("")
    shm_slot_bytes: list[int] = optional(default_factory=list)
    shm_slots_per_bucket: int = optional(0)
    shm_weights_name: str = optional("")
    # Batches the plan serves each group over all of data.num_epochs (0 = unlimited):
    # with drafter.max_steps 0 the drafter's learning-rate schedule spans it.
    plan_batches: int = optional(0)
    batches_per_epoch: int = optional(0)
    # Token ids of the training answers, most frequent first (at most TOKEN_RANKING_MAX):
    # a drafter with drafter.draft_vocab_size = K scores the first K.
    token_ranking: list[int] = optional(default_factory=list)
    # Samples in the training split (BATCH.sample_ids index it): the ledger's completeness check.
    train_samples: int = optional(0)
    # Content hash of the tokenized training set, tokenizer and chat template
    # (target_server.data.fingerprint): a checkpoint made on other data refuses to resume.
    data_fingerprint: str = optional("")
    # The target's GPU when it uses nccl (as HELLO.gpu_uuid): a drafter on the same GPU refuses.
    gpu_uuid: str = optional("")
    # This target is replica ``replica`` of ``replicas`` (common.plan_shard): it serves the plan
    # indices i with i mod replicas == replica. ``plan_fingerprint`` names the plan (data and how
    # it is cut into batches), ``topology_id`` the plan and the replica count.
    replica: int = 0
    replicas: int = 1
    plan_fingerprint: str = ""
    topology_id: str = ""
    # The weight of the RMSNorm the target applies after its last layer (eps: target_arch.rms_norm_eps),
    # empty when it has none: with the last layer captured, a drafter computes the target's own
    # next-token distribution from it (drafter.distill_weight).
    final_norm_weight: list[float] = optional(default_factory=list)

    def check_values(self) -> None:
        for name in ("gpu_uuid", "plan_fingerprint", "topology_id"):
            _require(len(getattr(self, name)) <= MAX_TEXT, f"WELCOME.{name} is longer than {MAX_TEXT}")
        _require(len(self.final_norm_weight) in (0, self.hidden_size),
                 "WELCOME.final_norm_weight must be empty or hold hidden_size values")
        _require(all(math.isfinite(w) for w in self.final_norm_weight), "WELCOME.final_norm_weight must be finite")
        _require(0 < self.replicas <= MAX_REPLICAS and 0 <= self.replica < self.replicas,
                 f"WELCOME needs 0 <= replica < replicas <= {MAX_REPLICAS}")


@dataclass
class Error(Message):
    TYPE: ClassVar[str] = "ERROR"
    code: str
    message: str


@dataclass
class Request(Message):
    """Drafter -> target: grant ``credits`` more batches."""

    TYPE: ClassVar[str] = "REQUEST"
    credits: int

    def check_values(self) -> None:
        _require(0 <= self.credits <= MAX_CREDITS, f"REQUEST.credits must be in [0, {MAX_CREDITS}]")


@dataclass
class Batch(Message):
    """Target -> drafter: metadata of the next transfer on the data plane."""

    TYPE: ClassVar[str] = "BATCH"
    batch_id: int
    epoch: int
    bucket: int
    sample_ids: list[int]
    batch_size: int
    seq_len: int
    feature_dim: int
    dtype: str
    nbytes: int
    tag: int
    num_tokens: int  # real (unpadded) tokens, so throughput needs no device read
    slot: int = optional(-1)  # transport "shm": the ring slot of ``bucket`` that carries this batch
    # Served from the target's feature cache, no forward pass: the target leaves the CPU to the
    # drafters (drafter.threads_while_capturing).
    from_cache: bool = optional(False)


@dataclass
class Ack(Message):
    """Drafter -> target: batches trained, and the newest durable checkpoint step."""

    TYPE: ClassVar[str] = "ACK"
    batch_ids: list[int]
    step: int
    checkpoint_step: int

    def check_values(self) -> None:
        _require(len(self.batch_ids) <= MAX_ACK_IDS, f"ACK.batch_ids holds more than {MAX_ACK_IDS}")
        _require(all(0 <= i < MAX_INT for i in self.batch_ids), "ACK.batch_ids must be >= 0")
        _require(0 <= self.checkpoint_step <= self.step < MAX_INT, "ACK needs 0 <= checkpoint_step <= step")


@dataclass
class Heartbeat(Message):
    TYPE: ClassVar[str] = "HEARTBEAT"
    step: int = 0
    # Target -> drafter: seconds since the capture thread last made progress, when that
    # exceeds transport.timeout_s (0 otherwise): a drafter treats it like a silent target.
    capture_stalled_s: float = optional(0.0)

    def check_values(self) -> None:
        _require(0 <= self.step < MAX_INT, "HEARTBEAT.step must be >= 0")


@dataclass
class Bye(Message):
    TYPE: ClassVar[str] = "BYE"
    reason: str = ""

    def check_values(self) -> None:
        _require(len(self.reason) <= MAX_TEXT, f"BYE.reason is longer than {MAX_TEXT}")


@dataclass
class Done(Message):
    """Target -> drafter: every batch of the configured epochs has been served to this group."""

    TYPE: ClassVar[str] = "DONE"
    batches_served: int = 0


@dataclass
class StatusRequest(Message):
    TYPE: ClassVar[str] = "STATUS_REQUEST"
    # Proof of the run's status key (common.auth): STATUS names drafters, pids and progress.
    auth: str = optional("")

    def check_values(self) -> None:
        _require(len(self.auth) <= MAX_TEXT, f"STATUS_REQUEST.auth is longer than {MAX_TEXT}")


@dataclass
class Status(Message):
    TYPE: ClassVar[str] = "STATUS"
    uptime_s: float
    tokens_per_s: float
    queue_depth: int
    bucket_depths: list[int]
    drafters: list[DrafterStatus]


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Error, Request, Batch, Ack, Heartbeat, Bye, Done, StatusRequest, Status)
}


def _check(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, Payload):
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            return False
        fields = {f.name: f for f in dataclasses.fields(hint)}
        hints = _payload_hints(hint)
        required = {n for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        return set(value) <= set(fields) and required <= set(value) and all(_check(v, hints[k]) for k, v in value.items())
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_check(v, item) for v in value)
    if origin is dict:
        key_t, val_t = typing.get_args(hint)
        return isinstance(value, dict) and all(_check(k, key_t) and _check(v, val_t) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


_HINTS = {name: typing.get_type_hints(cls) for name, cls in MESSAGE_TYPES.items()}


@functools.lru_cache(maxsize=None)
def _payload_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(value: Any, hint: Any) -> Any:
    """A checked value with its nested payload maps turned into their dataclasses."""
    if isinstance(hint, type) and issubclass(hint, Payload):
        hints = _payload_hints(hint)
        return hint(**{k: _build(v, hints[k]) for k, v in value.items()})
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if isinstance(item, type) and issubclass(item, Payload):
            return [_build(v, item) for v in value]
    return value


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ProtocolError(E_RANGE, message)


def peek_type(frame: bytes) -> str | None:
    """The ``type`` of a frame whose first map key is ``type`` (as :meth:`Message.encode` writes it), else None.

    Reads a few bytes only, so a server can refuse a frame too large for its type before decoding it.
    """
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(frame) or 1, max_str_len=64, max_bin_len=0,
                                max_array_len=0, max_map_len=1 << 16, ext_hook=_refuse_ext)
    unpacker.feed(frame)
    try:
        if unpacker.read_map_header() < 1 or unpacker.unpack() != "type":
            return None
        kind = unpacker.unpack()
    except Exception:  # not a map, truncated, or the first value is not a short string
        return None
    return kind if isinstance(kind, str) else None


def check_inbound_size(frame: bytes) -> None:
    """Refuse a drafter/operator frame larger than its type can be (or than any such type, if it hides its type)."""
    kind = peek_type(frame)
    limit = INBOUND_BYTES.get(kind, max(INBOUND_BYTES.values())) if kind else max(INBOUND_BYTES.values())
    if len(frame) > limit:
        raise ProtocolError(E_TOO_LARGE, f"{kind or 'message'} of {len(frame)} bytes exceeds the limit of {limit}")


def decode(frame: bytes, *, max_bytes: int = 1 << 20) -> Message:
    """Decode and validate one frame (types, then values), or raise ProtocolError."""
    if len(frame) > max_bytes:
        raise ProtocolError(E_TOO_LARGE, f"message of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        body = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            # Lists longer than any message holds are refused at their header, before they are read.
            max_array_len=max(MAX_ITEMS, TOKEN_RANKING_MAX),
            max_map_len=4096,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(E_MALFORMED, f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError(E_MALFORMED, f"message must be a map, got {type(body).__name__}")
    version = body.pop("v", None)
    kind = body.pop("type", None)
    if not isinstance(kind, str):
        raise ProtocolError(E_MALFORMED, "message has no string 'type' field")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(E_VERSION, f"protocol version {version!r} does not match this side's {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise ProtocolError(E_UNKNOWN_TYPE, f"unknown message type {kind[:40]!r}")
    hints = _HINTS[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in body:
        if key not in fields:
            raise ProtocolError(E_MALFORMED, f"{kind} has no field {str(key)[:40]!r}")
    for name, f in fields.items():
        if name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(E_MALFORMED, f"{kind} is missing field {name!r}")
            continue
        if not _check(body[name], hints[name]):
            raise ProtocolError(E_MALFORMED, f"{kind}.{name} has the wrong type ({type(body[name]).__name__})")
    msg = cls(**{name: _build(value, hints[name]) for name, value in body.items()})
    msg.check_values()
    return msg


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(E_MALFORMED, f"msgpack extension type {code} is not allowed")
