"""DFlash drafter: model definition, checkpoint I/O and the block-diffusion training loss.

The model follows the published DFlash architecture and checkpoint layout
(arXiv 2602.06036, reference ``z-lab/dflash``, ``dflash/model.py``) so that a
drafter trained here can be served by the engines that already serve DFlash
drafters: same ``config.json`` layout (a ``Qwen3Config`` with
``architectures=["DFlashDraftModel"]`` and a ``dflash_config`` block) and the
same ``state_dict`` key names.

Design notes (see DESIGN.md section 5):

* The drafter conditions on the concatenation of several target layers' hidden
  states (``[B, C, k*H]``), fused by ``fc`` (k*H -> H, no bias) and
  ``hidden_norm``.  Each decoder layer projects the fused context with its own
  ``k_proj``/``v_proj`` and puts those keys/values in front of the block's own.
* A block holds the anchor token (the last verified token) in slot 0 and the
  mask token elsewhere; attention inside a block is bidirectional.
* The target's token embedding and LM head are used frozen and are *not* part
  of the drafter's weights; they are passed to the loss as plain tensors.

Everything on the training path (``sample_anchors``, ``dflash_block_loss``,
``expected_acceptance_length``) is written without device-to-host syncs: no
``.item()``, ``.tolist()``, ``.cpu()``, ``bool(tensor)``, data-dependent
shapes or Python branches on tensor values.  All shapes depend only on Python
ints (batch size, sequence length, number of anchors, block size).

This module depends only on torch, safetensors, transformers' ``Qwen3Config``
and ``common.fused_lm_loss`` (the fused LM-head loss, which uses Triton when it
can); it must never import the process packages.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file as _safetensors_load_file
from safetensors.torch import save_file as _safetensors_save_file
from torch import nn
from transformers import Qwen3Config

from common.fused_lm_loss import fused_lm_head_loss

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE_NAME = "DFlashDraftModel"

__all__ = [
    "ARCHITECTURE_NAME",
    "BlockInputs",
    "BlockLossOutput",
    "DFlashDrafter",
    "DraftContextCache",
    "build_block_inputs",
    "build_target_layer_ids",
    "dflash_block_loss",
    "expected_acceptance_length",
    "init_feature_scale",
    "init_logit_scale",
    "lm_head_loss",
    "load_drafter",
    "make_drafter_config",
    "sample_anchors",
    "save_drafter",
]


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    # bool is an int subclass; a True/False layer count is always a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter (the DFlash rule).

    One draft layer reads the middle target layer; otherwise the layers are
    spread evenly (rounded) from layer 1 to layer ``num_target_layers - 3``
    inclusive.  The feature for layer ``i`` is ``hidden_states[i + 1]`` in
    transformers' indexing (index 0 is the embedding output).
    """
    if not _is_int(num_target_layers) or num_target_layers < 1:
        raise ValueError(f"num_target_layers must be a positive int, got {num_target_layers!r}")
    if not _is_int(num_draft_layers) or num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be a positive int, got {num_draft_layers!r}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    # Distinct layers need at least num_draft_layers candidates in [start, end].
    if end - start + 1 < num_draft_layers:
        raise ValueError(
            f"cannot spread {num_draft_layers} draft layers over target layers "
            f"{start}..{end} of a {num_target_layers}-layer target; need "
            f"num_target_layers >= num_draft_layers + 3"
        )
    span = end - start
    # Python's round() (half to even) is what the published rule uses, so the
    # chosen layers match published checkpoints exactly.
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _qwen3config_accepts_rope_parameters() -> bool:
    return "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters


def make_drafter_config(
    *,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    rms_norm_eps: float,
    rope_theta: float,
    max_position_embeddings: int,
    num_hidden_layers: int,
    num_target_layers: int,
    target_layer_ids: Sequence[int],
    block_size: int,
    mask_token_id: int,
    initializer_range: float = 0.02,
    draft_vocab_size: int = 0,
) -> Qwen3Config:
    """A ``Qwen3Config`` laid out like published DFlash draft checkpoints."""
    positive = {
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "num_hidden_layers": num_hidden_layers,
        "num_target_layers": num_target_layers,
    }
    for name, value in positive.items():
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({num_key_value_heads})"
        )
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    if not _is_int(block_size) or block_size < 2:
        raise ValueError(f"block_size must be an int >= 2 (anchor + at least one draft slot), got {block_size!r}")
    if not _is_int(mask_token_id) or not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id must be an int in [0, vocab_size={vocab_size}), got {mask_token_id!r}")
    layer_ids = [int(i) for i in target_layer_ids]
    if not layer_ids:
        raise ValueError("target_layer_ids must not be empty")
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range for a {num_target_layers}-layer target")
    if not _is_int(draft_vocab_size) or not 0 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be an int in [0, vocab_size={vocab_size}], got {draft_vocab_size!r}")
    if float(rope_theta) <= 0 or float(rms_norm_eps) <= 0:
        raise ValueError(f"rope_theta and rms_norm_eps must be positive, got {rope_theta}, {rms_norm_eps}")

    kwargs: dict[str, Any] = dict(
        architectures=[ARCHITECTURE_NAME],
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        rms_norm_eps=float(rms_norm_eps),
        max_position_embeddings=max_position_embeddings,
        num_hidden_layers=num_hidden_layers,
        hidden_act="silu",
        initializer_range=float(initializer_range),
        tie_word_embeddings=False,
        use_cache=False,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=num_hidden_layers,
        layer_types=["full_attention"] * num_hidden_layers,
    )
    # transformers 5 keeps the rope base in rope_parameters; 4.x takes rope_theta.
    if _qwen3config_accepts_rope_parameters():
        kwargs["rope_parameters"] = {"rope_theta": float(rope_theta), "rope_type": "default"}
    else:  # pragma: no cover - transformers 4.x
        kwargs["rope_theta"] = float(rope_theta)
    config = Qwen3Config(**kwargs)
    # Attributes the published DFlashDraftModel reads.  It looks in
    # dflash_config first and then at the top level, so both places agree.
    config.block_size = block_size
    config.num_target_layers = num_target_layers
    config.dflash_config = {
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": layer_ids,
    }
    if draft_vocab_size:
        config.dflash_config["draft_vocab_size"] = draft_vocab_size
    # The reference attention would default sliding layers to causal; DFlash
    # blocks are bidirectional, so say so explicitly.
    config.is_causal = False
    return config


def _draft_value(config: Qwen3Config, name: str, default: Any = None) -> Any:
    """A DFlash setting: ``dflash_config[name]`` first, then ``config.name``."""
    dflash = getattr(config, "dflash_config", None) or {}
    if name in dflash:
        return dflash[name]
    return getattr(config, name, default)


def _rope_theta(config: Qwen3Config) -> float:
    params = getattr(config, "rope_parameters", None)
    if params:
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"only rope_type 'default' is supported for DFlash drafters, got {rope_type!r}")
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


def _validate_model_config(config: Qwen3Config) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"only hidden_act 'silu' is supported, got {config.hidden_act!r}")
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"only full_attention layers are supported, got layer_types={layer_types}")
    if getattr(config, "is_causal", False):
        raise ValueError("DFlash drafter blocks are bidirectional; config.is_causal must be False")
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if _draft_value(config, "target_layer_ids") is None:
        raise ValueError("config must define dflash_config.target_layer_ids")
    if _draft_value(config, "mask_token_id") is None:
        raise ValueError("config must define dflash_config.mask_token_id")


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3/Llama RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) rotate-half RoPE; ``inv_freq`` is not saved."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)

    def _inv_freq(self, device: torch.device | str | None) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponent)

    def reset_inv_freq(self, device: torch.device | str) -> None:
        """Recompute the buffer (e.g. after building the module on the meta device)."""
        self.inv_freq = self._inv_freq(device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in fp32 regardless of the model dtype: bf16 positions lose
        # precision quickly past a few hundred tokens.
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        context_cache: "DraftContextCache | None" = None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        bsz, q_len, _ = x.shape
        ctx_len = context.shape[1]
        kv_len = ctx_len + q_len

        q = self.q_norm(self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        # Context keys/values come first, then the block's own.
        k = torch.cat([self.k_proj(context), self.k_proj(x)], dim=1)
        v = torch.cat([self.v_proj(context), self.v_proj(x)], dim=1)
        k = self.k_norm(k.view(bsz, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(bsz, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)

        # cos/sin cover all C+Q positions; queries are the last Q of them.
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        q = q * cos[:, :, -q_len:] + _rotate_half(q) * sin[:, :, -q_len:]
        k = k * cos + _rotate_half(k) * sin
        if context_cache is not None:
            # Earlier context goes in front; only the context (never the block
            # slots) is remembered for the next call.
            k, v = context_cache._extend(layer_idx, k, v, ctx_len)
            kv_len = k.shape[2]

        # Expand KV heads explicitly instead of SDPA's enable_gqa: with an
        # arbitrary boolean mask, enable_gqa rules out the memory-efficient
        # CUDA kernel and falls back to the math path, which materialises the
        # whole attention matrix.
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k[:, :, None].expand(bsz, self.num_kv_heads, groups, kv_len, self.head_dim)
            k = k.reshape(bsz, self.num_heads, kv_len, self.head_dim)
            v = v[:, :, None].expand(bsz, self.num_kv_heads, groups, kv_len, self.head_dim)
            v = v.reshape(bsz, self.num_heads, kv_len, self.head_dim)

        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=False,
            scale=self.scaling,
        )
        out = out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class DFlashMLP(nn.Module):
    """SwiGLU MLP (Qwen3MLP layout)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        context_cache: "DraftContextCache | None" = None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        # Only the block stream is normalised here: the fused context was
        # already normalised once by hidden_norm and is shared by all layers.
        x = x + self.self_attn(
            self.input_layernorm(x), context, cos, sin, attention_mask, context_cache, layer_idx
        )
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The DFlash draft model; ``state_dict()`` keys match published checkpoints."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        _validate_model_config(config)
        self.config = config
        self.target_layer_ids: list[int] = [int(i) for i in _draft_value(config, "target_layer_ids")]
        self.block_size: int = int(_draft_value(config, "block_size", 16))
        self.mask_token_id: int = int(_draft_value(config, "mask_token_id"))
        hidden = config.hidden_size
        # Optional draft vocabulary (as EAGLE-3's d2t): the drafter scores only these target
        # token ids, the ones its data uses most. The LM head's cost per drafted token is the
        # largest part of a CPU training step, so a K-token vocabulary makes steps ~V/K cheaper
        # in the head; a token outside it is never drafted (its slot counts as a miss).
        self.draft_vocab_size: int = int(_draft_value(config, "draft_vocab_size", 0) or 0)
        if self.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(self.draft_vocab_size, dtype=torch.long))

        self.layers = nn.ModuleList([DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, _rope_theta(config))
        self.reset_parameters()

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        """Set the target ids the drafter scores (``draft_vocab_size`` distinct ids in range)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        vocab = int(self.config.vocab_size)
        if ids.numel() != self.draft_vocab_size:
            raise ValueError(f"a draft vocabulary of {self.draft_vocab_size} ids was configured, got {ids.numel()}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel()):
            raise ValueError(f"draft vocabulary ids must be distinct and in [0, {vocab})")
        self.draft_vocab.copy_(ids.to(self.draft_vocab.device))

    def head_and_labels(
        self, lm_head_weight: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The LM head rows the drafter scores, and ``labels`` mapped into them.

        Without a draft vocabulary: the head and labels unchanged (``in_vocab`` None).
        With one: ``head[draft_vocab]``, labels as draft indices (0 where the token
        is outside the vocabulary) and a bool ``in_vocab`` mask. No host syncs.
        """
        if not self.draft_vocab_size:
            return lm_head_weight, labels, None
        head = lm_head_weight.index_select(0, self.draft_vocab.to(lm_head_weight.device))
        if labels is None:
            return head, None, None
        to_draft = torch.full((lm_head_weight.shape[0],), -1, dtype=torch.long, device=labels.device)
        to_draft[self.draft_vocab.to(labels.device)] = torch.arange(self.draft_vocab_size, device=labels.device)
        mapped = to_draft[labels]
        in_vocab = mapped >= 0
        return head, mapped.clamp(min=0), in_vocab

    def draft_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Logits over the target's whole vocabulary (``-inf`` outside a draft vocabulary)."""
        head, _, _ = self.head_and_labels(lm_head_weight)
        logits = F.linear(hidden.to(device=head.device, dtype=head.dtype), head)
        if not self.draft_vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], lm_head_weight.shape[0]), float("-inf"))
        full[..., self.draft_vocab.to(full.device)] = logits
        return full

    @property
    def feature_size(self) -> int:
        """Width of the target feature the drafter reads: k * hidden_size."""
        return len(self.target_layer_ids) * self.config.hidden_size

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(mean=0.0, std=std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(
        self,
        target_hidden: torch.Tensor,
        noise_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        context_cache: "DraftContextCache | None" = None,
    ) -> torch.Tensor:
        """Hidden states of the block slots.

        Args:
            target_hidden: ``[B, C, k*H]`` concatenated target-layer features of the context.
            noise_embedding: ``[B, Q, H]`` token embeddings of the block slots.
            position_ids: ``[B, C+Q]`` positions of the context then of the block slots.
            attention_mask: bool ``[B, 1, Q, C+Q]``, True where a slot may attend;
                ``None`` lets every slot attend to everything.
            context_cache: inference only. Keys/values of earlier context
                positions (a :class:`DraftContextCache`); ``target_hidden``
                then holds only the new context positions (``position_ids``
                covers those and the block), the slots also attend to the
                cached context, and the new context is appended to the cache.
                A given ``attention_mask`` must then be ``[B, 1, Q, cached+C+Q]``.

        Returns:
            ``[B, Q, H]`` after the final norm (apply the target's LM head for logits).
        """
        bsz, ctx_len, feat = target_hidden.shape
        q_len = noise_embedding.shape[1]
        if feat != self.feature_size:
            raise ValueError(f"target_hidden last dim {feat} != k*H = {self.feature_size}")
        if tuple(position_ids.shape) != (bsz, ctx_len + q_len):
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} != (B, C+Q) = {(bsz, ctx_len + q_len)}"
            )

        context = self.hidden_norm(self.fc(target_hidden))
        x = noise_embedding
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        if context_cache is not None and len(context_cache.keys) != len(self.layers):
            raise ValueError(
                f"context_cache has {len(context_cache.keys)} layers, the drafter {len(self.layers)}"
            )
        for layer_idx, layer in enumerate(self.layers):
            x = layer(x, context, cos, sin, attention_mask, context_cache, layer_idx)
        return self.norm(x)


@torch.no_grad()
def init_logit_scale(
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    logit_std: float = 1.0,
    num_probe_tokens: int = 64,
    seed: int = 0,
) -> float:
    """Scale the fresh drafter's final norm so its draft logits start with standard
    deviation ``logit_std`` over the vocabulary; returns the factor applied.

    At initialisation a block slot's output is little more than its token's
    embedding; in front of a tied, anisotropic LM head (SmolLM2's) that gives
    logits with a standard deviation near 11 and an initial loss of 26-39 nats
    instead of ln V, which a short budget spends undoing. The factor is measured
    on probe blocks (random anchors, mask slots, a zero context), so it fits any
    target's head; it is a uniform rescale of ``norm.weight``, exact in the logits.
    """
    if logit_std <= 0:
        raise ValueError(f"logit_std must be positive, got {logit_std}")
    device = drafter.fc.weight.device
    dtype = drafter.fc.weight.dtype
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vocab = embed_weight.shape[0]
    bs = drafter.block_size
    block = torch.full((num_probe_tokens, bs), drafter.mask_token_id, dtype=torch.long)
    block[:, 0] = torch.randint(0, vocab, (num_probe_tokens,), generator=gen)
    block = block.to(device)
    ctx = 1
    noise = F.embedding(block, embed_weight.to(device)).to(dtype)
    features = torch.zeros(num_probe_tokens, ctx, drafter.feature_size, device=device, dtype=dtype)
    positions = torch.arange(ctx + bs, device=device).expand(num_probe_tokens, ctx + bs)
    was_training = drafter.training
    drafter.eval()
    hidden = drafter(features, noise, positions)[:, 1:]
    drafter.train(was_training)
    head, _, _ = drafter.head_and_labels(lm_head_weight.to(device))
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]).to(head.dtype), head)
    measured = float(logits.float().std(dim=-1).mean())  # a host read, once, before training
    factor = logit_std / max(measured, 1e-12)
    drafter.norm.weight.mul_(factor)
    return factor


@torch.no_grad()
def init_feature_scale(drafter: DFlashDrafter, features: torch.Tensor, lengths: torch.Tensor) -> None:
    """Divide each input column of the fresh drafter's ``fc`` by that feature's RMS in a real batch.

    Target hidden states carry a few "massive activation" dimensions (SmolLM2: dims 507 and 247
    reach 200-400 while the median dimension is 2-12, and position 0, the attention sink, has an
    RMS near 800), and deeper captured layers are larger than shallow ones. Through a random
    ``fc`` those few dimensions dominate every position's context vector after ``hidden_norm``,
    so at first all positions look alike to the drafter's attention. Scaling the columns makes
    every feature dimension start with an equal share; ``hidden_norm`` follows, so the overall
    scale does not matter. Position 0 and padding are left out of the statistics.
    """
    bsz, seq, _ = features.shape
    pos = torch.arange(seq, device=features.device)
    real = ((pos[None, :] >= 1) & (pos[None, :] < lengths.to(features.device)[:, None])).float()
    # Masked mean of squares: no data-dependent shape, so no host sync on a GPU.
    finite = torch.nan_to_num(features.float(), nan=0.0, posinf=0.0, neginf=0.0)  # a broken target: leave fc as is
    sq = torch.einsum("bt,btf->f", real, finite.pow(2)) / real.sum().clamp(min=1.0)
    rms = sq.sqrt().clamp(min=1e-6)
    drafter.fc.weight.div_((rms / rms.mean()).clamp(min=1e-3).to(drafter.fc.weight.dtype))


class DraftContextCache:
    """Keys/values of the target context already seen, per drafter layer (inference).

    In speculative decoding the context grows by the tokens each verification
    accepts; caching its keys/values (after ``k_norm`` and rotary, as the
    attention uses them) makes each drafter pass cost O(new context + block)
    instead of O(whole context).  Block slots are never cached, so nothing has
    to be removed after a verification; :meth:`crop` rolls the context back
    when a caller needs to.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        """Context positions cached."""
        first = self.keys[0] if self.keys else None
        return 0 if first is None else int(first.shape[2])

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached context positions."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None and v is not None:
                self.keys[i], self.values[i] = k[:, :, :length], v[:, :, :length]

    def _extend(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, ctx_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``/``v`` are ``[B, kv_heads, C+Q, D]``: store the first ``ctx_len``
        positions after the cached ones; return cached + ``k``/``v``."""
        past_k, past_v = self.keys[layer_idx], self.values[layer_idx]
        if past_k is None or past_v is None:
            full_k, full_v = k, v
        else:
            full_k, full_v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        cached = 0 if past_k is None else past_k.shape[2]
        self.keys[layer_idx] = full_k[:, :, : cached + ctx_len]
        self.values[layer_idx] = full_v[:, :, : cached + ctx_len]
        return full_k, full_v


# ---------------------------------------------------------------------------
# Training helpers (no host syncs below this line)
# ---------------------------------------------------------------------------


def sample_anchors(
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick up to ``num_anchors`` distinct anchor positions per row, uniformly.

    A position ``a`` is eligible when ``1 <= a``, ``a + 1 < length`` and
    ``loss_mask[a + 1]`` (the first token to predict is a trained token).
    Rows with fewer eligible positions get ``anchor_valid == False`` for the
    extra slots (their anchor value is meaningless but in range).  Valid
    anchors come first, in increasing position order.

    Returns ``(anchors Long [B, N], anchor_valid Bool [B, N])``.
    """
    if not _is_int(num_anchors) or num_anchors < 1:
        raise ValueError(f"num_anchors must be a positive int, got {num_anchors!r}")
    bsz, seq = loss_mask.shape
    device = loss_mask.device
    pos = torch.arange(seq, device=device)
    next_trained = torch.zeros(bsz, seq, dtype=torch.bool, device=device)
    next_trained[:, :-1] = loss_mask[:, 1:].bool()
    eligible = (pos >= 1) & (pos + 1 < lengths.to(device)[:, None]) & next_trained

    # Random scores with ineligible positions pushed to -inf: top-k then draws
    # a uniform subset of the eligible positions without replacement, with a
    # fixed output shape and no host round trip.
    scores = torch.rand(bsz, seq, device=device, generator=generator)
    scores = scores.masked_fill(~eligible, float("-inf"))
    k = min(num_anchors, seq)
    top_scores, anchors = torch.topk(scores, k, dim=1)
    valid = torch.isfinite(top_scores)

    # Order: valid anchors by position, then the invalid ones.
    order_key = torch.where(valid, anchors, anchors + seq)
    order_key, order = torch.sort(order_key, dim=1)
    anchors = torch.gather(anchors, 1, order)
    valid = torch.gather(valid, 1, order)

    if k < num_anchors:  # more anchors asked for than positions: pad as invalid
        pad = num_anchors - k
        anchors = torch.cat([anchors, torch.zeros(bsz, pad, dtype=anchors.dtype, device=device)], dim=1)
        valid = torch.cat([valid, torch.zeros(bsz, pad, dtype=torch.bool, device=device)], dim=1)
    return anchors, valid


@dataclass
class BlockInputs:
    """Everything the drafter forward and the loss need for one batch of blocks.

    ``Q = N * block_size``; block ``n`` of a row occupies query slots
    ``n*bs .. (n+1)*bs - 1``.
    """

    block_ids: torch.Tensor  # Long [B, Q]: anchor token then mask tokens
    position_ids: torch.Tensor  # Long [B, T+Q]: 0..T-1 then a..a+bs-1 per block
    attention_mask: torch.Tensor  # Bool [B, 1, Q, T+Q]
    labels: torch.Tensor  # Long [B, N, bs]: input_ids[a+k] (clamped in range)
    label_valid: torch.Tensor  # Bool [B, N, bs]: the label counts (slot 0 never)


def build_block_inputs(
    *,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> BlockInputs:
    """Lay out the blocks of ``anchors`` as one query sequence per row."""
    bsz, seq = input_ids.shape
    num = anchors.shape[1]
    device = input_ids.device
    q_len = num * block_size
    lengths = lengths.to(device)
    offsets = torch.arange(block_size, device=device)

    block_pos = anchors[:, :, None] + offsets  # [B, N, bs]
    block_ids = torch.full((bsz, num, block_size), mask_token_id, dtype=input_ids.dtype, device=device)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    block_ids = block_ids.reshape(bsz, q_len)

    ctx_pos = torch.arange(seq, device=device).expand(bsz, seq)
    position_ids = torch.cat([ctx_pos, block_pos.reshape(bsz, q_len)], dim=1)

    # Context part: a slot of the block anchored at a sees j < a (and j < length).
    slot_anchor = anchors[:, :, None].expand(bsz, num, block_size).reshape(bsz, q_len)
    j = torch.arange(seq, device=device)
    ctx_visible = (j[None, None, :] < slot_anchor[:, :, None]) & (j[None, None, :] < lengths[:, None, None])
    # Block part: a slot sees every slot of its own block, none of the others.
    slot_block = torch.arange(q_len, device=device) // block_size
    same_block = (slot_block[:, None] == slot_block[None, :]).expand(bsz, q_len, q_len)
    attention_mask = torch.cat([ctx_visible, same_block], dim=2)[:, None]

    # Slot k predicts input_ids[a + k]; clamp the gather index, validity masks the rest.
    label_idx = block_pos.clamp(max=seq - 1).reshape(bsz, q_len)
    labels = torch.gather(input_ids, 1, label_idx).view(bsz, num, block_size)
    in_loss = torch.gather(loss_mask.bool(), 1, label_idx).view(bsz, num, block_size)
    label_valid = (
        (block_pos < lengths[:, None, None])
        & in_loss
        & anchor_valid[:, :, None].bool()
        & (offsets >= 1)  # slot 0 is the given anchor token
    )
    return BlockInputs(
        block_ids=block_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        labels=labels,
        label_valid=label_valid,
    )


def lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy through the frozen LM head (plain reference).

    Materialises the ``[..., V]`` logits.  The training loss uses
    :func:`common.fused_lm_loss.fused_lm_head_loss`, which has the same
    semantics without them; this stays as the reference it is tested against.

    Args:
        hidden: ``[..., H]`` drafter outputs.
        lm_head_weight: ``[V, H]`` frozen target LM head.
        labels: ``[...]`` target token ids (any value in range where weight is 0).
        weights: ``[...]`` float per-token weights (0 = ignored).

    Returns:
        ``(loss_sum, weight_sum, hits)``: scalar ``sum(weights * CE)`` (with
        grad), scalar ``sum(weights)``, and float ``[...]`` 1.0 where the argmax
        equals the label (unmasked, no grad).
    """
    # Compute in the head's dtype so a bf16 head is never copied to fp32.
    logits = F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight).float()
    flat_logits = logits.reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(flat_logits, labels.reshape(-1), reduction="none").view(labels.shape)
    weights = weights.float()
    loss_sum = (ce * weights).sum()
    with torch.no_grad():
        hits = (logits.argmax(dim=-1) == labels).float()
    return loss_sum, weights.sum(), hits


@dataclass
class BlockLossOutput:
    loss: torch.Tensor  # scalar, weighted mean CE, with grad
    correct_per_pos: torch.Tensor  # float [bs]: argmax hits per block slot (slot 0 always 0)
    count_per_pos: torch.Tensor  # float [bs]: valid labels per block slot (slot 0 always 0)
    num_tokens: torch.Tensor  # scalar float: valid labels in total


def _slot_weights(block_size: int, loss_gamma: float, device: torch.device) -> torch.Tensor:
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1.0) / loss_gamma)
    w[0] = 0.0  # slot 0 holds the given anchor token: nothing to learn
    return w


def dflash_block_loss(
    drafter: DFlashDrafter,
    *,
    features: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    num_anchors: int | None = None,
    loss_gamma: float,
    generator: torch.Generator | None = None,
    anchors: torch.Tensor | None = None,
    anchor_valid: torch.Tensor | None = None,
) -> BlockLossOutput:
    """DFlash block-diffusion loss for one batch.

    Samples anchors (unless ``anchors`` is given; ``anchor_valid`` then
    defaults to all True and eligibility is not re-checked, but labels are
    still masked by length and loss mask), builds one block per anchor, runs
    the drafter once over all blocks of a row, and returns the
    exp(-(k-1)/gamma)-weighted cross-entropy of slot k against token a+k.

    ``features`` is ``[B, T, k*H]``; ``embed_weight`` and ``lm_head_weight``
    are the frozen target embedding and LM head ``[V, H]``.
    """
    if loss_gamma <= 0:
        raise ValueError(f"loss_gamma must be positive, got {loss_gamma}")
    bs = drafter.block_size
    if anchors is None:
        if num_anchors is None:
            raise ValueError("pass num_anchors or anchors")
        anchors, anchor_valid = sample_anchors(loss_mask, lengths, num_anchors, generator)
    elif anchor_valid is None:
        anchor_valid = torch.ones(anchors.shape, dtype=torch.bool, device=anchors.device)

    blocks = build_block_inputs(
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=lengths,
        anchors=anchors,
        anchor_valid=anchor_valid,
        block_size=bs,
        mask_token_id=drafter.mask_token_id,
    )
    dtype = drafter.fc.weight.dtype
    noise = F.embedding(blocks.block_ids, embed_weight).to(dtype)
    hidden = drafter(features.to(dtype), noise, blocks.position_ids, blocks.attention_mask)

    bsz, num = anchors.shape
    hidden = hidden.view(bsz, num, bs, -1)
    head, labels, in_vocab = drafter.head_and_labels(lm_head_weight, blocks.labels[:, :, 1:])
    weights = _slot_weights(bs, float(loss_gamma), hidden.device) * blocks.label_valid
    weights = weights[:, :, 1:] if in_vocab is None else weights[:, :, 1:] * in_vocab
    # Slot 0 never carries a label; skip it in the (vocab-sized) LM head.
    # Fused: never builds the [N, V] logits (DFLASH_FUSED_LOSS=off selects lm_head_loss).
    loss_sum, weight_sum, hits = fused_lm_head_loss(hidden[:, :, 1:], head, labels, weights)
    if in_vocab is not None:
        hits = hits * in_vocab  # a token outside the draft vocabulary is never drafted
    loss = loss_sum / weight_sum.clamp(min=1e-6)

    with torch.no_grad():
        valid = blocks.label_valid.float()
        count_per_pos = valid.sum(dim=(0, 1))
        correct_per_pos = torch.zeros_like(count_per_pos)
        correct_per_pos[1:] = (hits * valid[:, :, 1:]).sum(dim=(0, 1))
        num_tokens = count_per_pos.sum()
    return BlockLossOutput(
        loss=loss,
        correct_per_pos=correct_per_pos,
        count_per_pos=count_per_pos,
        num_tokens=num_tokens,
    )


def expected_acceptance_length(correct_per_pos: torch.Tensor, count_per_pos: torch.Tensor) -> torch.Tensor:
    """EAL = sum_{k>=1} prod_{i=1..k} acc_i, acc_i = correct_i / max(count_i, 1).

    Slot 0 (the anchor) is excluded.  Returns a scalar tensor on the input's device.
    """
    acc = correct_per_pos[..., 1:].float() / count_per_pos[..., 1:].float().clamp(min=1.0)
    return torch.cumprod(acc, dim=-1).sum(dim=-1)


# ---------------------------------------------------------------------------
# Checkpoint I/O
# ---------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_drafter(directory: str | os.PathLike, drafter: DFlashDrafter) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``.

    The weights file is written to a temporary name and renamed, so a crash
    never leaves a truncated ``model.safetensors`` behind.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    config = copy.deepcopy(drafter.config)
    # Serving engines load with dtype="auto"; record what the weights are.
    config.dtype = _dtype_name(drafter.fc.weight.dtype)
    config.save_pretrained(directory)

    state = {name: t.detach().contiguous() for name, t in drafter.state_dict().items()}
    path = os.path.join(directory, WEIGHTS_NAME)
    tmp = path + ".tmp"
    # transformers refuses safetensors files without format metadata.
    _safetensors_save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    logger.info("saved DFlash drafter (%d tensors) to %s", len(state), directory)


def load_drafter(directory: str | os.PathLike, device: torch.device | str = "cpu") -> DFlashDrafter:
    """Load a drafter saved by :func:`save_drafter` (or a published DFlash checkpoint).

    Weights keep the dtype they were saved in.  Raises ``ValueError`` naming
    missing, unexpected or mis-shaped keys.
    """
    directory = os.fspath(directory)
    with open(os.path.join(directory, CONFIG_NAME), encoding="utf-8") as f:
        config_dict = json.load(f)
    config = Qwen3Config.from_dict(config_dict)

    # Build on the meta device and adopt the loaded tensors: no wasted random
    # init, and the parameters keep the checkpoint's dtype.
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    state = _safetensors_load_file(os.path.join(directory, WEIGHTS_NAME), device=str(device))

    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not match the DFlash drafter config: "
            f"missing keys {missing}, unexpected keys {unexpected}"
        )
    bad_shapes = [
        f"{name}: checkpoint {tuple(state[name].shape)} vs model {tuple(t.shape)}"
        for name, t in expected.items()
        if tuple(state[name].shape) != tuple(t.shape)
    ]
    if bad_shapes:
        raise ValueError(f"checkpoint {directory} has mis-shaped tensors: {bad_shapes}")
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.rotary_emb.reset_inv_freq(device)
    logger.info("loaded DFlash drafter from %s", directory)
    return drafter
