"""DFlash drafter: model definition, checkpoint I/O and the block-diffusion training loss.

The model follows the published DFlash architecture and checkpoint layout
(arXiv 2602.06036, reference ``z-lab/dflash``, ``dflash/model.py``) so that a
drafter trained here can be served by the engines that already serve DFlash
drafters: same ``config.json`` layout (a ``Qwen3Config`` with
``architectures=["DFlashDraftModel"]`` and a ``dflash_config`` block) and the
same ``state_dict`` key names.

Design notes (see docs/architecture.md, "The drafter"):

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

The architecture itself (modules, forward pass, sliding-window layers, the
inference context cache) lives in ``drafter_worker/model/modeling_dflash.py``, a file that
imports only torch and transformers because ``dflash-export`` ships it with
every exported drafter for ``AutoModel.from_pretrained(..., trust_remote_code=True)``.
This module adds what only training needs (initialisation, anchors, the loss)
and checkpoint I/O. It depends only on torch, safetensors, transformers,
``drafter_worker.model.modeling_dflash``, ``drafter_worker.model.lm_loss`` (the fused LM-head
loss, which uses Triton when it can) and ``drafter_worker.model.distill_loss`` (the soft-target
loss); it must never import the process packages.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file as _safetensors_load_file
from safetensors.torch import save_file as _safetensors_save_file
from torch import nn
from transformers import Qwen3Config

from drafter_worker.model import modeling_dflash
from common.layer_ids import build_target_layer_ids
from drafter_worker.model.distill_loss import distill_lm_head_loss, teacher_hidden
from drafter_worker.model.lm_loss import fused_lm_head_loss
from drafter_worker.model.modeling_dflash import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DFlashDraftMixin,
    DraftContextCache,
    RMSNorm,
)

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE_NAME = "DFlashDraftModel"
# The modeling file an exported directory ships, and the auto_map naming it (the
# published DFlash drafters' names, which tools built around them look for).
MODELING_FILE_NAME = "dflash.py"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}

__all__ = [
    "ARCHITECTURE_NAME",
    "AUTO_MAP",
    "BlockInputs",
    "BlockLossOutput",
    "DFlashDrafter",
    "DraftContextCache",
    "MODELING_FILE_NAME",
    "build_block_inputs",
    "build_causal_block_inputs",
    "build_target_layer_ids",
    "dflash_block_loss",
    "expected_acceptance_length",
    "init_feature_scale",
    "init_logit_scale",
    "load_drafter",
    "make_drafter_config",
    "resolve_layer_types",
    "sample_anchors",
    "save_drafter",
]


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    # bool is an int subclass; a True/False layer count is always a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_layer_types(num_layers: int, layer_types: Sequence[str] | None, sliding_window: int) -> list[str]:
    """Each layer's attention type: ``layer_types`` as given, or, when empty, every
    layer ``sliding_attention`` if ``sliding_window > 0`` and ``full_attention`` if not."""
    if not _is_int(sliding_window) or sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 0, got {sliding_window!r}")
    if not layer_types:
        return [SLIDING_ATTENTION if sliding_window else FULL_ATTENTION] * num_layers
    types = [str(t) for t in layer_types]
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, the drafter has {num_layers}")
    unknown = sorted({t for t in types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
    if unknown:
        raise ValueError(f"layer_types may hold only {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r}, got {unknown}")
    if SLIDING_ATTENTION in types and not sliding_window:
        raise ValueError("sliding_attention layers need sliding_window > 0")
    if SLIDING_ATTENTION not in types and sliding_window:
        raise ValueError(f"sliding_window={sliding_window} is set but no layer is {SLIDING_ATTENTION!r}")
    return types


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
    layer_types: Sequence[str] | None = None,
    sliding_window: int = 0,
    denoise_passes: int = 1,
    causal_passes: bool = False,
    draft_head: bool = False,
) -> Qwen3Config:
    """A ``Qwen3Config`` laid out like published DFlash draft checkpoints.

    ``layer_types`` (one of ``"full_attention"``/``"sliding_attention"`` per layer)
    and ``sliding_window`` choose sliding-window layers; without ``layer_types``
    every layer is sliding when ``sliding_window > 0``, else full attention.
    """
    _check_dimensions(hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                      num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                      intermediate_size=intermediate_size, vocab_size=vocab_size,
                      max_position_embeddings=max_position_embeddings, num_hidden_layers=num_hidden_layers,
                      num_target_layers=num_target_layers)
    layer_ids = _check_dflash_args(vocab_size=vocab_size, num_target_layers=num_target_layers,
                                   target_layer_ids=target_layer_ids, block_size=block_size,
                                   mask_token_id=mask_token_id, draft_vocab_size=draft_vocab_size,
                                   rope_theta=rope_theta, rms_norm_eps=rms_norm_eps)
    if not _is_int(denoise_passes) or not 1 <= denoise_passes <= block_size - 1:
        raise ValueError(f"denoise_passes must be an int in 1..block_size - 1 = {block_size - 1}, got {denoise_passes!r}")
    types = resolve_layer_types(num_hidden_layers, layer_types, sliding_window)
    config = Qwen3Config(**_qwen3_kwargs(
        hidden_size=hidden_size, num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        head_dim=head_dim, intermediate_size=intermediate_size, vocab_size=vocab_size, rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta, max_position_embeddings=max_position_embeddings, num_hidden_layers=num_hidden_layers,
        initializer_range=initializer_range, types=types, sliding_window=sliding_window,
    ))
    _set_dflash_attributes(config, block_size=block_size, num_target_layers=num_target_layers,
                           mask_token_id=mask_token_id, layer_ids=layer_ids, draft_vocab_size=draft_vocab_size)
    _set_own_keys(config, block_size=block_size, denoise_passes=denoise_passes, causal_passes=causal_passes,
                  draft_head=draft_head)
    return config


def _set_own_keys(config: Qwen3Config, *, block_size: int, denoise_passes: int, causal_passes: bool,
                  draft_head: bool) -> None:
    """The ``dflash_config`` keys only this project's code reads (decoding passes, the drafter's own head)."""
    if causal_passes and denoise_passes != block_size - 1:
        raise ValueError(f"causal_passes drafts a block in block_size - 1 = {block_size - 1} passes, "
                         f"got denoise_passes {denoise_passes}")
    if denoise_passes > 1:  # our decoding loop reads it; engines that do not know it draft in one pass
        config.dflash_config["denoise_passes"] = denoise_passes
    if causal_passes:
        config.dflash_config["causal_passes"] = True
    if draft_head:
        if not config.dflash_config.get("draft_vocab_size"):
            raise ValueError("draft_head (the drafter's own LM head) needs a draft vocabulary (draft_vocab_size > 0)")
        config.dflash_config["draft_head"] = True  # the `draft_head` tensor scores the draft vocabulary


def _check_dimensions(
    *,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    num_hidden_layers: int,
    num_target_layers: int,
) -> None:
    """Refuse impossible model sizes with a message naming the setting, before transformers
    builds a config it would only fail on later (or silently accept)."""
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


def _check_dflash_args(
    *,
    vocab_size: int,
    num_target_layers: int,
    target_layer_ids: Sequence[int],
    block_size: int,
    mask_token_id: int,
    draft_vocab_size: int,
    rope_theta: float,
    rms_norm_eps: float,
) -> list[int]:
    """Refuse DFlash settings the drafter cannot work with; the target layer ids as a list of ints.

    Checked here because a bad block size, mask token or layer id would
    otherwise surface only as an index error deep in training.
    """
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
    return layer_ids


def _qwen3_kwargs(
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
    initializer_range: float,
    types: list[str],
    sliding_window: int,
) -> dict[str, Any]:
    """The ``Qwen3Config`` arguments of a DFlash drafter (the published checkpoints' layout),
    with the rope base where the installed transformers expects it."""
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
        use_sliding_window=SLIDING_ATTENTION in types,
        sliding_window=sliding_window if SLIDING_ATTENTION in types else None,
        max_window_layers=num_hidden_layers,
        layer_types=types,
    )
    # transformers 5 keeps the rope base in rope_parameters; 4.x takes rope_theta.
    if _qwen3config_accepts_rope_parameters():
        kwargs["rope_parameters"] = {"rope_theta": float(rope_theta), "rope_type": "default"}
    else:  # pragma: no cover - transformers 4.x
        kwargs["rope_theta"] = float(rope_theta)
    return kwargs


def _set_dflash_attributes(config: Qwen3Config, *, block_size: int, num_target_layers: int, mask_token_id: int,
                           layer_ids: list[int], draft_vocab_size: int) -> None:
    """Add the attributes the published ``DFlashDraftModel`` reads, so serving engines load the drafter."""
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


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


class DFlashDrafter(DFlashDraftMixin, nn.Module):
    """The DFlash draft model trained here; ``state_dict()`` keys match published checkpoints.

    The architecture (submodules, forward pass, draft vocabulary) is
    :class:`drafter_worker.model.modeling_dflash.DFlashDraftMixin`, the same code an exported
    drafter runs as ``DFlashDraftModel`` under ``AutoModel``; this class adds the
    training-side initialisation and a positional ``forward``.
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self._build_dflash(config)
        self.reset_parameters()

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
        context_cache: DraftContextCache | None = None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of the block slots.

        Args:
            target_hidden: ``[B, C, k*H]`` concatenated target-layer features of the context.
            noise_embedding: ``[B, Q, H]`` token embeddings of the block slots.
            position_ids: ``[B, C+Q]`` positions of the context then of the block slots.
            attention_mask: bool ``[B, 1, Q, C+Q]``, True where a slot may attend;
                ``None`` lets every slot attend to everything. Sliding-window layers
                further restrict it by position (``|p_query - p_key| < sliding_window``).
            context_cache: inference only. Keys/values of earlier context
                positions (a :class:`DraftContextCache`); ``target_hidden``
                then holds only the new context positions (``position_ids``
                covers those and the block), the slots also attend to the
                cached context, and the new context is appended to the cache.
                A given ``attention_mask`` must then be ``[B, 1, Q, cached+C+Q]``.
            out_rows: Long ``[R]``, the block slots whose states are wanted (the last layer
                computes only those; every slot is still a key). ``None``: all of them.

        Returns:
            ``[B, Q, H]`` (``[B, R, H]`` with ``out_rows``) after the final norm (apply the
            target's LM head for logits).
        """
        return self._draft(target_hidden, noise_embedding, position_ids, attention_mask, context_cache, out_rows)


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
    label_valid: torch.Tensor  # Bool [B, N, bs]: the label counts (slot 0 and revealed slots never)
    reveal: torch.Tensor | None = None  # Long [B, N]: slots 1..r hold their true tokens (None: none do)
    # Query slots a block occupies: block_size, or 2 * block_size - 2 in the causal layout
    # (:func:`build_causal_block_inputs`), whose drafter outputs :func:`_block_hidden` maps back to block slots.
    slots_per_block: int = 0


def build_block_inputs(
    *,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    reveal: torch.Tensor | None = None,
) -> BlockInputs:
    """Lay out the blocks of ``anchors`` as one query sequence per row.

    ``reveal`` (Long [B, N]): block n shows the true tokens in its slots 1..reveal[n] instead of
    masks and learns only the slots after them (a later denoising pass of the same block)."""
    bsz, seq = input_ids.shape
    num = anchors.shape[1]
    device = input_ids.device
    q_len = num * block_size
    lengths = lengths.to(device)
    offsets = torch.arange(block_size, device=device)

    block_pos = anchors[:, :, None] + offsets  # [B, N, bs]
    block_ids = torch.full((bsz, num, block_size), mask_token_id, dtype=input_ids.dtype, device=device)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    if reveal is not None:
        shown = torch.gather(input_ids, 1, block_pos.clamp(max=seq - 1).reshape(bsz, q_len)).view(bsz, num, block_size)
        block_ids = torch.where(offsets <= reveal[:, :, None], shown, block_ids)
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

    labels, label_valid = _block_labels(input_ids, loss_mask, lengths, block_pos, anchor_valid, reveal)
    return BlockInputs(
        block_ids=block_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        labels=labels,
        label_valid=label_valid,
        reveal=reveal,
        slots_per_block=block_size,
    )


def _causal_block_visibility(offsets: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[W, W]`` inside one causal-layout block: a shown key at offset o is seen by a shown
    query at offset >= o and by the mask of slot > o; a mask key only by itself."""
    qo, ko = offsets[:, None], offsets[None, :]
    q_mask, k_mask = is_mask[:, None], is_mask[None, :]
    eye = torch.eye(len(offsets), dtype=torch.bool, device=offsets.device)
    return (~k_mask & ((~q_mask & (ko <= qo)) | (q_mask & (ko < qo)))) | (k_mask & eye)


def build_causal_block_inputs(
    *,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> BlockInputs:
    """Every denoising pass of a causally drafted block (``drafter.causal_passes``) in one query sequence.

    Decoding drafts such a block in ``block_size - 1`` passes: pass k shows the drafts of slots
    1..k-1, a slot sees only the slots up to itself, and slot k is read. Where those drafts can
    still be accepted they are the true tokens, so one layout trains every pass at once: each block
    holds its shown tokens (the anchor, then the true tokens of slots 1..bs-2, at positions
    a..a+bs-2, each seeing the shown tokens up to itself) followed by one mask per draft slot k
    (at position a+k, seeing the shown tokens before it and itself). ``2 * block_size - 2`` query
    slots a block; labels and their validity are those of :func:`build_block_inputs`.
    """
    bsz, seq = input_ids.shape
    num = anchors.shape[1]
    device = input_ids.device
    shown_n = block_size - 1
    width = 2 * shown_n
    q_len = num * width
    lengths = lengths.to(device)
    shown_off = torch.arange(shown_n, device=device)
    offsets = torch.cat([shown_off, shown_off + 1])  # [width]: shown slots 0..bs-2, then masks 1..bs-1
    is_mask = torch.arange(width, device=device) >= shown_n

    shown_ids = torch.gather(input_ids, 1, (anchors[:, :, None] + shown_off).clamp(max=seq - 1).flatten(1))
    block_ids = torch.where(is_mask, torch.full_like(is_mask, mask_token_id, dtype=input_ids.dtype),
                            torch.cat([shown_ids.view(bsz, num, shown_n)] * 2, dim=2))
    block_ids = block_ids.reshape(bsz, q_len)
    ctx_pos = torch.arange(seq, device=device).expand(bsz, seq)
    position_ids = torch.cat([ctx_pos, (anchors[:, :, None] + offsets).reshape(bsz, q_len)], dim=1)

    slot_anchor = anchors[:, :, None].expand(bsz, num, width).reshape(bsz, q_len)
    j = torch.arange(seq, device=device)
    ctx_visible = (j[None, None, :] < slot_anchor[:, :, None]) & (j[None, None, :] < lengths[:, None, None])
    inner = _causal_block_visibility(offsets, is_mask)
    slot_block = torch.arange(q_len, device=device) // width
    slot_in = torch.arange(q_len, device=device) % width
    same_block = (slot_block[:, None] == slot_block[None, :]) & inner[slot_in[:, None], slot_in[None, :]]
    attention_mask = torch.cat([ctx_visible, same_block.expand(bsz, q_len, q_len)], dim=2)[:, None]

    block_pos = anchors[:, :, None] + torch.arange(block_size, device=device)
    labels, label_valid = _block_labels(input_ids, loss_mask, lengths, block_pos, anchor_valid, None)
    return BlockInputs(
        block_ids=block_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        labels=labels,
        label_valid=label_valid,
        slots_per_block=width,
    )


def _block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, block_pos: torch.Tensor,
                  anchor_valid: torch.Tensor, reveal: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, label_valid)`` ``[B, N, bs]``: slot k predicts input_ids[a + k] where it is in the sequence,
    in the loss, of a valid anchor, past slot 0 and past the revealed slots."""
    seq = input_ids.shape[1]
    offsets = torch.arange(block_pos.shape[-1], device=block_pos.device)
    # Clamp the gather index; validity masks the rest.
    label_idx = block_pos.clamp(max=seq - 1).flatten(1)
    labels = torch.gather(input_ids, 1, label_idx).view_as(block_pos)
    in_loss = torch.gather(loss_mask.bool(), 1, label_idx).view_as(block_pos)
    label_valid = (
        (block_pos < lengths[:, None, None])
        & in_loss
        & anchor_valid[:, :, None].bool()
        & (offsets >= 1)  # slot 0 is the given anchor token
    )
    if reveal is not None:
        label_valid &= offsets > reveal[:, :, None]
    return labels, label_valid


@dataclass
class BlockLossOutput:
    loss: torch.Tensor  # scalar, weighted mean CE, with grad
    correct_per_pos: torch.Tensor  # float [bs]: argmax hits per block slot (slot 0 always 0)
    count_per_pos: torch.Tensor  # float [bs]: valid labels per block slot (slot 0 always 0)
    num_tokens: torch.Tensor  # scalar float: valid labels in total


def _slot_weights(block_size: int, loss_gamma: float, device: torch.device) -> torch.Tensor:
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    # Slot 0 holds the given anchor token: nothing to learn. masked_fill, not ``w[0] = 0.0``: on CUDA
    # that assignment copies a host scalar into device memory, a synchronizing copy on every step.
    return torch.exp(-(k - 1.0) / loss_gamma).masked_fill(k == 0, 0.0)


def _block_slot_weights(blocks: BlockInputs, block_size: int, loss_gamma: float, device: torch.device) -> torch.Tensor:
    """Slot weights ``[B, N, bs]`` of valid labels: exp(-(k-1-r)/gamma) after the r revealed slots."""
    if blocks.reveal is None:
        return _slot_weights(block_size, loss_gamma, device) * blocks.label_valid
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1.0 - blocks.reveal[:, :, None]) / loss_gamma) * blocks.label_valid


def sample_reveal(anchors: torch.Tensor, block_size: int, fraction: float,
                  generator: torch.Generator | None = None) -> torch.Tensor | None:
    """Revealed prefix lengths ``[B, N]``: 1..block_size-2 for a ``fraction`` of the blocks, else 0."""
    if fraction <= 0 or block_size < 3:
        return None
    shape, device = anchors.shape, anchors.device
    picked = torch.rand(shape, device=device, generator=generator) < fraction
    r = torch.randint(1, block_size - 1, shape, device=device, generator=generator)
    return torch.where(picked, r, torch.zeros_like(r))


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
    loss_impl: str = "auto",
    generator: torch.Generator | None = None,
    anchors: torch.Tensor | None = None,
    anchor_valid: torch.Tensor | None = None,
    distill_weight: float = 0.0,
    teacher_norm: tuple[torch.Tensor, float] | None = None,
    reveal_fraction: float = 0.0,
) -> BlockLossOutput:
    """DFlash block-diffusion loss for one batch.

    Samples anchors (unless ``anchors`` is given; ``anchor_valid`` then
    defaults to all True and eligibility is not re-checked, but labels are
    still masked by length and loss mask), builds one block per anchor, runs
    the drafter once over all blocks of a row, and returns the
    exp(-(k-1)/gamma)-weighted cross-entropy of slot k against token a+k.

    ``features`` is ``[B, T, k*H]``; ``embed_weight`` and ``lm_head_weight``
    are the frozen target embedding and LM head ``[V, H]``.

    ``distill_weight`` > 0 mixes in the soft-target loss (``drafter.distill_weight``):
    ``(1 - w) * hard + w * soft``, the soft part scoring slot k against the
    target's distribution at position a+k-1. It needs the last ``H`` feature
    columns to be the target's last layer and ``teacher_norm`` = (the target's
    final norm weight, its eps).
    """
    if loss_gamma <= 0:
        raise ValueError(f"loss_gamma must be positive, got {loss_gamma}")
    bs = drafter.block_size
    anchors, anchor_valid = _resolve_anchors(loss_mask, lengths, num_anchors, generator, anchors, anchor_valid)
    if drafter.causal_passes:
        blocks = build_causal_block_inputs(input_ids=input_ids, loss_mask=loss_mask, lengths=lengths, anchors=anchors,
                                           anchor_valid=anchor_valid, block_size=bs,
                                           mask_token_id=drafter.mask_token_id)
    else:
        blocks = build_block_inputs(
            input_ids=input_ids,
            loss_mask=loss_mask,
            lengths=lengths,
            anchors=anchors,
            anchor_valid=anchor_valid,
            block_size=bs,
            mask_token_id=drafter.mask_token_id,
            reveal=sample_reveal(anchors, bs, reveal_fraction, generator),
        )
    hidden = _block_hidden(drafter, blocks, features, embed_weight, anchors)
    if distill_weight > 0:
        if teacher_norm is None:
            raise ValueError("distill_weight > 0 needs teacher_norm (the target's final norm weight and eps)")
        loss, hits = _distilled_slot_loss(drafter, hidden, blocks, features, anchors, lm_head_weight, loss_gamma,
                                          distill_weight, teacher_norm)
    else:
        loss, hits = _weighted_slot_loss(drafter, hidden, blocks, lm_head_weight, loss_gamma, loss_impl)
    return _block_loss_output(loss, hits, blocks.label_valid)


def _distilled_slot_loss(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,
    blocks: BlockInputs,
    features: torch.Tensor,
    anchors: torch.Tensor,
    lm_head_weight: torch.Tensor,
    loss_gamma: float,
    distill_weight: float,
    teacher_norm: tuple[torch.Tensor, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, hits)`` as :func:`_weighted_slot_loss`, the loss mixing in the target's distribution at a+k-1.

    ``(1 - w)`` x the slot-weighted mean cross-entropy against the labels plus ``w`` x the same against the
    target's softmax; a label outside a draft vocabulary drops out of the hard part only.
    """
    bsz, num = anchors.shape
    bs, width = drafter.block_size, hidden.shape[-1]
    offsets = torch.arange(bs - 1, device=anchors.device)
    pos = (anchors[:, :, None] + offsets).clamp(max=features.shape[1] - 1).reshape(bsz, -1, 1)
    last = torch.gather(features[..., -width:], 1, pos.expand(-1, -1, width)).view(bsz, num, bs - 1, width)
    teacher = teacher_hidden(last, teacher_norm[0], teacher_norm[1])
    head, labels, in_vocab = drafter.head_and_labels(lm_head_weight, blocks.labels[:, :, 1:])
    soft = _block_slot_weights(blocks, bs, float(loss_gamma), hidden.device)[:, :, 1:]
    hard = soft if in_vocab is None else soft * in_vocab
    hard = (1.0 - distill_weight) * hard / hard.sum().clamp(min=1e-6)
    soft = distill_weight * soft / soft.sum().clamp(min=1e-6)
    loss, hits = distill_lm_head_loss(hidden, teacher, head, labels, hard, soft,
                                      teacher_head=drafter.target_rows(lm_head_weight))
    if in_vocab is not None:
        hits = hits * in_vocab  # a token outside the draft vocabulary is never drafted
    return loss, hits


def _resolve_anchors(
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    num_anchors: int | None,
    generator: torch.Generator | None,
    anchors: torch.Tensor | None,
    anchor_valid: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's anchors and their validity: sampled, or the given ones (all valid by default).

    Callers that fix anchors (tests, evaluation) skip sampling but get the
    same ``(anchors, anchor_valid)`` pair the rest of the loss expects.
    """
    if anchors is None:
        if num_anchors is None:
            raise ValueError("pass num_anchors or anchors")
        anchors, anchor_valid = sample_anchors(loss_mask, lengths, num_anchors, generator)
    elif anchor_valid is None:
        anchor_valid = torch.ones(anchors.shape, dtype=torch.bool, device=anchors.device)
    return anchors, anchor_valid


def _block_hidden(
    drafter: DFlashDrafter,
    blocks: BlockInputs,
    features: torch.Tensor,
    embed_weight: torch.Tensor,
    anchors: torch.Tensor,
) -> torch.Tensor:
    """Drafter outputs ``[B, N, bs-1, H]`` of the scored slots 1.. of every block, one forward pass a row.

    The last layer computes only those slots (the anchor's, and the shown tokens of the causal layout,
    are keys but never scored). Everything runs in the drafter's dtype, so a bf16 drafter is fed bf16
    features and embeddings whatever the target produced.
    """
    dtype = drafter.fc.weight.dtype
    bsz, num = anchors.shape
    bs = drafter.block_size
    width = blocks.slots_per_block or bs
    # Causal layout: slot k's mask sits at bs-2+k in its block (after the bs-1 shown tokens); else slot k at k.
    first = bs - 1 if width != bs else 1
    scored = torch.arange(first, first + bs - 1, device=anchors.device)
    rows = (torch.arange(num, device=anchors.device)[:, None] * width + scored).flatten()
    noise = F.embedding(blocks.block_ids, embed_weight).to(dtype)
    hidden = drafter(features.to(dtype), noise, blocks.position_ids, blocks.attention_mask, out_rows=rows)
    return hidden.view(bsz, num, bs - 1, -1)


def _weighted_slot_loss(
    drafter: DFlashDrafter,
    hidden: torch.Tensor,
    blocks: BlockInputs,
    lm_head_weight: torch.Tensor,
    loss_gamma: float,
    loss_impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, hits)``: the slot-weighted mean cross-entropy and the argmax hits of slots 1.. ``[B, N, bs-1]``.

    Goes through the fused LM-head loss so the vocabulary-sized logits are
    never materialised; hits of tokens outside a draft vocabulary are zeroed.
    """
    head, labels, in_vocab = drafter.head_and_labels(lm_head_weight, blocks.labels[:, :, 1:])
    weights = _block_slot_weights(blocks, drafter.block_size, float(loss_gamma), hidden.device)
    weights = weights[:, :, 1:] if in_vocab is None else weights[:, :, 1:] * in_vocab
    # Fused (drafter.loss_impl auto/chunked/triton): never builds the [N, V] logits.
    loss_sum, weight_sum, hits = fused_lm_head_loss(hidden, head, labels, weights, mode=loss_impl)
    if in_vocab is not None:
        hits = hits * in_vocab  # a token outside the draft vocabulary is never drafted
    loss = loss_sum / weight_sum.clamp(min=1e-6)
    return loss, hits


def _block_loss_output(loss: torch.Tensor, hits: torch.Tensor, label_valid: torch.Tensor) -> BlockLossOutput:
    """The loss with its per-slot accuracy counters, computed without grad (they are only logged)."""
    with torch.no_grad():
        valid = label_valid.float()
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


def save_drafter(directory: str | os.PathLike, drafter: DFlashDrafter, *, with_code: bool = False) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``.

    With ``with_code`` also ``dflash.py`` (a copy of :mod:`drafter_worker.model.modeling_dflash`)
    and, in ``config.json``, the ``auto_map`` naming it, so that
    ``AutoModel.from_pretrained(directory, trust_remote_code=True)`` loads the
    drafter; without it any ``auto_map`` the config carried (an init_from
    directory's) is dropped, as no code ships with the files.

    Files are written to temporary names and renamed, so a crash never leaves a
    truncated ``model.safetensors`` behind.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    config = copy.deepcopy(drafter.config)
    # Serving engines load with dtype="auto"; record what the weights are.
    config.dtype = _dtype_name(drafter.fc.weight.dtype)
    if with_code:
        config.auto_map = dict(AUTO_MAP)
        code = os.path.join(directory, MODELING_FILE_NAME)
        shutil.copyfile(modeling_dflash.__file__, code + ".tmp")
        os.replace(code + ".tmp", code)
    elif getattr(config, "auto_map", None):
        del config.auto_map
    config.save_pretrained(directory)

    state = {name: t.detach().contiguous() for name, t in drafter.state_dict().items()}
    path = os.path.join(directory, WEIGHTS_NAME)
    tmp = path + ".tmp"
    # transformers refuses safetensors files without format metadata.
    _safetensors_save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    logger.info("saved DFlash drafter (%d tensors) to %s", len(state), directory)


def _load_weights(directory: str, device: torch.device | str) -> dict[str, torch.Tensor]:
    """``model.safetensors``, or the shards a ``model.safetensors.index.json`` names."""
    index = os.path.join(directory, WEIGHTS_NAME + ".index.json")
    if not os.path.exists(os.path.join(directory, WEIGHTS_NAME)) and os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(_safetensors_load_file(os.path.join(directory, shard), device=str(device)))
        return state
    return _safetensors_load_file(os.path.join(directory, WEIGHTS_NAME), device=str(device))


def load_drafter(directory: str | os.PathLike, device: torch.device | str = "cpu") -> DFlashDrafter:
    """Load a drafter saved by :func:`save_drafter` (or a published DFlash checkpoint,
    whose weights may be sharded).

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
    state = _load_weights(directory, device)

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
