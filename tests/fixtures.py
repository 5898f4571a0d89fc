"""The tiny models and the tiny job every test builds on, in one place.

- ``make_tiny_target``: a random transformers Llama/Qwen3 with the SmolLM2
  tokenizer, saved to a directory (a ``target.model`` for real processes;
  ``conftest.tiny_llama_dir`` is the session-wide default one);
- ``write_config``: the job config of a test that starts real processes
  (``deploy.launcher.Job``) on loopback with free ports, for that target;
- ``tiny_drafter_config`` / ``tiny_drafter``: the drafter model of the unit
  tests (hidden ``TINY_HIDDEN``, vocabulary ``TINY_VOCAB``, ``TINY_CAPTURED``
  of ``TINY_TARGET_LAYERS`` target layers), without any target.

``tests/messages.py`` holds the valid control-plane messages.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from tests.ports import free_ports

# ---------------------------------------------------------------------------
# Tiny target: a real model on disk


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The SmolLM2 tokenizer (vocab 49152) the tiny targets use, loaded once per process."""
    from common.model_loader import load_tokenizer

    return load_tokenizer("smollm2")


def make_tiny_target(directory: Path, *, arch: str = "llama", num_layers: int = 6, hidden: int = 64, seed: int = 0) -> Path:
    """Save a random model with the SmolLM2 tokenizer (vocab 49152) to ``directory``; returns it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    tokenizer = smollm2_tokenizer()
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    config = Qwen3Config(head_dim=hidden // 4, **common) if arch == "qwen3" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------
# Tiny job: the config of the processes an integration test starts


def write_config(tmp: Path, model: str, *, drafters: dict[str, dict], extra: str = "",
                 sections: dict[str, list[str]] | None = None) -> Path:
    """``tmp/job.toml``: run ``it`` under ``tmp/runs``, loopback on free ports, gloo, 64-token samples.

    ``drafters`` adds a ``[drafters.<id>]`` table per drafter; ``sections`` adds
    ``key = value`` lines to a table; ``extra`` is appended as is.
    """
    control, store, metrics = free_ports(3)
    lines = [
        "[run]", 'name = "it"', f'root_dir = "{tmp / "runs"}"',
        "[control]", f'address = "tcp://127.0.0.1:{control}"', f"store_port = {store}",
        "heartbeat_interval_s = 0.5", "heartbeat_timeout_s = 5.0", "handshake_timeout_s = 10.0",
        "[metrics]", f'address = "tcp://127.0.0.1:{metrics}"', "log_every_steps = 2", "window_s = 0.5",
        "[target]", f'model = "{model}"', "num_captured_layers = 3", "threads = 1",
        "[data]", "max_seq_len = 64", "bucket_lengths = [32, 64]", "tokens_per_batch = 256", "max_samples = 80",
        "[transport]", 'kind = "gloo"', "timeout_s = 20.0",
        "[drafter]", "block_size = 8", "anchors_per_sequence = 3", "threads = 1", "checkpoint_every_steps = 4",
        "warmup_steps = 2", "max_steps = 0",
    ]
    for section, more in (sections or {}).items():
        at = lines.index(f"[{section}]") + 1
        lines[at:at] = more
    for drafter_id, values in drafters.items():
        lines.append(f"[drafters.{drafter_id}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp / "job.toml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


# ---------------------------------------------------------------------------
# Tiny drafter: the DFlash model of the unit tests, no target needed

TINY_HIDDEN = 32
TINY_VOCAB = 64
TINY_TARGET_LAYERS = 6
TINY_CAPTURED = 2  # target layers the drafter reads: features are TINY_CAPTURED * TINY_HIDDEN wide
TINY_BLOCK = 4


def tiny_drafter_config(*, vocab_size: int = TINY_VOCAB, **overrides):
    """``make_drafter_config`` of the tiny drafter: one layer, 2 heads (1 KV) of 16, mask token = last id.

    Any keyword of ``make_drafter_config`` overrides its value.
    """
    from drafter_worker.model.dflash_model import build_target_layer_ids, make_drafter_config

    kwargs = dict(
        hidden_size=TINY_HIDDEN, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
        vocab_size=vocab_size, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
        num_hidden_layers=1, num_target_layers=TINY_TARGET_LAYERS,
        target_layer_ids=build_target_layer_ids(TINY_TARGET_LAYERS, TINY_CAPTURED),
        block_size=TINY_BLOCK, mask_token_id=vocab_size - 1,
    )
    kwargs.update(overrides)
    return make_drafter_config(**kwargs)


def tiny_drafter(seed: int = 0, **overrides):
    """A fresh ``DFlashDrafter`` of ``tiny_drafter_config(**overrides)``, its weights drawn after
    ``torch.manual_seed(seed)``."""
    from drafter_worker.model.dflash_model import DFlashDrafter

    torch.manual_seed(seed)
    return DFlashDrafter(tiny_drafter_config(**overrides))
