"""Starting a drafter's decoder layers as copies of the target's own (``drafter.init_target_layers``).

A DFlash layer has the target's layer layout (attention and SwiGLU MLP of the
same sizes), so the target's last layers are a starting point that already
turns a hidden state into the next token's: drafter layer j starts as target
layer ``layers[j]``, and ``fc`` starts by passing the captured layer just below
the first of them through unchanged, which is what that target layer reads.
On the quality recipe this took `make quality`'s tau from 1.56 to 1.81 at
the same steps (docs/recipe.md, eighth sweep and "Result").
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["copy_target_layers"]


@torch.no_grad()
def copy_target_layers(drafter: nn.Module, target_layers: nn.ModuleList, layers: list[int],
                       target_layer_ids: list[int]) -> bool:
    """Copy target layer ``layers[j]`` into drafter layer j; returns whether ``fc`` was set as well.

    Parameters the drafter layer has and the target's lacks (the q/k norms of a Llama
    target) keep their initialisation. A drafter with more key/value heads than the
    target repeats each target head for the query heads that share it, so attention
    computes what the target's grouped heads did. Raises ``ValueError`` when a layer
    does not exist or a shape differs otherwise.
    """
    if len(layers) > len(drafter.layers):
        raise ValueError(f"{len(layers)} target layers for a drafter of {len(drafter.layers)}")
    for j, lid in enumerate(layers):
        if not 0 <= lid < len(target_layers):
            raise ValueError(f"the target has no layer {lid} (it has {len(target_layers)})")
        own = drafter.layers[j].state_dict()
        theirs = {k: v for k, v in target_layers[lid].state_dict().items() if k in own}
        head_dim = drafter.layers[j].self_attn.head_dim
        for name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_proj.bias",
                     "self_attn.v_proj.bias"):
            if name in theirs and theirs[name].shape[0] < own[name].shape[0] \
                    and own[name].shape[0] % theirs[name].shape[0] == 0:
                w = theirs[name]
                rep = own[name].shape[0] // w.shape[0]
                theirs[name] = w.reshape(-1, head_dim, *w.shape[1:]).repeat_interleave(rep, 0).flatten(0, 1)
        wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in theirs.items() if v.shape != own[k].shape]
        if wrong:
            raise ValueError(f"target layer {lid} does not fit drafter layer {j}: " + "; ".join(wrong))
        if not any(k.endswith("proj.weight") for k in theirs):
            raise ValueError(f"target layer {lid} has no parameter a DFlash layer has (names: "
                             f"{sorted(target_layers[lid].state_dict())[:4]} ...)")
        drafter.layers[j].load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in theirs.items()}})
    below = layers[0] - 1 if layers else -1
    if below not in target_layer_ids:
        return False
    hidden = drafter.config.hidden_size
    slot = list(target_layer_ids).index(below)
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, slot * hidden:(slot + 1) * hidden] = torch.eye(hidden, device=drafter.fc.weight.device)
    drafter.hidden_norm.weight.copy_(target_layers[layers[0]].input_layernorm.weight)
    return True
