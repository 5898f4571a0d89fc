"""Capture the DFlash layers' hidden states straight into a pre-allocated buffer.

Forward hooks on the chosen decoder layers copy each layer's output into its
slice of the feature buffer (``[B, T, k*H]``), so there is no intermediate
``output_hidden_states`` tuple and no extra concatenation. The hook on the last
captured layer stops the forward: the later layers, the final norm and the LM
head never run (the drafter does not need the target's logits).
"""

from __future__ import annotations

import torch
from torch import nn

from common.model_loader import decoder_layers


class _StopForward(Exception):
    pass


class LayerCapture:
    def __init__(self, model: nn.Module, layer_ids: list[int]):
        layers = decoder_layers(model)
        if not layer_ids or max(layer_ids) >= len(layers) or min(layer_ids) < 0:
            raise ValueError(f"captured layer ids {layer_ids} out of range for a {len(layers)}-layer target")
        self.model = model
        self.layer_ids = list(layer_ids)
        self.hidden_size = int(model.config.hidden_size)
        self._out: torch.Tensor | None = None
        self._last = max(layer_ids)
        self._handles = [
            layers[layer_id].register_forward_hook(self._make_hook(slot, layer_id))
            for slot, layer_id in enumerate(self.layer_ids)
        ]

    def _make_hook(self, slot: int, layer_id: int):
        h = self.hidden_size
        lo, hi = slot * h, (slot + 1) * h

        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._out[..., lo:hi].copy_(hidden)
            if layer_id == self._last:
                raise _StopForward

        return hook

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, features_out: torch.Tensor) -> None:
        """Fill ``features_out`` [B, T, k*H] with the captured layers' outputs for ``input_ids`` [B, T].

        Sequences are right-padded; with causal attention the padding never
        influences real positions, so no attention mask is needed.
        """
        self._out = features_out
        try:
            self.model(input_ids=input_ids, use_cache=False)
        except _StopForward:
            pass
        finally:
            self._out = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
