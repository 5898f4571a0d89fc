"""Sliding-window drafter layers (drafter_worker/model/modeling_dflash.py): semantics, training layout vs cached inference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from common.config import ConfigError, DrafterConfig
from drafter_worker.model.dflash_model import (
    DFlashDrafter,
    DraftContextCache,
    build_block_inputs,
    build_target_layer_ids,
    dflash_block_loss,
    load_drafter,
    make_drafter_config,
    save_drafter,
)
from drafter_worker.model.modeling_dflash import sliding_window_mask

HIDDEN = 64
VOCAB = 128
BLOCK = 4
K_LAYERS = 3
MASK_ID = VOCAB - 1
SEQ = 14


def config(layer_types=None, sliding_window: int = 0, num_layers: int = 2) -> Qwen3Config:
    return make_drafter_config(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        num_hidden_layers=num_layers, num_target_layers=8, target_layer_ids=build_target_layer_ids(8, K_LAYERS),
        block_size=BLOCK, mask_token_id=MASK_ID, layer_types=layer_types, sliding_window=sliding_window,
    )


def drafter(layer_types=None, sliding_window: int = 0, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(config(layer_types, sliding_window)).eval()
    with torch.no_grad():  # norm weights start at one; perturb them so every weight matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def same_weights(model: DFlashDrafter, layer_types, sliding_window: int) -> DFlashDrafter:
    other = DFlashDrafter(config(layer_types, sliding_window)).eval()
    other.load_state_dict(model.state_dict())
    return other


def batch(seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(1, SEQ, K_LAYERS * HIDDEN, generator=gen)
    input_ids = torch.randint(0, VOCAB - 1, (1, SEQ), generator=gen)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    return features, input_ids, embed


ANCHORS = torch.tensor([[2, 6, 10]])


def block_layout_outputs(model: DFlashDrafter, features, input_ids, embed, anchors=ANCHORS) -> torch.Tensor:
    """What training computes: all blocks of a row in one pass after the whole context."""
    blocks = build_block_inputs(
        input_ids=input_ids, loss_mask=torch.ones_like(input_ids, dtype=torch.bool),
        lengths=torch.tensor([SEQ]), anchors=anchors, anchor_valid=torch.ones_like(anchors, dtype=torch.bool),
        block_size=BLOCK, mask_token_id=MASK_ID,
    )
    with torch.no_grad():
        out = model(features, F.embedding(blocks.block_ids, embed), blocks.position_ids, blocks.attention_mask)
    return out.view(anchors.shape[1], BLOCK, HIDDEN), blocks


def reference(model: DFlashDrafter, features, noise, position_ids, mask, windows) -> torch.Tensor:
    """Brute force: an explicit softmax per layer, the window mask built entry by entry from positions."""
    sd = model.state_dict()
    cfg = model.config
    eps = cfg.rms_norm_eps

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rot(x):
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    _, q_len, _ = noise.shape
    pos = position_ids[0].tolist()
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    ang = position_ids[0, :, None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    ctx = rms(features @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    x = noise
    for i, window in enumerate(windows):
        layer_mask = mask[0, 0].clone()
        if window is not None:
            n_keys = len(pos)
            for qi in range(q_len):
                for kj in range(n_keys):
                    if abs(pos[n_keys - q_len + qi] - pos[kj]) >= window:
                        layer_mask[qi, kj] = False
        p = f"layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = rms((h @ sd[p + "self_attn.q_proj.weight"].T).view(1, q_len, nh, hd), sd[p + "self_attn.q_norm.weight"])
        kv_in = torch.cat([ctx, h], dim=1)
        k = rms((kv_in @ sd[p + "self_attn.k_proj.weight"].T).view(1, -1, nkv, hd), sd[p + "self_attn.k_norm.weight"])
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].T).view(1, -1, nkv, hd)
        q = q * cos[-q_len:, None] + rot(q) * sin[-q_len:, None]
        k = k * cos[:, None] + rot(k) * sin[:, None]
        k, v = k.repeat_interleave(nh // nkv, dim=2), v.repeat_interleave(nh // nkv, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(~layer_mask, float("-inf"))
        attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(1, q_len, nh * hd)
        x = x + attn @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)) \
            @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"])


# ---------------------------------------------------------------------------
# Semantics
# ---------------------------------------------------------------------------


def test_window_boundary_follows_transformers_qwen3():
    # transformers' sliding_window_overlay: key k is visible from query q when k > q - window.
    pos = torch.arange(10)[None]
    mask = sliding_window_mask(pos, q_len=1, kv_len=10, window=4)[0, 0, 0]
    assert mask.tolist() == [False] * 6 + [True] * 4  # the query's own position and the 3 before it
    # Cached keys sit right before the first new position.
    mask = sliding_window_mask(torch.arange(7, 10)[None], q_len=1, kv_len=10, window=4)[0, 0, 0]
    assert mask.tolist() == [False] * 6 + [True] * 4


def test_window_wider_than_the_sequence_equals_full_attention():
    full = drafter()
    features, input_ids, embed = batch()
    expected, _ = block_layout_outputs(full, features, input_ids, embed)
    for layer_types in (["sliding_attention", "full_attention"], None):
        wide = same_weights(full, layer_types, 64)
        got, _ = block_layout_outputs(wide, features, input_ids, embed)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("layer_types, window", [
    (["sliding_attention", "full_attention"], 5),
    (["full_attention", "sliding_attention"], 3),  # narrower than a block: slots far apart in it are hidden too
    (None, 4),
])
def test_narrow_window_differs_from_full_and_matches_brute_force(layer_types, window):
    full = drafter()
    features, input_ids, embed = batch()
    base, _ = block_layout_outputs(full, features, input_ids, embed)
    model = same_weights(full, layer_types, window)
    got, blocks = block_layout_outputs(model, features, input_ids, embed)
    assert not torch.allclose(got[2], base[2], atol=1e-4)  # anchor 10: the window cuts its context
    types = layer_types or ["sliding_attention"] * 2
    windows = [window if t == "sliding_attention" else None for t in types]
    noise = F.embedding(blocks.block_ids, embed)
    with torch.no_grad():
        ref = reference(model, features, noise, blocks.position_ids, blocks.attention_mask, windows)
    torch.testing.assert_close(got.reshape(1, -1, HIDDEN), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layer_types, window", [
    (["sliding_attention", "full_attention"], 5),
    (["full_attention", "sliding_attention"], 3),  # the last layer's window mask is cut to the rows too
    (None, 64),
])
def test_scored_rows_only_equal_the_full_pass_and_its_gradients(layer_types, window):
    # Training asks the last layer for the scored slots only (out_rows): each row's queries, rotary
    # angles and mask row must be its own, and every slot must still be a key.
    model = drafter(layer_types, window, seed=6).train()
    features, input_ids, embed = batch(seed=7)
    blocks = build_block_inputs(
        input_ids=input_ids, loss_mask=torch.ones_like(input_ids, dtype=torch.bool),
        lengths=torch.tensor([SEQ]), anchors=ANCHORS, anchor_valid=torch.ones_like(ANCHORS, dtype=torch.bool),
        block_size=BLOCK, mask_token_id=MASK_ID,
    )
    rows = torch.tensor([1, 2, 3, 6, 9, 10])  # not every block's slots alike: blocks see each other's rows differently
    noise = F.embedding(blocks.block_ids, embed)
    weight = torch.randn(len(rows), HIDDEN)
    grads = []
    for scored in (False, True):
        model.zero_grad()
        if scored:
            out = model(features, noise, blocks.position_ids, blocks.attention_mask, out_rows=rows)
        else:
            out = model(features, noise, blocks.position_ids, blocks.attention_mask)[:, rows]
        (out[0] * weight).sum().backward()
        grads.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full, full_grads), (scored, scored_grads) = grads
    assert scored.shape == (1, len(rows), HIDDEN)
    torch.testing.assert_close(scored, full, rtol=1e-5, atol=1e-5)
    for name, grad in full_grads.items():
        torch.testing.assert_close(scored_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------------------
# Training layout vs cached inference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layer_types, window", [
    (["sliding_attention", "full_attention"], 5),
    (None, 4),
    (None, 64),
])
def test_block_layout_equals_cached_inference(layer_types, window):
    # Guards training/serving skew: the blocks training scores (many anchors, one
    # pass, a mask) must be what the drafter proposes at inference, where the
    # context arrives in chunks through DraftContextCache and no mask is given.
    model = drafter(layer_types, window, seed=4)
    features, input_ids, embed = batch(seed=5)
    trained, _ = block_layout_outputs(model, features, input_ids, embed)
    with torch.no_grad():
        for n, anchor in enumerate(ANCHORS[0].tolist()):
            cache = DraftContextCache(len(model.layers))
            block = torch.full((1, BLOCK), MASK_ID)
            block[0, 0] = input_ids[0, anchor]
            noise = F.embedding(block, embed)
            cuts = [0, anchor // 2, anchor]  # two chunks of context, as verification steps deliver them
            for lo, hi in zip(cuts, cuts[1:]):
                out = model(features[:, lo:hi], noise, torch.arange(lo, hi + BLOCK)[None], context_cache=cache)
            assert len(cache) == anchor
            torch.testing.assert_close(out[0], trained[n], rtol=1e-5, atol=1e-5)


def test_sliding_drafter_trains_without_host_syncs(monkeypatch):
    model = drafter(None, 6).train()
    features, input_ids, embed = batch()
    lm_head = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.5
    kwargs = dict(features=features.expand(2, -1, -1), input_ids=input_ids.expand(2, -1),
                  loss_mask=torch.ones(2, SEQ, dtype=torch.bool), lengths=torch.tensor([SEQ, 11]),
                  embed_weight=embed, lm_head_weight=lm_head, num_anchors=3, loss_gamma=7.0)

    def forbidden(*args, **kw):
        raise AssertionError("host sync in the training step")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = dflash_block_loss(model, generator=torch.Generator().manual_seed(0), **kwargs)
    out.loss.backward()
    monkeypatch.undo()

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        out = dflash_block_loss(model, generator=torch.Generator().manual_seed(step % 3), **kwargs)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


def test_config_layout_and_round_trip(tmp_path):
    model = drafter(["sliding_attention", "full_attention"], 5)
    cfg = model.config
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    assert cfg.sliding_window == 5 and cfg.use_sliding_window is True and cfg.is_causal is False
    assert [layer.self_attn.sliding_window for layer in model.layers] == [5, None]
    save_drafter(tmp_path, model)
    back = load_drafter(tmp_path)
    assert [layer.self_attn.sliding_window for layer in back.layers] == [5, None]
    features, input_ids, embed = batch()
    assert torch.equal(block_layout_outputs(back, features, input_ids, embed)[0],
                       block_layout_outputs(model, features, input_ids, embed)[0])


@pytest.mark.parametrize("layer_types, window, match", [
    (["sliding_attention"], 5, "names 1 layers"),
    (["sliding_attention", "full_attention"], 0, "sliding_window > 0"),
    (["full_attention", "full_attention"], 8, "no layer is"),
    (["local", "full_attention"], 8, "may hold only"),
])
def test_make_drafter_config_refuses_bad_layer_types(layer_types, window, match):
    with pytest.raises(ValueError, match=match):
        config(layer_types, window)


def test_a_sliding_config_without_is_causal_is_refused():
    # The reference implementation makes sliding layers causal when is_causal is absent;
    # computing them bidirectionally would silently change such a drafter.
    cfg = config(None, 8)
    del cfg.is_causal
    with pytest.raises(ValueError, match="is_causal"):
        DFlashDrafter(cfg)
    cfg.is_causal = False
    DFlashDrafter(cfg)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_layers=2, layer_types=["sliding_attention"], sliding_window=16), "drafter.layer_types must name"),
    (dict(num_layers=1, layer_types=["sliding"], sliding_window=16), "drafter.layer_types may hold only"),
    (dict(num_layers=1, sliding_window=8, block_size=16), "drafter.sliding_window must be >= drafter.block_size"),
    (dict(num_layers=1, layer_types=["full_attention"], sliding_window=64), "drafter.sliding_window must be 0"),
    (dict(sliding_window=-1), "drafter.sliding_window must be >= 0"),
])
def test_drafter_config_validates_sliding_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        DrafterConfig(**overrides)
    DrafterConfig(num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    DrafterConfig(num_layers=3, sliding_window=2048)


# ---------------------------------------------------------------------------
# Evaluation: the speculative-decoding loop dflash-eval runs
# ---------------------------------------------------------------------------


def test_speculative_decoding_with_a_sliding_drafter_drafts_what_training_scores():
    # dflash-eval measures tau through tools/speculative.py: its cached proposer must draft,
    # for a window shorter than the sequence, what a full pass of the drafter computes.
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tools.speculative import DFlashProposer, plain_generate, speculative_generate, target_features

    target_config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=8,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(target_config).eval().requires_grad_(False)
    model = drafter(["sliding_attention", "full_attention"], 6, seed=6)
    proposer = DFlashProposer(model, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    calls = []
    inner = proposer.propose

    def logged(features, anchor, start, num_draft, tokens=()):
        logits = inner(features, anchor, start, num_draft, tokens)
        calls.append((anchor, start, logits))
        return logits

    proposer.propose = logged
    prompt = list(range(10, 30))
    spec = speculative_generate(target, proposer, prompt, max_new_tokens=12)
    assert spec.tokens == plain_generate(target, prompt, max_new_tokens=12).tokens
    sequence = prompt + spec.tokens
    with torch.no_grad():
        hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        features = target_features(hidden, model.target_layer_ids)
        embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        assert len(calls) >= 3
        for anchor, start, logits in calls:
            block = torch.full((1, BLOCK), MASK_ID)
            block[0, 0] = anchor
            out = model(features[:, :start], F.embedding(block, embed), torch.arange(start + BLOCK)[None])
            torch.testing.assert_close(logits, F.linear(out[0, 1 : 1 + logits.shape[0]], head), rtol=1e-4, atol=1e-4)
