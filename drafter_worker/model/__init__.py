"""The DFlash drafter: its architecture (``modeling_dflash``, the file an export ships), training
additions (``dflash_model``: anchors, block layout, loss, initial scales, save/load), the LM-head
loss implementations (``lm_loss``) and its device-side metric accumulators (``device_metrics``).

Only the drafter side and the tools that load drafters import this package; the target server
needs nothing of it (the captured-layer rule it shares is :mod:`common.layer_ids`).
"""
