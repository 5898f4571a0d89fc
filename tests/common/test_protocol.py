"""Tests for common/protocol.py: round trips, and every way a frame can be refused."""

from __future__ import annotations

import dataclasses
import random
import typing

import msgpack
import pytest

from common import protocol as P
from common.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, ProtocolError, decode

# One valid instance per message type, with every field set (non-default values).
SAMPLES: dict[str, P.Message] = {
    "HELLO": P.Hello(
        drafter_id="d0", config_hash="0123456789abcdef", transport="gloo", pid=4242, rank=1, world_size=3,
        generation=5, replica=2, topology_id="c" * 16, covered_watermark=17, covered_extra=[19, 23], step=40,
        need_weights=False, auth="e" * 64,
        gpu_uuid="GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
    ),
    "WELCOME": P.Welcome(
        model_id="smollm2", hidden_size=576, num_target_layers=30, target_layer_ids=[1, 7, 14, 20, 27],
        vocab_size=49152, mask_token_id=2, dtype="float32", embed_tied=True,
        target_arch=P.TargetArch(num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                                 rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192),
        buckets=[[12, 64], [6, 128], [4, 192]], store_host="127.0.0.1", store_port=5556,
        pair_prefix="pair/d0/3", registration_epoch=3, heartbeat_interval_s=1.0, heartbeat_timeout_s=15.0,
        shm_name="dflash.42.ring.d0.3", shm_slot_bytes=[1024, 2048, 4096], shm_slots_per_bucket=4,
        shm_weights_name="dflash.42.weights", plan_batches=300, batches_per_epoch=100, token_ranking=[5, 3, 9],
        train_samples=1000, data_fingerprint="ab" * 16, gpu_uuid="GPU-9f8e7d6c-5b4a-3928-1706-f5e4d3c2b1a0",
        replica=2, replicas=5, plan_fingerprint="d" * 16, topology_id="c" * 16,
        final_norm_weight=[0.5 + i / 1024 for i in range(576)],
    ),
    "ERROR": P.Error(code=P.E_CONFIG, message="config hash abc != def"),
    "REQUEST": P.Request(credits=2),
    "BATCH": P.Batch(
        batch_id=7, epoch=0, bucket=1, sample_ids=[3, 1, 4, 1, 5, 9], batch_size=6, seq_len=128,
        feature_dim=2880, dtype="bfloat16", nbytes=4_500_000, tag=12, num_tokens=700, slot=3, from_cache=True,
    ),
    "ACK": P.Ack(batch_ids=[5, 6, 7], step=12, checkpoint_step=10),
    "HEARTBEAT": P.Heartbeat(step=99, capture_stalled_s=61.5),
    "BYE": P.Bye(reason="sigterm"),
    "DONE": P.Done(batches_served=1234),
    "STATUS_REQUEST": P.StatusRequest(auth="f" * 64),
    "STATUS": P.Status(
        uptime_s=12.5, tokens_per_s=3000.25, queue_depth=3, bucket_depths=[1, 2, 0],
        drafters=[P.DrafterStatus(id="d0", rank=1, generation=5, epoch=2, pid=77, step=5, checkpoint_step=4, inflight=1,
                                  heartbeat_age_s=0.25, state="training")],
    ),
}


def frame(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def body_of(msg: P.Message) -> dict:
    return msgpack.unpackb(msg.encode(), raw=False)


def code_of(data: bytes, **kwargs) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(data, **kwargs)
    return info.value.code


def test_samples_cover_every_message_type():
    assert set(SAMPLES) == set(MESSAGE_TYPES)
    for name, msg in SAMPLES.items():
        assert type(msg) is MESSAGE_TYPES[name]
        assert msg.TYPE == name


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip(name):
    msg = SAMPLES[name]
    back = decode(msg.encode())
    assert type(back) is type(msg)
    assert back == msg


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_encode_is_plain_msgpack(name):
    # No pickle anywhere: the frame is one msgpack map of plain values.
    data = SAMPLES[name].encode()
    assert b"\x80\x04" not in data[:2]  # not a pickle protocol header
    body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    assert isinstance(body, dict)
    assert body["type"] == name
    assert body["v"] == PROTOCOL_VERSION
    assert set(body) == {"type", "v"} | {f.name for f in dataclasses.fields(MESSAGE_TYPES[name])}


# Guards against the shm fields changing what gloo/nccl peers exchange: a message
# that leaves them at their defaults must encode exactly as before they existed,
# so a peer built before them still decodes it.
@pytest.mark.parametrize("name,added", [
    ("BATCH", {"slot", "from_cache"}), ("HEARTBEAT", {"capture_stalled_s"}), ("STATUS_REQUEST", {"auth"}), ("HELLO", {"auth", "gpu_uuid"}),
    ("WELCOME", {"shm_name", "shm_slot_bytes", "shm_slots_per_bucket", "shm_weights_name",
                                     "plan_batches", "batches_per_epoch", "token_ranking",
                                     "train_samples", "data_fingerprint", "gpu_uuid", "final_norm_weight"}),
])
def test_fields_added_later_are_left_out_at_their_defaults(name, added):
    msg = dataclasses.replace(SAMPLES[name], **{f.name: f.default if f.default is not dataclasses.MISSING
                                                 else f.default_factory()
                                                 for f in dataclasses.fields(MESSAGE_TYPES[name]) if f.name in added})
    body = body_of(msg)
    assert not added & set(body)
    assert decode(msg.encode()) == msg


@pytest.mark.parametrize("name", ["HELLO", "HEARTBEAT", "BYE", "DONE"])
def test_defaults_fill_omitted_optional_fields(name):
    cls = MESSAGE_TYPES[name]
    required = {
        f.name: getattr(SAMPLES[name], f.name)
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    back = decode(frame({"type": name, "v": PROTOCOL_VERSION, **required}))
    assert back == cls(**required)


def test_int_accepted_for_float_field():
    body = body_of(SAMPLES["STATUS"])
    body["uptime_s"] = 3
    assert decode(frame(body)).uptime_s == 3


def test_max_bytes_boundary():
    data = SAMPLES["WELCOME"].encode()
    assert decode(data, max_bytes=len(data)) == SAMPLES["WELCOME"]
    assert code_of(data, max_bytes=len(data) - 1) == P.E_TOO_LARGE


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------

ALL_CODES = {P.E_MALFORMED, P.E_UNKNOWN_TYPE, P.E_VERSION, P.E_TOO_LARGE}


def test_random_bytes_are_refused():
    rng = random.Random(1234)
    codes = set()
    for i in range(3000):
        n = rng.choice([0, 1, 2, 3, 5, 8, 16, 64, 300])
        data = bytes(rng.getrandbits(8) for _ in range(n))
        if i % 3 == 0 and n:
            # Start with a map header so the decoder gets past the first byte more often.
            data = bytes([0x80 | rng.randrange(16)]) + data
        try:
            decode(data)
        except ProtocolError as exc:
            codes.add(exc.code)
        else:  # pragma: no cover - would be an astonishing coincidence
            pytest.fail(f"random frame {data!r} decoded")
    assert codes <= ALL_CODES
    assert P.E_MALFORMED in codes


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_truncated_frames_are_refused(name):
    data = SAMPLES[name].encode()
    for cut in range(len(data)):
        assert code_of(data[:cut]) == P.E_MALFORMED, cut


def test_trailing_garbage_is_refused():
    data = SAMPLES["ACK"].encode()
    assert code_of(data + b"\x00") == P.E_MALFORMED
    assert code_of(data + data) == P.E_MALFORMED


@pytest.mark.parametrize(
    "value",
    [
        [{"type": "ACK", "v": P.PROTOCOL_VERSION}],
        ["ACK", 1],
        "ACK",
        42,
        None,
        b"raw",
        3.5,
    ],
)
def test_non_map_is_refused(value):
    assert code_of(frame(value)) == P.E_MALFORMED


def test_map_without_type_is_refused():
    body = body_of(SAMPLES["ACK"])
    del body["type"]
    assert code_of(frame(body)) == P.E_MALFORMED


@pytest.mark.parametrize("kind", [5, None, b"ACK", ["ACK"]])
def test_non_string_type_is_refused(kind):
    body = body_of(SAMPLES["ACK"])
    body["type"] = kind
    assert code_of(frame(body)) == P.E_MALFORMED


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, str(PROTOCOL_VERSION), 1.5, None, [PROTOCOL_VERSION]])
def test_wrong_version_is_refused(version):
    body = body_of(SAMPLES["ACK"])
    if version is None:
        del body["v"]
    else:
        body["v"] = version
    with pytest.raises(ProtocolError) as info:
        decode(frame(body))
    assert info.value.code == P.E_VERSION
    assert str(PROTOCOL_VERSION) in info.value.message


@pytest.mark.parametrize("kind", ["NOPE", "hello", "", "X" * 10_000, "__class__", "Message"])
def test_unknown_type_is_refused(kind):
    body = body_of(SAMPLES["ACK"])
    body["type"] = kind
    with pytest.raises(ProtocolError) as info:
        decode(frame(body))
    assert info.value.code == P.E_UNKNOWN_TYPE
    assert len(info.value.message) < 200  # the echoed name is clipped


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_missing_required_field_is_refused(name):
    cls = MESSAGE_TYPES[name]
    required = [
        f.name for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for field_name in required:
        body = body_of(SAMPLES[name])
        del body[field_name]
        with pytest.raises(ProtocolError) as info:
            decode(frame(body))
        assert info.value.code == P.E_MALFORMED
        assert field_name in info.value.message


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_extra_field_is_refused(name):
    body = body_of(SAMPLES[name])
    body["surprise"] = 1
    with pytest.raises(ProtocolError) as info:
        decode(frame(body))
    assert info.value.code == P.E_MALFORMED
    assert "surprise" in info.value.message


def test_bytes_key_is_refused():
    body = body_of(SAMPLES["ACK"])
    body[b"step"] = body.pop("step")
    assert code_of(frame(body)) == P.E_MALFORMED


def test_non_string_key_is_refused():
    # strict_map_key: an int key makes msgpack itself refuse the frame.
    data = msgpack.packb({"type": "ACK", "v": P.PROTOCOL_VERSION, 5: 1}, use_bin_type=True, strict_types=False)
    assert code_of(data) == P.E_MALFORMED


# A wrong value for each field kind; every one must be refused with E_MALFORMED.
WRONG_VALUES = [
    ("REQUEST", "credits", "2"),  # str where int
    ("REQUEST", "credits", True),  # bool where int
    ("REQUEST", "credits", 2.0),  # float where int
    ("REQUEST", "credits", None),
    ("REQUEST", "credits", [2]),
    ("ACK", "batch_ids", ["1", "2"]),  # list of str where list of int
    ("ACK", "batch_ids", [1, True]),  # bool inside a list of int
    ("ACK", "batch_ids", 3),  # scalar where list
    ("ACK", "batch_ids", {"0": 1}),
    ("ACK", "step", b"\x01"),  # bin where int
    ("HELLO", "drafter_id", 7),  # int where str
    ("HELLO", "drafter_id", b"d0"),  # bin where str
    ("HELLO", "covered_extra", [1.5]),
    ("WELCOME", "embed_tied", 1),  # int where bool
    ("WELCOME", "heartbeat_interval_s", "1.0"),  # str where float
    ("WELCOME", "heartbeat_interval_s", True),  # bool where float
    ("WELCOME", "buckets", [[1, 2], 3]),  # list of list of int
    ("WELCOME", "buckets", [[1, "2"]]),
    ("WELCOME", "target_arch", [1, 2]),  # list where a map
    ("WELCOME", "target_arch", {**dataclasses.asdict(SAMPLES["WELCOME"].target_arch), "x": 1}),  # unknown key
    ("WELCOME", "target_arch", {"num_attention_heads": 9}),  # required keys missing
    ("WELCOME", "target_arch", {**dataclasses.asdict(SAMPLES["WELCOME"].target_arch), "head_dim": b"raw"}),
    ("STATUS", "drafters", [dataclasses.asdict(SAMPLES["STATUS"].drafters[0]), 5]),
    ("STATUS", "drafters", [{**dataclasses.asdict(SAMPLES["STATUS"].drafters[0]), "id": {"deep": [b"raw"]}}]),
    ("BATCH", "sample_ids", [1, None]),
    ("BYE", "reason", None),
]


@pytest.mark.parametrize("name, field_name, value", WRONG_VALUES)
def test_wrong_field_type_is_refused(name, field_name, value):
    body = body_of(SAMPLES[name])
    body[field_name] = value
    with pytest.raises(ProtocolError) as info:
        decode(frame(body))
    assert info.value.code == P.E_MALFORMED
    assert f"{name}.{field_name}" in info.value.message


def test_every_scalar_field_refuses_a_value_of_another_kind():
    wrong_for = {int: "1", float: "1.0", str: 1, bool: "yes"}
    checked = 0
    for name, cls in MESSAGE_TYPES.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if hint not in wrong_for:
                continue
            body = body_of(SAMPLES[name])
            body[f.name] = wrong_for[hint]
            assert code_of(frame(body)) == P.E_MALFORMED, (name, f.name)
            checked += 1
    assert checked > 30


def test_oversized_frame_is_refused_before_parsing():
    # A huge, otherwise valid message; the size check must come first.
    big = P.Ack(batch_ids=list(range(300_000)), step=1, checkpoint_step=0).encode()
    assert len(big) > 1 << 20
    assert code_of(big) == P.E_TOO_LARGE
    assert code_of(b"\xc1" * 100, max_bytes=10) == P.E_TOO_LARGE  # even garbage: size first


def test_ext_types_are_refused_not_executed():
    hooks: list[int] = []

    # An ext hook of our own proves msgpack would otherwise hand the ext to the application.
    def spy(code, data):
        hooks.append(code)
        return msgpack.ExtType(code, data)

    for code in (0, 1, 42, 127):
        ext = msgpack.ExtType(code, b"cos\nsystem\n(S'echo pwned'\ntR.")  # a pickle payload in an ext
        for body in (
            ext,
            {"type": "BYE", "v": P.PROTOCOL_VERSION, "reason": ext},
            {**body_of(SAMPLES["WELCOME"]), "target_arch": {**dataclasses.asdict(SAMPLES["WELCOME"].target_arch), "head_dim": ext}},
            {"type": ext, "v": P.PROTOCOL_VERSION},
        ):
            data = frame(body)
            msgpack.unpackb(data, ext_hook=spy, strict_map_key=False)
            with pytest.raises(ProtocolError) as info:
                decode(data)
            assert info.value.code == P.E_MALFORMED
    assert hooks  # the spy saw them; decode refused them


def test_timestamp_ext_is_refused():
    # Regression: msgpack decodes ext type -1 (timestamp) itself, without calling
    # ext_hook, so a Timestamp object reached free-form (Any) fields.
    ts = msgpack.Timestamp(1, 0)
    for body in (
        {"type": "BYE", "v": P.PROTOCOL_VERSION, "reason": ts},
        {**body_of(SAMPLES["WELCOME"]), "target_arch": {**dataclasses.asdict(SAMPLES["WELCOME"].target_arch), "rope_theta": ts}},
        {**body_of(SAMPLES["STATUS"]), "drafters": [{**dataclasses.asdict(SAMPLES["STATUS"].drafters[0]), "step": ts}]},
        {"type": "HEARTBEAT", "v": ts},
        ts,
    ):
        data = frame(body)
        with pytest.raises(ProtocolError) as info:
            decode(data)
        assert info.value.code in (P.E_MALFORMED, P.E_VERSION)


def test_nested_payloads_decode_into_their_dataclasses():
    welcome = decode(SAMPLES["WELCOME"].encode())
    status = decode(SAMPLES["STATUS"].encode())
    assert isinstance(welcome.target_arch, P.TargetArch) and welcome.target_arch.head_dim == 64
    assert isinstance(status.drafters[0], P.DrafterStatus) and status.drafters[0].state == "training"

def test_deep_nesting_beyond_msgpack_limit_is_refused():
    data = b"\x81\xa4type" + b"\x91" * 5000 + b"\x01"
    assert code_of(data) == P.E_MALFORMED


def test_protocol_error_carries_code_and_message():
    exc = ProtocolError(P.E_BUSY, "try later")
    assert isinstance(exc, ValueError)
    assert exc.code == P.E_BUSY
    assert exc.message == "try later"
    assert str(exc) == "try later"


# ---------------------------------------------------------------------------
# Values: well-typed fields no honest peer sends are refused before any state
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,changes", [
    ("HELLO", {"covered_watermark": -1}),
    ("HELLO", {"covered_extra": [2**62]}),
    ("HELLO", {"covered_extra": [17]}),  # not above the watermark
    ("HELLO", {"pid": 2**31}),
    ("HELLO", {"pid": 0}),
    ("HELLO", {"drafter_id": "x" * 65}),
    ("HELLO", {"rank": 3}),  # not below world_size
    ("HELLO", {"world_size": 0}),
    ("HELLO", {"generation": -1}),
    ("HELLO", {"replica": 5000}),
    ("WELCOME", {"replica": 5}),  # not below replicas
    ("WELCOME", {"final_norm_weight": [1.0] * 575}),  # not hidden_size values
    ("WELCOME", {"final_norm_weight": [1.0] * 575 + [float("inf")]}),
    ("HELLO", {"config_hash": "h" * 300}),
    ("HELLO", {"step": -5}),
    ("REQUEST", {"credits": 10**6}),
    ("REQUEST", {"credits": -1}),
    ("ACK", {"batch_ids": [-1]}),
    ("ACK", {"checkpoint_step": 13}),  # past step
    ("ACK", {"batch_ids": list(range(P.MAX_ACK_IDS + 1))}),
    ("HEARTBEAT", {"step": -1}),
    ("BYE", {"reason": "r" * 1000}),
])
def test_out_of_range_values_are_refused(name, changes):
    body = body_of(SAMPLES[name])
    body.update(changes)
    assert code_of(frame(body), max_bytes=1 << 24) == P.E_RANGE


def test_a_list_longer_than_any_message_holds_is_refused_at_its_header():
    body = body_of(SAMPLES["ACK"])
    body["batch_ids"] = list(range(max(P.MAX_ITEMS, P.TOKEN_RANKING_MAX) + 1))
    assert code_of(frame(body), max_bytes=1 << 24) == P.E_MALFORMED


@pytest.mark.parametrize("name", sorted(P.INBOUND_BYTES))
def test_inbound_size_is_checked_per_type_before_decoding(name):
    P.check_inbound_size(SAMPLES[name].encode())
    padded = frame({"type": name, "v": PROTOCOL_VERSION, "pad": "x" * P.INBOUND_BYTES[name]})
    assert P.peek_type(padded) == name
    with pytest.raises(ProtocolError) as info:
        P.check_inbound_size(padded)
    assert info.value.code == P.E_TOO_LARGE


def test_peek_type_reads_only_a_leading_type_key():
    assert P.peek_type(b"\x93\x01\x02\x03") is None
    assert P.peek_type(frame({"v": P.PROTOCOL_VERSION, "type": "HELLO"})) is None
    assert P.peek_type(b"") is None
    # A frame hiding its type is held to the largest inbound limit.
    hidden = frame({"v": P.PROTOCOL_VERSION, "type": "ACK", "pad": "x" * (max(P.INBOUND_BYTES.values()) + 1)})
    with pytest.raises(ProtocolError):
        P.check_inbound_size(hidden)
