"""Valid control-plane messages for tests that need one (override what the test is about)."""

from __future__ import annotations

from common import protocol as P

TINY_ARCH = P.TargetArch(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256)


def welcome(**overrides) -> P.Welcome:
    """A WELCOME from a tiny target (hidden 32, 6 layers, vocab 64) over gloo."""
    fields = dict(
        model_id="tiny", hidden_size=32, num_target_layers=6, target_layer_ids=[1, 4], vocab_size=64,
        mask_token_id=63, dtype="float32", embed_tied=False, target_arch=TINY_ARCH, buckets=[[1, 32]],
        store_host="127.0.0.1", store_port=1, pair_prefix="p", registration_epoch=1, heartbeat_interval_s=1.0,
        heartbeat_timeout_s=5.0,
    )
    fields.update(overrides)
    return P.Welcome(**fields)


def hello(drafter_id: str, config_hash: str, transport: str = "gloo", **overrides) -> P.Hello:
    """A HELLO of rank 0 of a one-process drafter (generation 1) to replica 0 of 1."""
    fields = dict(drafter_id=drafter_id, config_hash=config_hash, transport=transport, pid=1, rank=0, world_size=1,
                  generation=1, replica=0, topology_id="")
    fields.update(overrides)
    return P.Hello(**fields)
