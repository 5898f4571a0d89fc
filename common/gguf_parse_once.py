"""transformers' GGUF load with the file's metadata parsed once instead of three times.

transformers opens a new ``gguf.GGUFReader`` in each step of a GGUF load (the
tokenizer, the config, the weights), and each parses the whole metadata: 4-5 s
apiece for SmolLM2's 49,152 vocabulary strings and merges on these CPUs. It
also rebuilds gguf's tensor-name table once per module of the model (397 times
for SmolLM2). Inside :func:`parse_once` both are built once per file and
reused. Both objects are only read by transformers, so what it builds from
them is unchanged; a first load of SmolLM2 (tokenizer and model) takes 21 s
instead of 39 s, a load from the converted-model cache 11 s.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Iterator

# Loads in several threads at once take turns: the patch is process-wide.
_lock = threading.RLock()


@contextlib.contextmanager
def parse_once() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` gives one reader per file and the tensor-name table is built once."""
    try:
        import gguf
    except ImportError:  # no GGUF support installed: transformers reports it when a GGUF is loaded
        yield
        return
    with _lock:
        real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[Any, ...], Any] = {}

        def shared_reader(path: Any, mode: str = "r") -> Any:
            stat = os.stat(path)
            key = (os.path.realpath(path), mode, stat.st_size, stat.st_mtime_ns)
            if key not in readers:
                readers[key] = real_reader(path, mode)
            return readers[key]

        gguf.GGUFReader = shared_reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map
