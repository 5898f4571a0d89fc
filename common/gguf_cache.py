"""On-disk cache of de-quantized GGUF models: a GGUF is converted once, later loads read the result.

A GGUF load parses the file's metadata (once: common/gguf_parse_once.py),
builds the tokenizer from it and de-quantizes every tensor: about 20 s for
the 105 MB SmolLM2 file on these CPUs, paid by every target, drafter (its
copied layers), evaluation and export process. Loading the same weights from
a safetensors directory takes a fraction of a second.

An entry is a transformers directory (``config.json``, ``model.safetensors``,
the tokenizer's files) named by a key over the GGUF's content, the dtype it
was de-quantized to and the transformers version, so a changed file, dtype
or converter misses instead of reading stale weights. The tensors are the
ones the GGUF load produced, bit for bit, and the tokenizer round-trips to
the same definition (the data fingerprint does not change).

An entry is written into a temporary directory, every file fsynced, with a
manifest of the files' sizes written last, then renamed into place: a reader
sees a whole entry or none. An entry that fails the manifest anyway (a bad
copy) is logged, deleted and rebuilt. The cache never stops a job: a
directory that cannot be written is logged and the job goes on without it.
Two processes that convert at once both write; the first rename wins.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from common.cache_home import cache_dir_from_env
from common.durable_io import fsync_path, write_durably

logger = logging.getLogger(__name__)

ENV_CACHE_DIR = "DFLASH_MODEL_CACHE_DIR"
# Bump when what an entry holds, or how it is written, changes.
CONVERTED_VERSION = 1
MANIFEST = "dflash-manifest.json"
_READ_CHUNK = 1 << 22


def resolve_cache_dir() -> Path | None:
    """``$DFLASH_MODEL_CACHE_DIR`` (``off``: no cache), else ``$XDG_CACHE_HOME/dflash/models`` (``~/.cache/...``)."""
    return cache_dir_from_env(ENV_CACHE_DIR, "models")


def entry_path(gguf_path: str | Path, dtype: torch.dtype) -> Path | None:
    """Where the conversion of ``gguf_path`` to ``dtype`` lives (None with the cache off)."""
    directory = resolve_cache_dir()
    if directory is None:
        return None
    import transformers

    digest = hashlib.sha256()
    try:
        with open(gguf_path, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
    except OSError:
        return None  # loading the GGUF itself reports what is wrong with it
    key = hashlib.sha256(json.dumps({
        "version": CONVERTED_VERSION, "gguf": digest.hexdigest(), "dtype": str(dtype),
        "transformers": transformers.__version__,
    }, sort_keys=True).encode()).hexdigest()[:32]
    return directory / f"{Path(gguf_path).stem[:60]}-{key}"


def lookup(entry: Path | None) -> Path | None:
    """``entry`` if it holds a whole conversion, else None (a damaged one is deleted so it gets rebuilt)."""
    if entry is None or not entry.is_dir():
        return None
    try:
        sizes = json.loads((entry / MANIFEST).read_text())
        damaged = [name for name, size in sizes.items() if (entry / name).stat().st_size != size]
    except (OSError, ValueError, AttributeError) as exc:
        damaged = [f"{MANIFEST} ({exc})"]
    if not damaged:
        return entry
    logger.warning("[load] converted-model cache entry %s is damaged (%s); deleting it and converting again",
                   entry, ", ".join(damaged))
    shutil.rmtree(entry, ignore_errors=True)
    return None


def store(entry: Path | None, model: Any, tokenizer: Any) -> None:
    """Write ``model`` (its config and tensors) and ``tokenizer`` as the entry ``entry``; never raises."""
    if entry is None or entry.exists():
        return
    tmp: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
        _write(tmp, model, tokenizer)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.exists():
                raise
            return  # another process converted the same model first
        tmp = None
        fsync_path(entry.parent)
        logger.info("[load] converted model cached in %s (later loads skip the GGUF)", entry)
    except Exception as exc:  # the cache is an optimisation: never stop the job for it
        logger.warning("[load] could not cache the converted model in %s: %s; the next load converts again",
                       entry.parent, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _write(directory: Path, model: Any, tokenizer: Any) -> None:
    from safetensors.torch import save_file

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF marker: the tensors written are de-quantized
    config.save_pretrained(directory)
    tied = getattr(config, "tie_word_embeddings", False)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)
    sizes = {}
    for path in sorted(directory.iterdir()):
        fsync_path(path)
        sizes[path.name] = path.stat().st_size
    write_durably(directory / MANIFEST, json.dumps(sizes, indent=1).encode())
