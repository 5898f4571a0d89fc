"""End to end on the real SmolLM2-135M target: the demo launcher with a short step budget."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metrics_sidecar.wandb_reader import read_wandb_offline_history
from tests.conftest import ROOT, free_ports
from tests.integration.catalog import catalog_series

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_demo_launcher_trains_two_drafters_on_smollm2(tmp_path):
    control, store, metrics = free_ports(3)
    overrides = [
        f'run.root_dir="{tmp_path}"',
        f'control.address="tcp://127.0.0.1:{control}"',
        f"control.store_port={store}",
        f'metrics.address="tcp://127.0.0.1:{metrics}"',
        "metrics.window_s=2.0",
        "metrics.log_every_steps=2",
        "drafter.max_steps=6",
        "drafter.checkpoint_every_steps=3",
        "data.max_samples=120",
    ]
    # Fewer new tokens than the demo's 16 in its tau measurement (the test checks that it runs and is printed).
    args = [sys.executable, "deploy/demo.py", "--config", "configs/demo.toml", "--eval-tokens", "8"]
    for o in overrides:
        args += ["--set", o]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "drafter/d0: steps=6" in out and "drafter/d1: steps=6" in out, out
    assert "wandb sync" in out
    # The summary tells the truth about quality: tau measured with the target, next to the EAL proxy.
    for drafter in ("d0", "d1"):
        assert f"drafter/{drafter}: measured tau" in out and "EAL proxy" in out, out
    run_dir = tmp_path / "demo"
    for drafter in ("d0", "d1"):
        assert (run_dir / "checkpoints" / drafter / "step-6" / "model.safetensors").exists()
    history = read_wandb_offline_history(run_dir)
    keys = set().union(*(row.keys() for row in history))
    missing = catalog_series(["d0", "d1"], block_size=16, num_buckets=3) - keys
    assert not missing, f"catalog series missing from the demo's W&B offline run: {sorted(missing)}"
