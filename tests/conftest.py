import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.ports import free_ports  # noqa: E402,F401  (re-exported for the tests)

# Nothing in the tests may reach a model hub or W&B's servers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# The targets the tests start cache their tokenized data: in a directory of this session, not ~/.cache.
if "DFLASH_DATA_CACHE_DIR" not in os.environ:
    os.environ["DFLASH_DATA_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-test-tokenized-")
    atexit.register(shutil.rmtree, os.environ["DFLASH_DATA_CACHE_DIR"], ignore_errors=True)
# And the GGUF they load is de-quantized once per session, into a directory of this session.
if "DFLASH_MODEL_CACHE_DIR" not in os.environ:
    os.environ["DFLASH_MODEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-test-models-")
    atexit.register(shutil.rmtree, os.environ["DFLASH_MODEL_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tests.fixtures import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny-llama") / "model")
