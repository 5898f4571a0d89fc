"""DFlash block-diffusion draft model: the architecture, self-contained.

This file is the one definition of the drafter's architecture in dflash-stream.
``drafter_worker/model/dflash_model.py`` builds its training model (``DFlashDrafter``) from
the modules below, and ``dflash-export`` copies this file unchanged into every
exported directory as ``dflash.py``, which ``config.json``'s ``auto_map`` names
(``{"AutoModel": "dflash.DFlashDraftModel"}``, as published DFlash drafters do),
so that

    from transformers import AutoModel
    drafter = AutoModel.from_pretrained(directory, trust_remote_code=True, dtype="auto")

returns :class:`DFlashDraftModel`, a ``PreTrainedModel`` computing exactly what
training computed. It must therefore import nothing but torch, transformers and
the standard library (a test checks this).

The architecture (arXiv 2602.06036, reference ``z-lab/dflash``): the drafter
conditions on the concatenation of several target layers' hidden states
(``[B, C, k*H]``), fused by ``fc`` (k*H -> H, no bias) and ``hidden_norm``.
Each decoder layer (Qwen3 layout: q/k norms, rotary, SwiGLU MLP) projects the
fused context with its own ``k_proj``/``v_proj`` and puts those keys/values in
front of the block's own. A block holds the anchor token (the last verified
token) in slot 0 and the mask token elsewhere; attention inside a block is
bidirectional. The target's token embedding and LM head are not part of the
drafter: the caller embeds the block (``noise_embedding``) and applies the
target's LM head to the returned hidden states.

Sliding-window layers (``config.layer_types[i] == "sliding_attention"``, window
``config.sliding_window``): a query at position ``p`` sees a key at position
``k`` only when ``|p - k| < sliding_window``. Behind the query this is
transformers' Qwen3 rule (``k > p - sliding_window``: the query's own position
and the ``sliding_window - 1`` before it); ahead of it, which only block slots
can be, the same distance applies (the published reference's non-causal
window). Positions come from ``position_ids``, so the rule is the same in the
training layout (many blocks after one context) and in cached inference.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "DFlashDraftMixin",
    "DFlashDraftModel",
    "DraftContextCache",
    "causal_block_mask",
    "sliding_window_mask",
]


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def draft_value(config: Any, name: str, default: Any = None) -> Any:
    """A DFlash setting: ``dflash_config[name]`` first, then ``config.name``."""
    dflash = getattr(config, "dflash_config", None) or {}
    if name in dflash:
        return dflash[name]
    return getattr(config, name, default)


def rope_theta(config: Any) -> float:
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


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (``None``: full attention), from ``layer_types`` and ``sliding_window``."""
    num_layers = int(config.num_hidden_layers)
    layer_types = list(getattr(config, "layer_types", None) or [FULL_ATTENTION] * num_layers)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted({t for t in layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} (supported: {FULL_ATTENTION}, {SLIDING_ATTENTION})")
    if SLIDING_ATTENTION not in layer_types:
        return [None] * num_layers
    window = getattr(config, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_attention layers need a positive int sliding_window, got {window!r}")
    return [window if t == SLIDING_ATTENTION else None for t in layer_types]


def validate_config(config: Any) -> None:
    """Refuse configs this architecture would silently compute differently from the model that wrote them."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"only hidden_act 'silu' is supported, got {config.hidden_act!r}")
    windows = layer_windows(config)
    is_causal = getattr(config, "is_causal", None)
    if is_causal:
        raise ValueError("DFlash drafter blocks are bidirectional; config.is_causal must be False")
    if is_causal is None and any(w is not None for w in windows):
        # The reference implementation makes sliding layers causal when is_causal is absent.
        raise ValueError("a config with sliding_attention layers must say is_causal: false (bidirectional blocks); "
                         "a drafter trained with causal sliding layers is not supported")
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if draft_value(config, "target_layer_ids") is None:
        raise ValueError("config must define dflash_config.target_layer_ids")
    if draft_value(config, "mask_token_id") is None:
        raise ValueError("config must define dflash_config.mask_token_id")
    passes, block = draft_value(config, "denoise_passes", 1), draft_value(config, "block_size", 16)
    if not isinstance(passes, int) or isinstance(passes, bool) or not 1 <= passes <= max(1, int(block) - 1):
        raise ValueError(f"dflash_config.denoise_passes must be an int in 1..block_size - 1, got {passes!r}")
    causal = draft_value(config, "causal_passes", False)
    if not isinstance(causal, bool) or (causal and passes != int(block) - 1):
        raise ValueError(f"dflash_config.causal_passes must be a bool, and true only with denoise_passes = "
                         f"block_size - 1, got {causal!r} with {passes} passes")
    rope_theta(config)


# ---------------------------------------------------------------------------
# Modules
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
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


class DraftContextCache:
    """Keys/values of the target context already seen, per drafter layer (inference).

    In speculative decoding the context grows by the tokens each verification
    accepts; caching its keys/values (after ``k_norm`` and rotary, as the
    attention uses them) makes each drafter pass cost O(new context + block)
    instead of O(whole context). Block slots are never kept, so nothing has
    to be removed after a verification; :meth:`crop` rolls the context back
    when a caller needs to. Invariant: the cached positions are the ones right
    before the first position of the next pass's ``position_ids``.

    Each layer's keys and values live in one buffer that doubles when full, so a
    pass copies only its new positions: concatenating the whole cache every pass
    took a third of a draft pass on a CPU.

    ``keep_block`` > 0 also keeps that many leading block positions of each pass: a causally
    drafted block (``causal_passes``) feeds one shown token and the slot to draft a pass, and
    the token's keys/values serve every later pass, so a pass costs two positions, not the
    block; the caller crops them off before the next verified context arrives.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._length = 0
        self.keep_block = 0

    def __len__(self) -> int:
        """Context positions cached."""
        return self._length

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached context positions."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        self._length = min(self._length, length)

    def _extend(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, ctx_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``/``v`` are ``[B, kv_heads, C+Q, D]``: store the first ``ctx_len``
        positions after the cached ones; return cached + ``k``/``v``.

        The block's ``Q`` positions are written past the kept context (the next
        pass overwrites them) so the result is one view of the buffer."""
        cached = self._length
        total = cached + k.shape[2]
        buf_k, buf_v = self.keys[layer_idx], self.values[layer_idx]
        if buf_k is None or buf_v is None or buf_k.shape[2] < total:
            capacity = max(total, 2 * (0 if buf_k is None else buf_k.shape[2]), 64)
            grown_k = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])
            grown_v = v.new_empty(v.shape[0], v.shape[1], capacity, v.shape[3])
            if buf_k is not None and buf_v is not None:
                grown_k[:, :, :cached] = buf_k[:, :, :cached]
                grown_v[:, :, :cached] = buf_v[:, :, :cached]
            self.keys[layer_idx], self.values[layer_idx] = buf_k, buf_v = grown_k, grown_v
        buf_k[:, :, cached:total] = k
        buf_v[:, :, cached:total] = v
        if layer_idx == len(self.keys) - 1:  # every layer has stored this pass's context
            self._length = cached + ctx_len + self.keep_block
        return buf_k[:, :, :total], buf_v[:, :, :total]


def sliding_window_mask(position_ids: torch.Tensor, q_len: int, kv_len: int, window: int) -> torch.Tensor:
    """Bool ``[B, 1, Q, K]``: True where ``|query position - key position| < window``.

    ``position_ids`` (``[B, C+Q]``) holds the positions of this pass's new keys, the
    queries being its last ``Q``; the ``K - (C+Q)`` keys in front of them come from a
    cache and sit right before the first new position. Shapes depend on Python
    ints only, so this makes no host sync.
    """
    new = position_ids.shape[1]
    key_pos = position_ids
    if kv_len > new:
        before = torch.arange(kv_len - new, 0, -1, device=position_ids.device, dtype=position_ids.dtype)
        key_pos = torch.cat([position_ids[:, :1] - before, position_ids], dim=1)
    query_pos = position_ids[:, new - q_len :]
    return ((query_pos[:, :, None] - key_pos[:, None, :]).abs() < window)[:, None]


def causal_block_mask(context_len: int, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``[1, 1, bs, context_len + bs]`` of a causally drafted block (``causal_passes``): every
    slot sees the whole context and the block's slots up to itself."""
    block = torch.ones(block_size, block_size, dtype=torch.bool, device=device).tril()
    context = torch.ones(block_size, context_len, dtype=torch.bool, device=device)
    return torch.cat([context, block], dim=1)[None, None]


def _restrict(attention_mask: torch.Tensor | None, window: torch.Tensor) -> torch.Tensor:
    """``attention_mask`` (bool, True = attend, or additive float) limited to ``window``."""
    if attention_mask is None:
        return window
    if attention_mask.dtype == torch.bool:
        return attention_mask & window
    return attention_mask.masked_fill(~window, torch.finfo(attention_mask.dtype).min)


class DFlashAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scaling = self.head_dim**-0.5
        self.dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        self.sliding_window: int | None = layer_windows(config)[layer_idx]
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
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Any = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the block slots (the ``rows`` of them only, when given) to the context and the block."""
        bsz, q_len, _ = x.shape
        ctx_len = context.shape[1]
        kv_len = ctx_len + q_len
        queries = x if rows is None else x[:, rows]
        n_q = queries.shape[1]

        q = self.q_norm(self.q_proj(queries).view(bsz, n_q, self.num_heads, self.head_dim)).transpose(1, 2)
        # Context keys/values come first, then the block's own.
        k = torch.cat([self.k_proj(context), self.k_proj(x)], dim=1)
        v = torch.cat([self.v_proj(context), self.v_proj(x)], dim=1)
        k = self.k_norm(k.view(bsz, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(bsz, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)

        # cos/sin cover all C+Q positions; queries are the last Q of them.
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        q_cos, q_sin = cos[:, :, -q_len:], sin[:, :, -q_len:]
        if rows is not None:
            q_cos, q_sin = q_cos[:, :, rows], q_sin[:, :, rows]
        q = q * q_cos + rotate_half(q) * q_sin
        k = k * cos + rotate_half(k) * sin
        if isinstance(cache, DraftContextCache):
            # Earlier context goes in front; only the context (never the block
            # slots) is remembered for the next call.
            k, v = cache._extend(self.layer_idx, k, v, ctx_len)
        elif cache is not None:
            # A transformers Cache (the reference loop's DynamicCache): it keeps the
            # block slots too, and the caller crops them after verification.
            k, v = cache.update(k, v, self.layer_idx, {"cos": cos, "sin": sin})
        kv_len = k.shape[2]
        if self.sliding_window is not None:
            window = sliding_window_mask(position_ids, q_len, kv_len, self.sliding_window)
            attention_mask = _restrict(attention_mask, window)
        if rows is not None and attention_mask is not None:
            attention_mask = attention_mask[:, :, rows]

        out = F.scaled_dot_product_attention(
            q,
            self._repeat_kv(k),
            self._repeat_kv(v),
            attn_mask=attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=False,
            scale=self.scaling,
        )
        out = out.transpose(1, 2).reshape(bsz, n_q, self.num_heads * self.head_dim)
        return self.o_proj(out)

    def _repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, kv_heads, K, D]`` -> ``[B, heads, K, D]``, each key/value head repeated for its query group.

        Expanded explicitly instead of SDPA's enable_gqa: with an arbitrary boolean
        mask, enable_gqa rules out the memory-efficient CUDA kernel and falls back to
        the math path, which materialises the whole attention matrix."""
        groups = self.num_heads // self.num_kv_heads
        if groups == 1:
            return t
        bsz, _, kv_len, head_dim = t.shape
        t = t[:, :, None].expand(bsz, self.num_kv_heads, groups, kv_len, head_dim)
        return t.reshape(bsz, self.num_heads, kv_len, head_dim)


class DFlashMLP(nn.Module):
    """SwiGLU MLP (Qwen3MLP layout)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Any = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block stream after this layer; only its ``rows`` (every slot still a key) when given."""
        # Only the block stream is normalised here: the fused context was
        # already normalised once by hidden_norm and is shared by all layers.
        attn = self.self_attn(self.input_layernorm(x), context, cos, sin, position_ids, attention_mask, cache, rows)
        x = (x if rows is None else x[:, rows]) + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftMixin:
    """What every DFlash drafter class shares: its submodules (whose names are the
    published checkpoint's ``state_dict`` keys), the forward pass, and the optional
    draft vocabulary. Mixed into an ``nn.Module`` subclass."""

    def _build_dflash(self, config: Any) -> None:
        validate_config(config)
        self.target_layer_ids: list[int] = [int(i) for i in draft_value(config, "target_layer_ids")]
        self.block_size: int = int(draft_value(config, "block_size", 16))
        self.mask_token_id: int = int(draft_value(config, "mask_token_id"))
        # Drafting passes per block when decoding (pass i fixes slot i + 1; 1 = one parallel pass).
        self.denoise_passes: int = int(draft_value(config, "denoise_passes", 1) or 1)
        # Drafted causally (a slot sees the slots up to itself), one slot fixed a pass; trained so
        # (dflash_model.build_causal_block_inputs). Engines that do not know it draft in one parallel pass.
        self.causal_passes: bool = bool(draft_value(config, "causal_passes", False))
        hidden = config.hidden_size
        # Optional draft vocabulary (as EAGLE-3's d2t): the drafter scores only these target
        # token ids, the ones its data uses most; a token outside it is never drafted.
        self.draft_vocab_size: int = int(draft_value(config, "draft_vocab_size", 0) or 0)
        if self.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(self.draft_vocab_size, dtype=torch.long))
        # Registration order fixes the order of the random initialisation: keep it.
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_theta(config))
        # Optional LM head of its own over the draft vocabulary (EAGLE-3's): trained from the target's rows
        # (init_draft_head); without it the drafter scores with the target's frozen rows.
        if bool(draft_value(config, "draft_head", False)):
            if not self.draft_vocab_size:
                raise ValueError("dflash_config.draft_head needs dflash_config.draft_vocab_size > 0")
            self.draft_head = nn.Parameter(torch.zeros(self.draft_vocab_size, hidden))
        else:
            self.register_parameter("draft_head", None)

    @property
    def feature_size(self) -> int:
        """Width of the target feature the drafter reads: k * hidden_size."""
        return len(self.target_layer_ids) * self.config.hidden_size

    def _draft(
        self,
        target_hidden: torch.Tensor,
        noise_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of the block slots (see ``DFlashDrafter.forward`` for the arguments).

        ``out_rows`` (Long ``[R]``): return only these slots' states, ``[B, R, H]``. The last layer then
        computes queries, its MLP and the norm for those slots alone; every slot is still a key."""
        bsz, ctx_len, feat = target_hidden.shape
        q_len = noise_embedding.shape[1]
        if feat != self.feature_size:
            raise ValueError(f"target_hidden last dim {feat} != k*H = {self.feature_size}")
        if tuple(position_ids.shape) != (bsz, ctx_len + q_len):
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} != (B, C+Q) = {(bsz, ctx_len + q_len)}"
            )
        if isinstance(cache, DraftContextCache) and len(cache.keys) != len(self.layers):
            raise ValueError(f"context_cache has {len(cache.keys)} layers, the drafter {len(self.layers)}")

        context = self.hidden_norm(self.fc(target_hidden))
        x = noise_embedding
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, context, cos, sin, position_ids, attention_mask, cache, out_rows if i == last else None)
        return self.norm(x)

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

    def target_rows(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The target's LM head rows of the draft vocabulary (all of them without one)."""
        if not self.draft_vocab_size:
            return lm_head_weight
        return lm_head_weight.index_select(0, self.draft_vocab.to(lm_head_weight.device))

    @torch.no_grad()
    def init_draft_head(self, lm_head_weight: torch.Tensor) -> None:
        """Start the drafter's own head (``draft_head``) as the target's rows of the draft vocabulary."""
        if self.draft_head is None:
            raise ValueError("this drafter has no head of its own (dflash_config.draft_head)")
        self.draft_head.copy_(self.target_rows(lm_head_weight).to(self.draft_head))

    def head_and_labels(
        self, lm_head_weight: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The LM head rows the drafter scores, and ``labels`` mapped into them.

        Without a draft vocabulary: the head and labels unchanged (``in_vocab`` None).
        With one: the drafter's own ``draft_head`` if it has one, else
        ``head[draft_vocab]``; labels as draft indices (0 where the token
        is outside the vocabulary) and a bool ``in_vocab`` mask. No host syncs.
        """
        if not self.draft_vocab_size:
            return lm_head_weight, labels, None
        head = self.draft_head if self.draft_head is not None else self.target_rows(lm_head_weight)
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


# ---------------------------------------------------------------------------
# The transformers model (what AutoModel returns for an exported drafter)
# ---------------------------------------------------------------------------


class DFlashDraftModel(DFlashDraftMixin, PreTrainedModel):
    """A DFlash draft model loadable with ``AutoModel.from_pretrained(dir, trust_remote_code=True)``.

    Same call as the published reference ``DFlashDraftModel``::

        hidden = drafter(target_hidden=features, noise_embedding=target_embed(block_ids),
                         position_ids=positions)            # [B, Q, H]
        logits = drafter.compute_logits(hidden, target.lm_head)

    ``features`` is the concatenation of the target's hidden states after the layers
    ``drafter.target_layer_ids`` (``hidden_states[i + 1]`` in transformers' indexing),
    ``block_ids`` is ``[anchor, mask_token_id, ...]`` (``drafter.block_size`` slots),
    ``positions`` covers the context then the block.
    """

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self._build_dflash(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, RotaryEmbedding):
            with torch.no_grad():
                module.inv_freq.copy_(module._inv_freq(module.inv_freq.device))
        else:  # Linear: normal(initializer_range); RMSNorm: ones (matched by class name)
            super()._init_weights(module)

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Hidden states ``[B, Q, H]`` of the block slots, after the final norm.

        Args:
            position_ids: ``[B, C+Q]`` positions of the context, then of the block slots.
            attention_mask: optional ``[B, 1, Q, K]`` (bool, True = attend, or additive
                float); ``None``: every slot sees every key (one block after its context).
            noise_embedding: ``[B, Q, H]`` the target's embedding of the block ids.
            target_hidden: ``[B, C, k*H]`` the target's features of the context positions.
            past_key_values: a :class:`DraftContextCache` (keeps only context keys) or a
                transformers ``Cache`` (keeps everything; crop it to the accepted context
                after verification, as the reference loop does).
            use_cache: accepted for the reference loop's call; the cache is used when given.
        """
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel needs noise_embedding and target_hidden")
        return self._draft(target_hidden, noise_embedding, position_ids, attention_mask, past_key_values)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module | torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary from the target's LM head (module or weight), or from
        the drafter's own rows (``draft_head``) when it has them."""
        weight = output_head if isinstance(output_head, torch.Tensor) else output_head.weight
        return self.draft_logits(hidden, weight)
