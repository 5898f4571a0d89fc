"""Tests for drafter_worker/model/dflash_model.py: layer rule, config layout, model, loss, checkpoint I/O."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, repeat_kv, rotate_half

from drafter_worker.model.lm_loss import lm_head_loss
from drafter_worker.model.modeling_dflash import DraftContextCache, causal_block_mask
from drafter_worker.model.dflash_model import (
    DFlashDrafter,
    build_block_inputs,
    build_causal_block_inputs,
    build_target_layer_ids,
    dflash_block_loss,
    expected_acceptance_length,
    load_drafter,
    make_drafter_config,
    sample_anchors,
    sample_reveal,
    save_drafter,
)

HIDDEN = 64
VOCAB = 128
BLOCK = 4
K_LAYERS = 3
MASK_ID = VOCAB - 1


def tiny_config(**overrides) -> Qwen3Config:
    kwargs = dict(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        num_hidden_layers=2,
        num_target_layers=8,
        target_layer_ids=build_target_layer_ids(8, K_LAYERS),
        block_size=BLOCK,
        mask_token_id=MASK_ID,
    )
    kwargs.update(overrides)
    return make_drafter_config(**kwargs)


def tiny_drafter(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(tiny_config())


def frozen_target_weights(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    return embed, lm_head


def random_batch(bsz: int, seq: int, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(bsz, seq, K_LAYERS * HIDDEN, generator=gen)
    input_ids = torch.randint(0, VOCAB - 1, (bsz, seq), generator=gen)
    return features, input_ids


# ---------------------------------------------------------------------------
# Layer rule and config
# ---------------------------------------------------------------------------


def test_target_layer_ids_rule():
    ids = build_target_layer_ids(30, 5)
    assert ids[0] == 1 and ids[-1] == 27 and len(ids) == 5
    assert all(a < b for a, b in zip(ids, ids[1:]))
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(64, 2) == [1, 61]
    assert build_target_layer_ids(24, 1) == [12]
    assert build_target_layer_ids(1, 1) == [0]


@pytest.mark.parametrize("args", [(0, 1), (8, 0), (-3, 2), (4, 2), (6, 4), (True, 1), (8.0, 2), (8, None)])
def test_target_layer_ids_bad_args(args):
    with pytest.raises(ValueError):
        build_target_layer_ids(*args)


@pytest.mark.parametrize(
    "override",
    [
        {"num_key_value_heads": 3},
        {"mask_token_id": VOCAB},
        {"target_layer_ids": [1, 8]},
        {"target_layer_ids": []},
        {"block_size": 1},
        {"denoise_passes": BLOCK},
        {"denoise_passes": 0},
        {"head_dim": 15},
        {"hidden_size": 0},
    ],
)
def test_make_drafter_config_validates(override):
    with pytest.raises(ValueError):
        tiny_config(**override)


def test_config_layout_matches_published_checkpoints(tmp_path):
    cfg = tiny_config()
    cfg.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["architectures"] == ["DFlashDraftModel"]
    assert data["model_type"] == "qwen3"
    assert data["block_size"] == BLOCK
    assert data["num_target_layers"] == 8
    assert data["dflash_config"] == {
        "block_size": BLOCK,
        "mask_token_id": MASK_ID,
        "target_layer_ids": [1, 3, 5],
    }
    assert data["tie_word_embeddings"] is False
    assert data["use_cache"] is False
    assert data["attention_bias"] is False
    assert data["is_causal"] is False
    assert data["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert data["layer_types"] == ["full_attention", "full_attention"]
    # What the published DFlashDraftModel reads comes back through Qwen3Config.
    back = Qwen3Config.from_pretrained(tmp_path)
    assert back.dflash_config["target_layer_ids"] == [1, 3, 5]
    assert back.block_size == BLOCK and back.is_causal is False
    assert back.rope_parameters["rope_theta"] == 10000.0


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def expected_keys(num_layers: int) -> list[str]:
    keys = []
    for i in range(num_layers):
        p = f"layers.{i}."
        keys += [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        keys += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return keys + ["norm.weight", "fc.weight", "hidden_norm.weight"]


def test_state_dict_keys_and_shapes():
    model = tiny_drafter()
    sd = model.state_dict()
    assert sorted(sd) == sorted(expected_keys(2))
    assert sd["fc.weight"].shape == (HIDDEN, K_LAYERS * HIDDEN)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, HIDDEN)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, HIDDEN)
    assert sd["layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert sd["layers.1.mlp.down_proj.weight"].shape == (HIDDEN, 128)
    # The rotary buffer exists but is not persistent.
    assert "rotary_emb.inv_freq" in dict(model.named_buffers())
    assert model.block_size == BLOCK and model.mask_token_id == MASK_ID
    assert model.target_layer_ids == [1, 3, 5]


def test_init_is_deterministic_and_sensible():
    a, b = tiny_drafter(seed=7).state_dict(), tiny_drafter(seed=7).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["norm.weight"], torch.ones(HIDDEN))
    assert abs(a["fc.weight"].std().item() - 0.02) < 0.003
    c = tiny_drafter(seed=8).state_dict()
    assert not torch.equal(a["fc.weight"], c["fc.weight"])


def test_forward_shapes():
    model = tiny_drafter()
    bsz, ctx, q = 2, 5, 8
    out = model(
        torch.randn(bsz, ctx, K_LAYERS * HIDDEN),
        torch.randn(bsz, q, HIDDEN),
        torch.arange(ctx + q).expand(bsz, -1),
    )
    assert out.shape == (bsz, q, HIDDEN)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError):
        model(torch.randn(bsz, ctx, HIDDEN), torch.randn(bsz, q, HIDDEN), torch.arange(ctx + q).expand(bsz, -1))
    with pytest.raises(ValueError):
        model(torch.randn(bsz, ctx, K_LAYERS * HIDDEN), torch.randn(bsz, q, HIDDEN), torch.arange(q).expand(bsz, -1))


def _reference_forward(model, cfg, target_hidden, noise, position_ids, mask):
    """Independent composition with transformers' Qwen3 RoPE/repeat_kv and an explicit softmax."""
    sd = model.state_dict()
    eps = cfg.rms_norm_eps

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    bsz, q_len, _ = noise.shape
    ctx = rms(target_hidden @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    cos, sin = Qwen3RotaryEmbedding(cfg)(noise, position_ids)
    cos, sin = cos[:, None], sin[:, None]
    x = noise
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(bsz, q_len, nh, hd)
        q = rms(q, sd[p + "self_attn.q_norm.weight"]).transpose(1, 2)
        kv_in = torch.cat([ctx, h], dim=1)
        k = (kv_in @ sd[p + "self_attn.k_proj.weight"].T).view(bsz, -1, nkv, hd)
        k = rms(k, sd[p + "self_attn.k_norm.weight"]).transpose(1, 2)
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].T).view(bsz, -1, nkv, hd).transpose(1, 2)
        q = q * cos[:, :, -q_len:] + rotate_half(q) * sin[:, :, -q_len:]
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(bsz, q_len, nh * hd)
        x = x + attn @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"])


def test_forward_matches_independent_qwen3_composition():
    model = tiny_drafter()
    cfg = model.config
    # Norm weights are ones at init; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    features, input_ids = random_batch(2, 10)
    anchors = torch.tensor([[2, 6], [4, 7]])
    blocks = build_block_inputs(
        input_ids=input_ids,
        loss_mask=torch.ones_like(input_ids, dtype=torch.bool),
        lengths=torch.tensor([10, 9]),
        anchors=anchors,
        anchor_valid=torch.ones_like(anchors, dtype=torch.bool),
        block_size=BLOCK,
        mask_token_id=MASK_ID,
    )
    embed, _ = frozen_target_weights()
    noise = F.embedding(blocks.block_ids, embed)
    with torch.no_grad():
        ours = model(features, noise, blocks.position_ids, blocks.attention_mask)
        ref = _reference_forward(model, cfg, features, noise, blocks.position_ids, blocks.attention_mask)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Blocks, mask and anchors
# ---------------------------------------------------------------------------


def _block_outputs(model, features, input_ids, anchors, lengths, embed):
    blocks = build_block_inputs(
        input_ids=input_ids,
        loss_mask=torch.ones_like(input_ids, dtype=torch.bool),
        lengths=lengths,
        anchors=anchors,
        anchor_valid=torch.ones_like(anchors, dtype=torch.bool),
        block_size=BLOCK,
        mask_token_id=MASK_ID,
    )
    noise = F.embedding(blocks.block_ids, embed)
    with torch.no_grad():
        out = model(features, noise, blocks.position_ids, blocks.attention_mask)
    return out.view(anchors.shape[0], anchors.shape[1], BLOCK, HIDDEN)


def test_block_inputs_layout():
    input_ids = torch.arange(10).view(1, 10) + 10
    anchors = torch.tensor([[3, 6]])
    blocks = build_block_inputs(
        input_ids=input_ids,
        loss_mask=torch.ones(1, 10, dtype=torch.bool),
        lengths=torch.tensor([9]),
        anchors=anchors,
        anchor_valid=torch.tensor([[True, True]]),
        block_size=BLOCK,
        mask_token_id=MASK_ID,
    )
    assert blocks.block_ids.tolist() == [[13, MASK_ID, MASK_ID, MASK_ID, 16, MASK_ID, MASK_ID, MASK_ID]]
    assert blocks.position_ids.tolist() == [list(range(10)) + [3, 4, 5, 6, 6, 7, 8, 9]]
    assert blocks.labels.tolist() == [[[13, 14, 15, 16], [16, 17, 18, 19]]]
    m = blocks.attention_mask[0, 0]
    assert m.shape == (8, 18)
    # Block 0 (anchor 3): context 0..2 and its own 4 slots.
    expected0 = [True] * 3 + [False] * 7 + [True] * 4 + [False] * 4
    # Block 1 (anchor 6): context 0..5 and its own 4 slots.
    expected1 = [True] * 6 + [False] * 4 + [False] * 4 + [True] * 4
    assert all(m[i].tolist() == expected0 for i in range(4))
    assert all(m[i].tolist() == expected1 for i in range(4, 8))
    # Label a+k = 9 is past length 9: invalid; slot 0 never valid.
    assert blocks.label_valid.tolist() == [[[False, True, True, True], [False, True, True, False]]]


def test_attention_mask_isolates_blocks():
    model = tiny_drafter()
    embed, _ = frozen_target_weights()
    features, input_ids = random_batch(1, 12)
    anchors, lengths = torch.tensor([[3, 7]]), torch.tensor([12])
    base = _block_outputs(model, features, input_ids, anchors, lengths, embed)

    # Context at positions >= 3 is invisible to block 0 but visible (3..6) to block 1.
    f2 = features.clone()
    f2[:, 3:] += torch.randn_like(f2[:, 3:])
    out = _block_outputs(model, f2, input_ids, anchors, lengths, embed)
    torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=1e-6)
    assert not torch.allclose(out[:, 1], base[:, 1], atol=1e-4)

    # Context before the anchor is visible to both blocks.
    f3 = features.clone()
    f3[:, 1] += 1.0
    out = _block_outputs(model, f3, input_ids, anchors, lengths, embed)
    assert not torch.allclose(out[:, 0], base[:, 0], atol=1e-4)
    assert not torch.allclose(out[:, 1], base[:, 1], atol=1e-4)

    # The anchor token of block 1 is invisible to block 0, and vice versa.
    ids2 = input_ids.clone()
    ids2[0, 7] = (ids2[0, 7] + 1) % (VOCAB - 1)
    out = _block_outputs(model, features, ids2, anchors, lengths, embed)
    torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=1e-6)
    assert not torch.allclose(out[:, 1], base[:, 1], atol=1e-4)
    ids3 = input_ids.clone()
    ids3[0, 3] = (ids3[0, 3] + 1) % (VOCAB - 1)
    out = _block_outputs(model, features, ids3, anchors, lengths, embed)
    torch.testing.assert_close(out[:, 1], base[:, 1], rtol=0, atol=1e-6)
    # Inside a block attention is bidirectional: slot 1 sees slot 0's token.
    assert not torch.allclose(out[:, 0, 1], base[:, 0, 1], atol=1e-4)


def test_loss_ignores_context_after_anchor_and_other_blocks():
    model = tiny_drafter()
    embed, lm_head = frozen_target_weights()
    features, input_ids = random_batch(1, 12)
    common = dict(
        loss_mask=torch.ones(1, 12, dtype=torch.bool),
        lengths=torch.tensor([12]),
        embed_weight=embed,
        lm_head_weight=lm_head,
        loss_gamma=7.0,
        anchors=torch.tensor([[3, 7]]),
        anchor_valid=torch.tensor([[True, False]]),
    )
    base = dflash_block_loss(model, features=features, input_ids=input_ids, **common).loss
    f2 = features.clone()
    f2[:, 3:] = torch.randn_like(f2[:, 3:])
    ids2 = input_ids.clone()
    ids2[0, 7:] = (ids2[0, 7:] + 1) % (VOCAB - 1)  # block 1's anchor and tokens past block 0's labels
    changed = dflash_block_loss(model, features=f2, input_ids=ids2, **common).loss
    torch.testing.assert_close(changed, base, rtol=0, atol=1e-6)
    f3 = features.clone()
    f3[:, 2] += 1.0
    assert not torch.allclose(dflash_block_loss(model, features=f3, input_ids=input_ids, **common).loss, base)


def test_sample_anchors_eligibility():
    bsz, seq, n = 3, 20, 6
    loss_mask = torch.zeros(bsz, seq, dtype=torch.bool)
    loss_mask[0, 5:] = True
    loss_mask[1, [4, 9]] = True  # eligible anchors: 3 and 8 only
    loss_mask[2, :] = True
    lengths = torch.tensor([20, 15, 4])  # row 2: eligible anchors 1, 2
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, lengths, n, gen)
    assert anchors.shape == (bsz, n) and valid.shape == (bsz, n)
    assert anchors.dtype == torch.long and valid.dtype == torch.bool
    assert valid.sum(dim=1).tolist() == [6, 2, 2]
    for row in range(bsz):
        chosen = anchors[row][valid[row]].tolist()
        assert len(set(chosen)) == len(chosen)
        assert chosen == sorted(chosen)
        for a in chosen:
            assert a >= 1 and a + 1 < lengths[row] and loss_mask[row, a + 1]
    assert sorted(anchors[1][valid[1]].tolist()) == [3, 8]
    assert sorted(anchors[2][valid[2]].tolist()) == [1, 2]
    # Reproducible with the same generator seed, and the draw is random.
    again = sample_anchors(loss_mask, lengths, n, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], anchors) and torch.equal(again[1], valid)
    draws = {tuple(sample_anchors(loss_mask, lengths, n, torch.Generator().manual_seed(s))[0][0].tolist())
             for s in range(10)}
    assert len(draws) > 1
    # More anchors than positions: fixed shape, extra slots invalid.
    anchors, valid = sample_anchors(loss_mask, lengths, 25, gen)
    assert anchors.shape == (bsz, 25) and valid.sum(dim=1).tolist() == [15, 2, 2]


# ---------------------------------------------------------------------------
# Loss, metrics
# ---------------------------------------------------------------------------


def _hand_example():
    features, input_ids = random_batch(2, 10, seed=5)
    loss_mask = torch.zeros(2, 10, dtype=torch.bool)
    loss_mask[0, 4:] = True
    loss_mask[1, :] = True
    loss_mask[1, 2] = False
    lengths = torch.tensor([10, 6])
    anchors = torch.tensor([[3, 7], [1, 4]])
    anchor_valid = torch.tensor([[True, True], [True, False]])
    return features, input_ids, loss_mask, lengths, anchors, anchor_valid


def test_loss_counts_and_weights_by_hand():
    model = tiny_drafter()
    embed, lm_head = frozen_target_weights()
    features, input_ids, loss_mask, lengths, anchors, anchor_valid = _hand_example()
    gamma = 3.0
    out = dflash_block_loss(
        model,
        features=features,
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=lengths,
        embed_weight=embed,
        lm_head_weight=lm_head,
        loss_gamma=gamma,
        anchors=anchors,
        anchor_valid=anchor_valid,
    )
    # Row 0, a=3: labels at 4,5,6 all valid.  a=7: 8,9 valid, 10 past length.
    # Row 1, a=1: label 2 outside loss mask, 3 and 4 valid.  a=4: invalid anchor.
    assert out.count_per_pos.tolist() == [0.0, 2.0, 3.0, 2.0]
    assert out.num_tokens.item() == 7.0
    valid = {(0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 1), (0, 1, 2), (1, 0, 2), (1, 0, 3)}

    # Recompute the loss by hand from the drafter's block outputs.
    blocks = build_block_inputs(
        input_ids=input_ids, loss_mask=loss_mask, lengths=lengths, anchors=anchors,
        anchor_valid=anchor_valid, block_size=BLOCK, mask_token_id=MASK_ID,
    )
    with torch.no_grad():
        hidden = model(features, F.embedding(blocks.block_ids, embed), blocks.position_ids, blocks.attention_mask)
    logits = (hidden @ lm_head.T).view(2, 2, BLOCK, VOCAB)
    num = den = 0.0
    correct = [0.0] * BLOCK
    for b, n, k in valid:
        label = input_ids[b, anchors[b, n] + k]
        w = math.exp(-(k - 1) / gamma)
        num += w * F.cross_entropy(logits[b, n, k][None], label[None]).item()
        den += w
        correct[k] += float(logits[b, n, k].argmax() == label)
    assert out.loss.item() == pytest.approx(num / den, rel=1e-5)
    assert out.correct_per_pos.tolist() == correct
    assert out.loss.requires_grad and not out.correct_per_pos.requires_grad


def test_revealed_prefix_shows_true_tokens_and_trains_only_the_slots_after_it():
    input_ids = torch.arange(10).view(1, 10) + 10
    blocks = build_block_inputs(
        input_ids=input_ids, loss_mask=torch.ones(1, 10, dtype=torch.bool), lengths=torch.tensor([10]),
        anchors=torch.tensor([[3, 5]]), anchor_valid=torch.tensor([[True, True]]), block_size=BLOCK,
        mask_token_id=MASK_ID, reveal=torch.tensor([[1, 2]]),
    )
    # Block 0 shows slot 1, block 1 slots 1 and 2; the masks stay where a later pass still drafts.
    assert blocks.block_ids.tolist() == [[13, 14, MASK_ID, MASK_ID, 15, 16, 17, MASK_ID]]
    assert blocks.label_valid.tolist() == [[[False, False, True, True], [False, False, False, True]]]


def test_revealed_blocks_weigh_their_first_drafted_slot_as_slot_1():
    model = tiny_drafter()
    embed, lm_head = frozen_target_weights()
    features, input_ids, loss_mask, lengths, anchors, anchor_valid = _hand_example()
    gamma = 3.0
    out = dflash_block_loss(
        model, features=features, input_ids=input_ids, loss_mask=loss_mask, lengths=lengths, embed_weight=embed,
        lm_head_weight=lm_head, loss_gamma=gamma, anchors=anchors, anchor_valid=anchor_valid, reveal_fraction=1.0,
        generator=torch.Generator().manual_seed(4),
    )
    reveal = sample_reveal(anchors, BLOCK, 1.0, torch.Generator().manual_seed(4))
    assert reveal.min() >= 1 and reveal.max() <= BLOCK - 2
    blocks = build_block_inputs(input_ids=input_ids, loss_mask=loss_mask, lengths=lengths, anchors=anchors,
                                anchor_valid=anchor_valid, block_size=BLOCK, mask_token_id=MASK_ID, reveal=reveal)
    with torch.no_grad():
        hidden = model(features, F.embedding(blocks.block_ids, embed), blocks.position_ids, blocks.attention_mask)
    logits = (hidden @ lm_head.T).view(2, 2, BLOCK, VOCAB)
    num = den = 0.0
    for b, n, k in blocks.label_valid.nonzero().tolist():
        w = math.exp(-(k - 1 - int(reveal[b, n])) / gamma)
        num += w * F.cross_entropy(logits[b, n, k][None], input_ids[b, anchors[b, n] + k][None]).item()
        den += w
    assert den > 0 and out.loss.item() == pytest.approx(num / den, rel=1e-5)
    assert out.num_tokens.item() == float(blocks.label_valid.sum())


def test_causal_layout_shows_true_tokens_then_one_mask_per_slot():
    input_ids = torch.arange(12).view(1, 12) + 10
    loss_mask = torch.ones(1, 12, dtype=torch.bool)
    loss_mask[0, :5] = False
    blocks = build_causal_block_inputs(
        input_ids=input_ids, loss_mask=loss_mask, lengths=torch.tensor([12]), anchors=torch.tensor([[3, 6]]),
        anchor_valid=torch.tensor([[True, True]]), block_size=BLOCK, mask_token_id=MASK_ID,
    )
    # Per block: anchor and the true tokens of slots 1..2 (positions a..a+2), then masks for slots 1..3.
    assert blocks.block_ids.tolist() == [[13, 14, 15, MASK_ID, MASK_ID, MASK_ID, 16, 17, 18, MASK_ID, MASK_ID, MASK_ID]]
    assert blocks.position_ids[0, 12:].tolist() == [3, 4, 5, 4, 5, 6, 6, 7, 8, 7, 8, 9]
    inner = blocks.attention_mask[0, 0, :6, 12:18].int().tolist()
    assert inner == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],  # shown: causal
                     [1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]  # mask k: shown < k, itself
    assert not blocks.attention_mask[0, 0, :6, 18:].any()  # blocks never see each other
    assert blocks.attention_mask[0, 0, 6, :12].tolist() == [True] * 6 + [False] * 6  # context before the anchor
    # Labels are those of the parallel layout: slot k -> token a+k where it is in the loss.
    assert blocks.labels.tolist() == [[[13, 14, 15, 16], [16, 17, 18, 19]]]
    assert blocks.label_valid.tolist() == [[[False, False, True, True], [False, True, True, True]]]


def test_causal_layout_trains_every_pass_as_cached_causal_decoding_drafts_it():
    # Each mask slot k of the training layout must compute what decoding computes in pass k: the block
    # [anchor, true tokens of slots 1..k-1, masks] drafted causally after a cached context, through the
    # sliding window too. A mismatch would train passes that decoding never runs.
    torch.manual_seed(0)
    model = DFlashDrafter(tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=BLOCK,
                                      denoise_passes=BLOCK - 1, causal_passes=True)).eval()
    embed, _ = frozen_target_weights()
    seq = 24
    features = torch.randn(1, seq, K_LAYERS * HIDDEN)
    input_ids = torch.randint(0, MASK_ID, (1, seq))
    anchors = torch.tensor([[4, 9, 17]])
    blocks = build_causal_block_inputs(
        input_ids=input_ids, loss_mask=torch.ones(1, seq, dtype=torch.bool), lengths=torch.tensor([seq]),
        anchors=anchors, anchor_valid=torch.ones(1, 3, dtype=torch.bool), block_size=BLOCK, mask_token_id=MASK_ID)
    with torch.no_grad():
        trained = model(features, F.embedding(blocks.block_ids, embed), blocks.position_ids, blocks.attention_mask)
        trained = trained.view(1, 3, 2 * BLOCK - 2, HIDDEN)[:, :, BLOCK - 1:]  # the masks of slots 1..bs-1
        for n, a in enumerate(anchors[0].tolist()):
            cache = DraftContextCache(len(model.layers))
            for k in range(1, BLOCK):
                block = torch.full((1, BLOCK), MASK_ID)
                block[0, :k] = input_ids[0, a : a + k]
                ctx = features[:, :a] if k == 1 else features[:, :0]  # later passes read the cached context
                positions = torch.arange(a - ctx.shape[1], a + BLOCK)[None]
                out = model(ctx, F.embedding(block, embed), positions,
                            causal_block_mask(len(cache) + ctx.shape[1], BLOCK), context_cache=cache)
                torch.testing.assert_close(out[0, k], trained[0, n, k - 1], rtol=1e-5, atol=1e-5)


def test_causal_passes_travel_with_the_saved_drafter(tmp_path):
    torch.manual_seed(0)
    save_drafter(tmp_path, DFlashDrafter(tiny_config(denoise_passes=BLOCK - 1, causal_passes=True)))
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["causal_passes"] is True
    assert load_drafter(tmp_path).causal_passes and not tiny_drafter().causal_passes
    with pytest.raises(ValueError, match="causal_passes"):
        tiny_config(denoise_passes=1, causal_passes=True)  # a pass would read slots drafted beside masks


def test_slot_zero_has_no_weight():
    # A batch whose only valid label would be slot 0: nothing counts, loss is 0, no NaN.
    model = tiny_drafter()
    embed, lm_head = frozen_target_weights()
    features, input_ids = random_batch(1, 6)
    out = dflash_block_loss(
        model, features=features, input_ids=input_ids,
        loss_mask=torch.tensor([[False, False, False, True, False, False]]),
        lengths=torch.tensor([6]), embed_weight=embed, lm_head_weight=lm_head,
        loss_gamma=7.0, anchors=torch.tensor([[3]]),
    )
    assert out.num_tokens.item() == 0.0
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_lm_head_loss_direct():
    hidden = torch.randn(2, 3, HIDDEN)
    lm_head = torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (2, 3))
    weights = torch.tensor([[1.0, 0.5, 0.0], [0.25, 0.0, 2.0]])
    loss_sum, weight_sum, hits = lm_head_loss(hidden, lm_head, labels, weights)
    logits = hidden @ lm_head.T
    ce = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), reduction="none").view(2, 3)
    torch.testing.assert_close(loss_sum, (ce * weights).sum())
    assert weight_sum.item() == pytest.approx(3.75)
    assert torch.equal(hits, (logits.argmax(-1) == labels).float())


def test_backward_and_training_decreases_loss():
    model = tiny_drafter()
    embed, lm_head = frozen_target_weights()
    features, input_ids = random_batch(2, 24, seed=9)
    loss_mask = torch.ones(2, 24, dtype=torch.bool)
    loss_mask[:, :4] = False
    lengths = torch.tensor([24, 20])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(30):
        out = dflash_block_loss(
            model, features=features, input_ids=input_ids, loss_mask=loss_mask, lengths=lengths,
            embed_weight=embed, lm_head_weight=lm_head, num_anchors=4, loss_gamma=7.0,
            generator=torch.Generator().manual_seed(step % 3),
        )
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None, name
                assert torch.isfinite(p.grad).all(), name
            assert out.num_tokens.item() > 0
        opt.step()
        losses.append(out.loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_expected_acceptance_length_by_hand():
    correct = torch.tensor([0.0, 8.0, 3.0, 1.0])
    count = torch.tensor([0.0, 10.0, 6.0, 4.0])
    # acc = 0.8, 0.5, 0.25 -> 0.8 + 0.4 + 0.1
    assert expected_acceptance_length(correct, count).item() == pytest.approx(1.3)
    # Empty positions count as accuracy 0 (count clamped to 1), no NaN.
    eal = expected_acceptance_length(torch.tensor([5.0, 2.0, 0.0]), torch.tensor([5.0, 2.0, 0.0]))
    assert eal.item() == pytest.approx(1.0)
    assert expected_acceptance_length(torch.zeros(4), torch.zeros(4)).item() == 0.0


def test_training_step_makes_no_host_syncs(monkeypatch):
    model = tiny_drafter()
    embed, lm_head = frozen_target_weights()
    features, input_ids = random_batch(2, 16)
    loss_mask = torch.ones(2, 16, dtype=torch.bool)
    lengths = torch.tensor([16, 11])
    gen = torch.Generator().manual_seed(0)

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in the training step")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = dflash_block_loss(
        model, features=features, input_ids=input_ids, loss_mask=loss_mask, lengths=lengths,
        embed_weight=embed, lm_head_weight=lm_head, num_anchors=3, loss_gamma=7.0, generator=gen,
    )
    out.loss.backward()
    eal = expected_acceptance_length(out.correct_per_pos, out.count_per_pos)
    monkeypatch.undo()
    assert math.isfinite(out.loss.item()) and math.isfinite(eal.item())


# ---------------------------------------------------------------------------
# Checkpoint I/O
# ---------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    model = tiny_drafter()
    save_drafter(tmp_path, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    data = json.loads((tmp_path / "config.json").read_text())
    for key in ("architectures", "block_size", "num_target_layers", "dflash_config"):
        assert key in data
    assert data["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert data["dflash_config"]["mask_token_id"] == MASK_ID
    assert data["dtype"] == "float32"
    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(expected_keys(2))

    loaded = load_drafter(tmp_path)
    a, b = model.state_dict(), loaded.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.block_size == BLOCK and loaded.mask_token_id == MASK_ID and loaded.target_layer_ids == [1, 3, 5]
    assert loaded.rotary_emb.inv_freq.device.type == "cpu"
    torch.testing.assert_close(loaded.rotary_emb.inv_freq, model.rotary_emb.inv_freq, rtol=0, atol=0)

    features, input_ids = random_batch(1, 9)
    embed, _ = frozen_target_weights()
    anchors = torch.tensor([[2, 5]])
    out_a = _block_outputs(model, features, input_ids, anchors, torch.tensor([9]), embed)
    out_b = _block_outputs(loaded, features, input_ids, anchors, torch.tensor([9]), embed)
    assert torch.equal(out_a, out_b)


def test_denoise_passes_travel_with_the_saved_drafter(tmp_path):
    torch.manual_seed(0)
    model = DFlashDrafter(tiny_config(denoise_passes=BLOCK - 1))
    save_drafter(tmp_path, model)
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["denoise_passes"] == BLOCK - 1
    assert load_drafter(tmp_path).denoise_passes == BLOCK - 1
    assert tiny_drafter().denoise_passes == 1  # not written: one pass, as every DFlash checkpoint
    data = json.loads((tmp_path / "config.json").read_text())
    data["dflash_config"]["denoise_passes"] = BLOCK
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="denoise_passes"):
        load_drafter(tmp_path)


def test_load_rejects_mismatched_weights(tmp_path):
    model = tiny_drafter()
    save_drafter(tmp_path, model)
    state = load_file(tmp_path / "model.safetensors")
    state.pop("norm.weight")
    state["extra.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"norm\.weight.*extra\.weight"):
        load_drafter(tmp_path)

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["fc.weight"] = torch.zeros(HIDDEN, HIDDEN)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="fc.weight"):
        load_drafter(tmp_path)


def test_context_cache_matches_full_context():
    # Guards speculative decoding: a drafter pass that reads earlier context
    # from DraftContextCache must equal one that is given the whole context.
    from drafter_worker.model.dflash_model import DraftContextCache

    model = tiny_drafter().eval()
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(1, 11, K_LAYERS * HIDDEN, generator=gen)
    noise = torch.randn(1, BLOCK, HIDDEN, generator=gen)
    with torch.no_grad():
        full = model(features, noise, torch.arange(11 + BLOCK)[None])
        cache = DraftContextCache(len(model.layers))
        model(features[:, :4], noise, torch.arange(4 + BLOCK)[None], context_cache=cache)  # an earlier step
        assert len(cache) == 4
        model(features[:, 4:7], noise, torch.arange(4, 7 + BLOCK)[None], context_cache=cache)
        chunked = model(features[:, 7:], noise, torch.arange(7, 11 + BLOCK)[None], context_cache=cache)
        assert len(cache) == 11
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
        # Cropping rolls the context back: a pass after crop(7) sees positions 0..6 only.
        cache.crop(7)
        short = model(features[:, :7], noise, torch.arange(7 + BLOCK)[None])
        again = model(features[:, 7:7], noise, torch.arange(7, 7 + BLOCK)[None], context_cache=cache)
        torch.testing.assert_close(again, short, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layers"):
        model(features, noise, torch.arange(11 + BLOCK)[None], context_cache=DraftContextCache(5))


def test_context_cache_keeps_its_context_when_it_grows():
    # The cache's buffers double when a pass does not fit: what was cached before
    # must survive the move, and the block slots written past the context must not
    # leak into the next pass.
    from drafter_worker.model.dflash_model import DraftContextCache

    model = tiny_drafter().eval()
    gen = torch.Generator().manual_seed(6)
    features = torch.randn(1, 150, K_LAYERS * HIDDEN, generator=gen)
    noise = torch.randn(1, BLOCK, HIDDEN, generator=gen)
    cache = DraftContextCache(len(model.layers))
    with torch.no_grad():
        for lo, hi in [(0, 50), (50, 61), (61, 120), (120, 121), (121, 150)]:
            chunked = model(features[:, lo:hi], noise, torch.arange(lo, hi + BLOCK)[None], context_cache=cache)
            full = model(features[:, :hi], noise, torch.arange(hi + BLOCK)[None])
            torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
        assert len(cache) == 150
