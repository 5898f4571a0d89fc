"""Building a drafter from the target's WELCOME: fresh, from ``drafter.init_from``, or checked against a resume.

Everything a drafter copies from its target (architecture, vocabulary, mask
token, captured layers, the data's identity) arrives in the WELCOME; these
functions turn it into a model, or refuse with a :class:`FatalError` that says
what does not match.
"""

from __future__ import annotations

import logging
import os

import torch

from common import protocol as P
from common.config import DrafterConfig, TargetConfig
from drafter_worker.checkpoint import Coverage, InitFromError, TrainerState, load_init_from
from drafter_worker.connection import FatalError, TargetUnavailable
from drafter_worker.model.dflash_model import DFlashDrafter, make_drafter_config, resolve_layer_types
from drafter_worker.model.target_layers import copy_target_layers

logger = logging.getLogger(__name__)


def new_state(dcfg: DrafterConfig, welcome: P.Welcome, init_from: str = "") -> TrainerState:
    """The state of a drafter that starts training now (one coverage per target replica)."""
    return TrainerState(0, [Coverage() for _ in range(welcome.replicas)], dcfg.id, welcome.model_id,
                        train_samples=welcome.train_samples, data_fingerprint=welcome.data_fingerprint,
                        batches_per_epoch=welcome.batches_per_epoch, init_from=init_from,
                        topology_id=welcome.topology_id)


def check_layers(model: DFlashDrafter, welcome: P.Welcome, what: str) -> None:
    if list(model.target_layer_ids) != list(welcome.target_layer_ids):
        raise FatalError(f"{what} was built for target layers {list(model.target_layer_ids)}, "
                         f"the target captures {welcome.target_layer_ids}")


def check_data(state: TrainerState, welcome: P.Welcome, what: str) -> None:
    """Refuse to continue training made on other data; otherwise record the target's data in the state."""
    ours, theirs = state.data_fingerprint, welcome.data_fingerprint
    if ours and ours != theirs:
        raise FatalError(
            f"{what} was trained on data with fingerprint {ours}, but the target serves data with fingerprint "
            f"{theirs or '(none)'}; start a new run (another run.name) or restore the data this run was started with"
        )
    state.data_fingerprint = theirs
    state.train_samples = welcome.train_samples
    state.batches_per_epoch = welcome.batches_per_epoch


def fresh_model(dcfg: DrafterConfig, welcome: P.Welcome, device: torch.device) -> DFlashDrafter:
    """A randomly initialised drafter shaped after the target (the same weights on every rank: one seed)."""
    arch = welcome.target_arch
    config = make_drafter_config(
        hidden_size=welcome.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=dcfg.num_key_value_heads or arch.num_key_value_heads,
        head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size,
        vocab_size=welcome.vocab_size,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        num_hidden_layers=dcfg.num_layers,
        num_target_layers=welcome.num_target_layers,
        target_layer_ids=welcome.target_layer_ids,
        block_size=dcfg.block_size,
        mask_token_id=welcome.mask_token_id,
        draft_vocab_size=min(dcfg.draft_vocab_size, welcome.vocab_size),
        layer_types=dcfg.layer_types,
        sliding_window=dcfg.sliding_window,
        denoise_passes=dcfg.denoise_passes,
        causal_passes=dcfg.causal_passes,
        draft_head=dcfg.train_draft_head,
    )
    torch.manual_seed(dcfg.seed)
    model = DFlashDrafter(config).to(device)
    if model.draft_vocab_size:
        set_draft_vocab(model, welcome)
    return model


def set_draft_vocab(model: DFlashDrafter, welcome: P.Welcome) -> None:
    """The K tokens the target's training answers use most; ids the data never uses fill the rest."""
    k = model.draft_vocab_size
    ranked = list(dict.fromkeys(welcome.token_ranking))[:k]
    if any(not 0 <= t < welcome.vocab_size for t in ranked):
        raise FatalError("the target's token ranking holds ids outside its vocabulary")
    seen = set(ranked)
    ranked += [t for t in range(welcome.vocab_size) if t not in seen][: k - len(ranked)]
    model.set_draft_vocab(ranked)
    logger.info("[model] draft vocabulary: the %d most used of %d answer tokens (of %d)", k,
                len(welcome.token_ranking), welcome.vocab_size)


def model_from_init(dcfg: DrafterConfig, welcome: P.Welcome, device: torch.device) -> DFlashDrafter:
    """A fresh start from the trained drafter ``drafter.init_from`` names, checked against this target."""
    try:
        model = load_init_from(
            dcfg.init_from, device, hidden_size=welcome.hidden_size, vocab_size=welcome.vocab_size,
            target_layer_ids=welcome.target_layer_ids, mask_token_id=welcome.mask_token_id,
            block_size=dcfg.block_size,
        )
    except InitFromError as exc:
        raise FatalError(str(exc)) from None
    config = model.config
    theirs = (len(model.layers), list(config.layer_types or []), getattr(config, "sliding_window", None) or 0)
    ours = (dcfg.num_layers, resolve_layer_types(dcfg.num_layers, dcfg.layer_types, dcfg.sliding_window),
            dcfg.sliding_window)
    own_head = model.draft_head is not None
    if (ours != theirs or (dcfg.draft_vocab_size and dcfg.draft_vocab_size != model.draft_vocab_size)
            or dcfg.train_draft_head != own_head):
        logger.warning("[model] drafter.init_from %s sets the architecture: %d layers %s, sliding window %s, "
                       "draft vocabulary %s, %s LM head (drafter.num_layers, layer_types, sliding_window, "
                       "draft_vocab_size and train_draft_head are not used)", dcfg.init_from, theirs[0], theirs[1],
                       theirs[2] or "none", model.draft_vocab_size or "none", "its own" if own_head else "the target's")
    logger.info("[model] drafter %s starts from the trained drafter %s", dcfg.id, dcfg.init_from)
    return model


def teacher_norm(dcfg: DrafterConfig, welcome: P.Welcome, device: torch.device) -> tuple[torch.Tensor, float] | None:
    """The target's final norm for the soft-target loss (drafter.distill_weight > 0), checked against what it captures."""
    if dcfg.distill_weight <= 0:
        return None
    last = welcome.num_target_layers - 1
    if welcome.target_layer_ids[-1] != last or not welcome.final_norm_weight:
        raise FatalError(
            f"drafter.distill_weight = {dcfg.distill_weight} needs the target's own distribution: the target must "
            f"capture its last layer ({last}) as the last of target.target_layer_ids (it captures "
            f"{welcome.target_layer_ids}) and have a final RMSNorm ({'sent' if welcome.final_norm_weight else 'none'})")
    weight = torch.tensor(welcome.final_norm_weight, dtype=torch.float32, device=device)
    return weight, float(welcome.target_arch.rms_norm_eps)


def copy_target_layers_into(model: DFlashDrafter, target_cfg: TargetConfig, dcfg: DrafterConfig,
                            welcome: P.Welcome, *, load: bool = True) -> bool:
    """``drafter.init_target_layers``: load ``target.model`` on this host and copy those layers into the fresh
    ``model``; returns whether ``fc`` now passes the captured layer below them through (no feature scaling then).
    The loaded model must be the one the target serves: same depth, sizes and final norm. With ``load=False``
    (ranks other than 0, which DDP's first round gives rank 0's weights) only the checks and the answer."""
    # Only this start needs the target's own weights: the drafter otherwise gets all it needs at WELCOME.
    from common.model_loader import ModelLoadError, decoder_layers, final_norm_weight, load_target

    layers = list(dcfg.init_target_layers)
    what = f"drafter.init_target_layers = {layers}"
    beyond = [i for i in layers if i >= welcome.num_target_layers]
    if beyond:
        raise FatalError(f"{what}: the target has {welcome.num_target_layers} layers, no layer {beyond[0]}")
    if not load:
        return layers[0] - 1 in welcome.target_layer_ids
    try:
        loaded = load_target(target_cfg.model, tokenizer_source=target_cfg.tokenizer or None)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise FatalError(f"{what} needs target.model = {target_cfg.model!r} on the drafter's host: {exc}") from None
    ours = (loaded.num_layers, loaded.hidden_size, loaded.vocab_size)
    theirs = (welcome.num_target_layers, welcome.hidden_size, welcome.vocab_size)
    norm = final_norm_weight(loaded.model)
    same_norm = not welcome.final_norm_weight or (norm is not None and torch.allclose(
        norm[0].float(), torch.tensor(welcome.final_norm_weight), rtol=0, atol=1e-6))
    if ours != theirs or not same_norm:
        raise FatalError(f"{what}: target.model = {target_cfg.model!r} here is not the model the target serves "
                         f"(layers, hidden, vocabulary {ours} vs {theirs}"
                         f"{'' if same_norm else '; another final norm'})")
    try:  # copies from the host model into the drafter's device, once at start-up
        fc_set = copy_target_layers(model, decoder_layers(loaded.model), layers, welcome.target_layer_ids)
    except ValueError as exc:
        raise FatalError(f"{what}: {exc}") from None
    below = f"; fc reads captured layer {layers[0] - 1} through" if fc_set else ""
    logger.info("[model] drafter %s starts its layers as copies of target layers %s%s", dcfg.id, layers, below)
    return fc_set


def init_from_path(dcfg: DrafterConfig) -> str:
    return os.path.abspath(dcfg.init_from) if dcfg.init_from else ""


def plan_steps(welcome: P.Welcome, dcfg: DrafterConfig, world_size: int) -> int:
    """Optimizer steps the plan the target announced makes (0 = unlimited): each step trains one batch per rank."""
    if welcome.plan_batches < 0:
        raise TargetUnavailable(f"target announced a negative plan length ({welcome.plan_batches})")
    return -(-welcome.plan_batches // world_size) * dcfg.steps_per_batch
