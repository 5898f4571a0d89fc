"""DFlash speculative decoding against a Hugging Face causal-LM target.

One draft-and-verify step (batch size 1):

1. The proposer drafts up to ``block_size - 1`` tokens after the anchor (the
   last token the target produced, not yet in the target's KV cache). A DFlash
   drafter does it in one pass over a block ``[anchor, mask, mask, ...]``,
   conditioned on the target features of every position before the anchor
   (or in a few denoising passes, each showing the next one a fixed draft).
2. The target runs once over ``[anchor, draft_1, ..., draft_n]`` with its KV
   cache and returns logits (and the captured layers' hidden states).
3. The longest prefix of drafts the target agrees with is accepted (greedy:
   equal to the target's argmax; sampling: the standard speculative-sampling
   rejection test), followed by the target's own next token (the correction,
   or the bonus token when every draft was accepted).
4. The target cache is cropped to the accepted positions; their captured
   features become new drafter context (the drafter caches its context
   keys/values and never caches block slots, so it needs no crop).

At temperature 0 the output equals the target's own greedy decoding token for
token. ``tau`` is the mean number of tokens a step produces (accepted drafts
plus the target's token), so plain decoding has ``tau == 1`` and a perfect
drafter ``tau == block_size``.

This is evaluation code: it reads tensors on the host once per step, which
the training hot path never does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
import torch.nn.functional as F

from drafter_worker.model.dflash_model import DFlashDrafter, DraftContextCache
from drafter_worker.model.modeling_dflash import causal_block_mask
from tools.small_linears import prepack, small_row_linear, small_row_linears

__all__ = [
    "DFlashProposer",
    "GenerationResult",
    "Proposer",
    "SpecStats",
    "crop_cache",
    "evaluation_decoding",
    "plain_generate",
    "row_exact_attention",
    "speculative_generate",
    "target_features",
]


class Proposer(Protocol):
    """What :func:`speculative_generate` asks for drafts.

    ``layer_ids`` names the target layers whose outputs the proposer reads
    (``None``: it reads none and the target is run without hidden states).
    """

    block_size: int
    layer_ids: list[int] | None

    def reset(self) -> None:
        """Forget everything about the previous sequence."""

    def propose(self, features: torch.Tensor | None, anchor: int, start: int, num_draft: int,
                tokens: Sequence[int] = ()) -> torch.Tensor:
        """Logits ``[n, V]`` of the drafts after the anchor, ``1 <= n <= num_draft`` (a proposer
        may stop early where it expects a later draft to be rejected).

        ``features`` ``[1, C, k*H]`` are the target features of positions
        ``start - C .. start - 1`` (every position since the previous call;
        ``None`` when ``layer_ids`` is None); ``anchor`` is the token at
        position ``start``; draft ``i`` is for position ``start + 1 + i``;
        ``tokens`` are the sequence's tokens at positions ``0 .. start``.
        """
        ...


@dataclass
class GenerationResult:
    """One prompt's generation.

    ``step_tokens[i]`` is how many tokens step ``i`` produced (accepted drafts
    plus the target's own token); ``step_drafts[i]`` how many it drafted.
    The first token comes from the prefill and counts in no step.
    """

    tokens: list[int]
    step_tokens: list[int] = field(default_factory=list)
    step_drafts: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.step_tokens) / len(self.step_tokens) if self.step_tokens else float("nan")

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass
class SpecStats:
    """Acceptance statistics over many generations.

    ``drafted[k]`` counts the steps that drafted a token for block position
    ``k`` (1-based: position ``k`` is ``k`` tokens after the anchor) and
    ``accepted[k]`` those whose first ``k`` drafts were all accepted.
    """

    block_size: int
    steps: int = 0
    tokens: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafted = self.drafted or [0] * self.block_size
        self.accepted = self.accepted or [0] * self.block_size

    def add(self, result: GenerationResult) -> None:
        for produced, drafted in zip(result.step_tokens, result.step_drafts):
            self.steps += 1
            self.tokens += produced
            for k in range(1, min(drafted, self.block_size - 1) + 1):
                self.drafted[k] += 1
                # produced - 1 drafts were accepted (the last token is the target's).
                self.accepted[k] += int(produced - 1 >= k)

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else float("nan")

    @property
    def drafted_total(self) -> int:
        """Drafts verified over all steps."""
        return sum(self.drafted)

    def acceptance_rate(self) -> list[float]:
        """P(draft k accepted) for k = 1 .. block_size-1: the share of steps that
        drafted position k and kept every draft up to it."""
        return [self.accepted[k] / self.drafted[k] if self.drafted[k] else float("nan")
                for k in range(1, self.block_size)]

    def conditional_acceptance_rate(self) -> list[float]:
        """P(draft k accepted | drafts 1..k-1 accepted), k = 1 .. block_size-1."""
        out = []
        for k in range(1, self.block_size):
            before = self.drafted[k] if k == 1 else self.accepted[k - 1]
            out.append(self.accepted[k] / before if before else float("nan"))
        return out


# ---------------------------------------------------------------------------
# Target helpers
# ---------------------------------------------------------------------------


def target_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the outputs of ``layer_ids`` (``hidden_states[i + 1]``: index 0 is the embeddings)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def crop_cache(cache: Any, length: int) -> None:
    """Drop cached positions from ``length`` on (transformers 4.x and 5.x agree on negative crops)."""
    remove = cache.get_seq_length() - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if remove:
        cache.crop(-remove)


def _new_cache(target: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.config)
    except TypeError:  # pragma: no cover - transformers 4.x takes no config
        return DynamicCache()


def _device(target: Any) -> torch.device:
    return target.get_input_embeddings().weight.device


@functools.lru_cache(maxsize=None)
def _forward_parameters(model_type: type) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(model_type.forward).parameters)
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return frozenset()


def _cache_argument(target: Any) -> str:
    """``cache`` (recent transformers) or ``past_key_values`` (older, deprecated since)."""
    return "cache" if "cache" in _forward_parameters(type(target)) else "past_key_values"


def _target_forward(target: Any, ids: list[int], start: int, cache: Any, *, hidden: bool, last_only: bool):
    device = _device(target)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    position_ids = torch.arange(start, start + len(ids), device=device)[None]
    kwargs: dict[str, Any] = {}
    if last_only and "logits_to_keep" in _forward_parameters(type(target)):
        kwargs["logits_to_keep"] = 1  # the prompt's other logits are never read
    kwargs[_cache_argument(target)] = cache
    return target(
        input_ids=input_ids,
        position_ids=position_ids,
        use_cache=True,
        output_hidden_states=hidden,
        **kwargs,
    )


@contextlib.contextmanager
def row_exact_attention(target: Any) -> Iterator[None]:
    """Inside the block a CPU target in bf16 or fp16 attends through plain matmuls ("eager" attention).

    A verification's query rows must round as a plain step's single row does, or speculative output
    drifts from greedy decoding. PyTorch's fused CPU attention does not promise that across query
    lengths; in bf16 it flipped greedy tokens on 10 of 12 SmolLM2 prompts, eager attention on none
    (session 35, with :mod:`tools.small_linears`). A float32 target keeps its fused attention: there
    the difference stays near 1e-7, no evaluation has found a flipped token (each counts them), and
    eager attention costs a plain step 13 % there.
    """
    weight = target.get_input_embeddings().weight
    before = getattr(target.config, "_attn_implementation", None)
    if weight.device.type != "cpu" or weight.dtype == torch.float32 or before in (None, "eager"):
        yield
        return
    target.set_attn_implementation("eager")
    try:
        yield
    finally:
        target.set_attn_implementation(before)


@contextlib.contextmanager
def evaluation_decoding(target: Any, *drafters: Any) -> Iterator[None]:
    """How evaluation decodes, plain and speculative runs alike: the few-row linear layers of
    :mod:`tools.small_linears` and :func:`row_exact_attention`, so a row rounds the same in a
    verification as in a plain step and speculative output stays the target's greedy output."""
    with small_row_linears(target, *drafters), row_exact_attention(target):
        yield


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax(dim=-1))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _stop_at(tokens: list[int], stop: set[int]) -> tuple[list[int], bool]:
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[: i + 1], True
    return tokens, False


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------


def _verify_greedy(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """``(accepted drafts, target's next token)`` for greedy verification."""
    posterior = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == posterior[accepted]:
        accepted += 1
    return accepted, posterior[accepted]


def _verify_sampled(
    draft: list[int],
    draft_probs: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling: keeps the target's sampling distribution exactly.

    Draft ``i`` is accepted with probability ``min(1, p_i(d) / q_i(d))``; at
    the first rejection the token is drawn from ``max(0, p_i - q_i)``
    renormalised, and after a fully accepted block from ``p_n``.
    """
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [n+1, V]
    n = len(draft)
    if n:
        ids = torch.tensor(draft, device=p.device)[:, None]
        p_d = p[:n].gather(1, ids)[:, 0]
        q_d = draft_probs.gather(1, ids)[:, 0]
        u = torch.rand(n, generator=generator, device=p.device)
        keep = (u * q_d < p_d).to(torch.int64)
        accepted = int(keep.cumprod(0).sum())
    else:
        accepted = 0
    if accepted == n:
        return accepted, int(torch.multinomial(p[n], 1, generator=generator))
    residual = (p[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    dist = residual / total if float(total) > 0 else p[accepted]
    return accepted, int(torch.multinomial(dist, 1, generator=generator))


@torch.inference_mode()
def speculative_generate(
    target: Any,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    draft_tokens: int | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` with draft-and-verify steps.

    Stops after a token in ``stop_token_ids`` (which is kept). At
    ``temperature`` 0 the tokens equal :func:`plain_generate`'s.
    ``draft_tokens`` caps the drafts a step verifies (default ``block_size - 1``,
    the whole block): the drafter still drafts the block in one pass, but the
    target verifies fewer tokens, which pays where the later positions are
    rarely accepted and verification costs grow with its length (a CPU).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty")
    stop = {int(t) for t in stop_token_ids}
    block_size = int(proposer.block_size)
    max_draft = block_size - 1 if draft_tokens is None else int(draft_tokens)
    if not 1 <= max_draft <= block_size - 1:
        raise ValueError(f"draft_tokens must be in 1..{block_size - 1} (block size {block_size}), got {draft_tokens}")
    layer_ids = proposer.layer_ids
    proposer.reset()
    cache = _new_cache(target)

    began = time.perf_counter()
    out = _target_forward(target, prompt, 0, cache, hidden=layer_ids is not None, last_only=True)
    first = _sample(out.logits[0, -1], temperature, generator)
    pending = target_features(out.hidden_states, layer_ids) if layer_ids is not None else None
    tokens = [first]
    result = GenerationResult(tokens=tokens, prefill_s=time.perf_counter() - began)

    began = time.perf_counter()
    start = len(prompt)  # position of the anchor: the last produced token, not yet cached
    stopped = first in stop
    while not stopped and len(tokens) < max_new_tokens:
        remaining = max_new_tokens - len(tokens)
        num_draft = min(max_draft, remaining - 1)
        anchor = tokens[-1]
        draft: list[int] = []
        draft_probs = None
        if num_draft > 0:
            draft_logits = proposer.propose(pending, anchor, start, num_draft, prompt + tokens)
            pending = None
            if temperature > 0:
                draft_probs = torch.softmax(draft_logits.float() / temperature, dim=-1)
                draft = torch.multinomial(draft_probs, 1, generator=generator)[:, 0].tolist()
            else:
                draft = draft_logits.argmax(dim=-1).tolist()
        out = _target_forward(target, [anchor, *draft], start, cache, hidden=layer_ids is not None, last_only=False)
        logits = out.logits[0]
        if temperature > 0:
            accepted, correction = _verify_sampled(draft, draft_probs, logits, temperature, generator)
        else:
            accepted, correction = _verify_greedy(draft, logits)
        new, stopped = _stop_at(draft[:accepted] + [correction], stop)
        tokens.extend(new)
        result.step_tokens.append(len(new))
        result.step_drafts.append(len(draft))
        # The anchor and the accepted drafts stay in the target cache and
        # become drafter context; the correction is the next anchor.
        crop_cache(cache, start + accepted + 1)
        if layer_ids is not None:
            fresh = target_features(out.hidden_states, layer_ids)[:, : accepted + 1]
            pending = fresh if pending is None else torch.cat([pending, fresh], dim=1)
        start += accepted + 1
    result.decode_s = time.perf_counter() - began
    return result


@torch.inference_mode()
def plain_generate(
    target: Any,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """The target alone, one token per forward pass with a KV cache (the baseline)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty")
    stop = {int(t) for t in stop_token_ids}
    cache = _new_cache(target)
    began = time.perf_counter()
    out = _target_forward(target, prompt, 0, cache, hidden=False, last_only=True)
    tokens = [_sample(out.logits[0, -1], temperature, generator)]
    result = GenerationResult(tokens=tokens, prefill_s=time.perf_counter() - began)
    began = time.perf_counter()
    while tokens[-1] not in stop and len(tokens) < max_new_tokens:
        pos = len(prompt) + len(tokens) - 1
        out = _target_forward(target, [tokens[-1]], pos, cache, hidden=False, last_only=True)
        tokens.append(_sample(out.logits[0, -1], temperature, generator))
        result.step_tokens.append(1)
        result.step_drafts.append(0)
    result.decode_s = time.perf_counter() - began
    return result


# ---------------------------------------------------------------------------
# The DFlash drafter as a proposer
# ---------------------------------------------------------------------------


class DFlashProposer:
    """Drafts a block in :class:`DFlashDrafter` passes (one, unless the drafter denoises in several).

    The drafter reads the target's frozen token embedding (for the block
    ``[anchor, mask, ...]``) and LM head (for the draft logits); it keeps the
    context keys/values of the current sequence in a :class:`DraftContextCache`.
    With ``denoise_passes`` p > 1 (default: the drafter's own, ``drafter.denoise_passes``
    when it was trained), pass i fixes draft slot i + 1 to its argmax and the next pass
    sees that token in place of the mask; the last pass drafts every slot left. Each
    slot's returned logits are those of the pass that fixed it, so greedy verification
    is exact, and sampled verification stays exact too (each draft is still drawn from
    the logits reported for it; only the later passes condition on the argmax).

    With ``draft_confidence`` c > 0 the drafts end before the first slot where the
    drafter's own probability that it and every slot before it are right (the product
    of their top probabilities) falls below c: no pass refines those slots and the target
    does not verify them. Where verifying a token costs (a CPU), that buys more speed than
    the rarely accepted drafts it drops; the choice reads only the drafter's logits, so
    greedy and sampled verification stay exact.
    """

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 denoise_passes: int | None = None, draft_confidence: float = 0.0) -> None:
        if embed_weight.shape[1] != drafter.config.hidden_size:
            raise ValueError(f"the target's hidden size {embed_weight.shape[1]} != the drafter's "
                             f"{drafter.config.hidden_size}: this drafter was trained for another target")
        self.drafter = drafter.eval()
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        # The rows the drafter scores (the target's, all of them unless it has a draft vocabulary, or its own), once.
        self._draft_head = drafter.head_and_labels(lm_head_weight)[0].detach()
        self._draft_head_packed = prepack(self._draft_head)
        self._draft_vocab = drafter.draft_vocab.to(lm_head_weight.device) if drafter.draft_vocab_size else None
        self.block_size = drafter.block_size
        passes = int(getattr(drafter, "denoise_passes", 1) if denoise_passes is None else denoise_passes)
        if not 1 <= passes <= self.block_size - 1:
            raise ValueError(f"denoise_passes must be in 1..{self.block_size - 1} for a block of {self.block_size}, "
                             f"got {passes}")
        if drafter.causal_passes and passes != self.block_size - 1:
            raise ValueError(f"this drafter drafts causally, one slot a pass: denoise_passes must be "
                             f"{self.block_size - 1}, got {passes}")
        self.denoise_passes = passes
        if not 0.0 <= draft_confidence < 1.0:
            raise ValueError(f"draft_confidence must be in [0, 1), got {draft_confidence}")
        self.draft_confidence = float(draft_confidence)
        self.passes_taken = 0  # drafter passes run so far (all sequences): the drafting cost
        self.layer_ids: list[int] | None = list(drafter.target_layer_ids)
        self.cache = DraftContextCache(len(drafter.layers))

    def reset(self) -> None:
        self.cache = DraftContextCache(len(self.drafter.layers))

    @torch.inference_mode()
    def propose(self, features: torch.Tensor | None, anchor: int, start: int, num_draft: int,
                tokens: Sequence[int] = ()) -> torch.Tensor:
        if features is None:
            raise ValueError("DFlashProposer needs target features")
        ctx_new = features.shape[1]
        if len(self.cache) + ctx_new != start:
            raise ValueError(f"drafter context out of step: {len(self.cache)} cached + {ctx_new} new "
                             f"positions, but the anchor is at {start}")
        dtype = self.drafter.fc.weight.dtype
        device = self.drafter.fc.weight.device
        features = features.to(device=device, dtype=dtype)
        if self.drafter.causal_passes:
            return self._propose_causal(features, anchor, start, num_draft)
        block = torch.full((1, self.block_size), self.drafter.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = anchor
        # Always the full block the drafter was trained on, even when fewer drafts are needed.
        positions = torch.arange(start - ctx_new, start + self.block_size, device=device)[None]
        logits = self._pass(features, block, positions, 0, num_draft)
        for fixed in range(1, min(self.denoise_passes, num_draft)):
            if self._confident_drafts(logits[:fixed]) < fixed:
                break  # slot `fixed` will be cut: refining the slots after it cannot pay
            # The context is cached now: later passes feed only the block, with slot `fixed` shown.
            block[0, fixed] = self._token(logits[fixed - 1])
            later = self._pass(features[:, :0], block, positions[:, ctx_new:], fixed, num_draft)
            logits = torch.cat([logits[:fixed], later])
        # A step verifies one draft at least.
        return self._full_vocab(logits[: max(1, self._confident_drafts(logits))])

    def _propose_causal(self, features: torch.Tensor, anchor: int, start: int, num_draft: int) -> torch.Tensor:
        """A causally drafted block, one slot a pass: pass k feeds the token of slot k - 1 (the anchor
        first) and the mask of slot k; the token's keys/values stay cached for the later passes, so
        no pass recomputes the block (a CPU pass costs what its rows cost)."""
        device = features.device
        pair = torch.full((1, 2), self.drafter.mask_token_id, dtype=torch.long, device=device)
        token, rows = anchor, []
        self.cache.keep_block = 1
        try:
            for slot in range(1, num_draft + 1):
                pair[0, 0] = token
                positions = torch.arange(start + slot - 1 - features.shape[1], start + slot + 1, device=device)[None]
                rows.append(self._pass(features, pair, positions, 0, 1)[0])
                features = features[:, :0]  # the context is cached now
                if self._confident_drafts(torch.stack(rows)) < slot:
                    break  # this slot is cut: drafting the next cannot pay
                token = self._token(rows[-1])
        finally:
            self.cache.keep_block = 0
            self.cache.crop(start)  # the drafts' keys/values go; the verified context comes next
        logits = torch.stack(rows)
        return self._full_vocab(logits[: max(1, self._confident_drafts(logits))])

    def _confident_drafts(self, logits: torch.Tensor) -> int:
        """How many leading drafts of ``logits`` the drafter gives at least ``draft_confidence``
        chance of being right all together."""
        if not self.draft_confidence:
            return logits.shape[0]
        chain = torch.softmax(logits.float(), dim=-1).amax(dim=-1).cumprod(0)
        return int((chain >= self.draft_confidence).sum())

    def _pass(self, features: torch.Tensor, block: torch.Tensor, positions: torch.Tensor, first: int,
              num_draft: int) -> torch.Tensor:
        """Draft logits of slots ``first + 1 .. num_draft`` from one drafter pass over ``block``."""
        self.passes_taken += 1
        noise = F.embedding(block, self.embed_weight.to(block.device)).to(features.dtype)
        mask = None  # bidirectional block: every slot sees every slot
        if self.drafter.causal_passes:
            mask = causal_block_mask(len(self.cache) + features.shape[1], block.shape[1], block.device)
        hidden = self.drafter(features, noise, positions, mask, context_cache=self.cache)
        head = self._draft_head
        drafts = hidden[0, 1 + first : 1 + num_draft].to(device=head.device, dtype=head.dtype)
        # The few rows of a block: the faster of F.linear and W @ x^T on this machine (tools/small_linears.py).
        return small_row_linear(drafts, head, None, self._draft_head_packed)

    def _token(self, row: torch.Tensor) -> int:
        """The target token id of a draft row's argmax."""
        best = int(row.argmax())
        return best if self._draft_vocab is None else int(self._draft_vocab[best])

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self._draft_vocab is None:
            return logits
        # A draft vocabulary: scores for its ids, -inf for every other target token.
        full = logits.new_full((logits.shape[0], self.lm_head_weight.shape[0]), float("-inf"))
        full[:, self._draft_vocab] = logits
        return full
