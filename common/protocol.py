"""Every control-plane message, as small typed classes encoded with msgpack.

A message on the wire is one msgpack map ``{"type": <name>, "v": PROTOCOL_VERSION,
...fields}``. Decoding checks the version, the type and every field's type, and
raises :class:`ProtocolError` (with an error code a server can send back)
instead of handing half-valid data to the caller. Pickle is never used:
msgpack is configured to refuse anything but plain maps, lists, strings,
numbers, booleans and nil.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1
TOKEN_RANKING_MAX = 32768  # ids in WELCOME.token_ranking (about 100 KB of msgpack)

# Error codes carried by ERROR messages.
E_MALFORMED = "malformed"
E_UNKNOWN_TYPE = "unknown_type"
E_VERSION = "version_mismatch"
E_CONFIG = "config_mismatch"
E_TRANSPORT = "transport_mismatch"
E_STATE = "bad_state"
E_TOO_LARGE = "too_large"
E_BUSY = "busy"


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


@dataclass
class Hello(Message):
    """Drafter -> target: register (or re-register after a restart)."""

    TYPE: ClassVar[str] = "HELLO"
    drafter_id: str
    group: str
    config_hash: str
    transport: str
    pid: int
    # Plan indices this drafter's checkpoint already covers: all below
    # ``covered_watermark`` plus ``covered_extra``.
    covered_watermark: int = 0
    covered_extra: list[int] = field(default_factory=list)
    step: int = 0


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
    block_size: int
    dtype: str
    embed_tied: bool
    # Architecture hints the drafter copies from the target (heads, rope, ...).
    target_arch: dict[str, Any]
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


@dataclass
class Ack(Message):
    """Drafter -> target: batches trained, and the newest durable checkpoint step."""

    TYPE: ClassVar[str] = "ACK"
    batch_ids: list[int]
    step: int
    checkpoint_step: int


@dataclass
class Heartbeat(Message):
    TYPE: ClassVar[str] = "HEARTBEAT"
    step: int = 0


@dataclass
class Bye(Message):
    TYPE: ClassVar[str] = "BYE"
    reason: str = ""


@dataclass
class Done(Message):
    """Target -> drafter: every batch of the configured epochs has been served to this group."""

    TYPE: ClassVar[str] = "DONE"
    batches_served: int = 0


@dataclass
class StatusRequest(Message):
    TYPE: ClassVar[str] = "STATUS_REQUEST"


@dataclass
class Status(Message):
    TYPE: ClassVar[str] = "STATUS"
    uptime_s: float
    tokens_per_s: float
    queue_depth: int
    bucket_depths: list[int]
    drafters: list[dict[str, Any]]


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Error, Request, Batch, Ack, Heartbeat, Bye, Done, StatusRequest, Status)
}


def _plain(value: Any) -> bool:
    """True if ``value`` holds only maps with string keys, lists, strings, numbers, booleans and nil.

    msgpack decodes its timestamp extension (type -1) into a ``Timestamp``
    without calling ``ext_hook``, and bin data into ``bytes``; neither may
    reach a free-form (``Any``) field. Iterative: nesting may be ~1000 deep.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if item is None or isinstance(item, (bool, int, float, str)):
            continue
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                return False
            stack.extend(item.values())
        else:
            return False
    return True


def _check(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return _plain(value)
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


def decode(frame: bytes, *, max_bytes: int = 1 << 20) -> Message:
    """Decode and validate one frame, or raise ProtocolError."""
    if len(frame) > max_bytes:
        raise ProtocolError(E_TOO_LARGE, f"message of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        body = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
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
    return cls(**body)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(E_MALFORMED, f"msgpack extension type {code} is not allowed")
