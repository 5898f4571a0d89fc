import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Nothing in the tests may reach a model hub or W&B's servers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tests.tiny_target import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny-llama") / "model")
