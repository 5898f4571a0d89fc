"""`make quality`'s launcher end to end on the tiny target: training with its watcher and progress lines,
the stop at the time limit, the final evaluations, the export and the summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.fixtures import write_config

pytestmark = pytest.mark.timeout(300)


def test_quality_launcher_trains_until_its_time_limit_then_evaluates_exports_and_summarizes(tmp_path,
                                                                                             tiny_llama_dir):
    data = tmp_path / "answers.jsonl"
    with open(data, "w") as f:
        for i in range(60):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                             {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}) + "\n")
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={"q0": {}},
                          sections={"data": [f"source = {json.dumps(str(data))}", "heldout_fraction = 0.1",
                                             "num_epochs = 1000"]})
    config.write_text(config.read_text().replace("max_samples = 80", "max_samples = 0"))
    # 24 s of training: progress lines (every 5 s), then the time limit stops the drafter mid-plan.
    result = subprocess.run(
        [sys.executable, "deploy/quality.py", "--config", str(config), "--train-minutes", "0.4", "--progress-every-s", "5",
         "--eval-every-s", "5", "--eval-prompts", "3", "--fewer-eval-prompts", "2", "--eval-tokens", "8",
         "--eval-threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert " min] q0 step" in out, out
    assert "minutes are up: stopping the drafters" in out
    assert "=== DFlash quality summary (" in out and "stopped by the time limit" in out, out
    summary = json.loads((tmp_path / "runs" / "it" / "summary.json").read_text())
    q0 = summary["drafters"]["q0"]
    assert q0["num_prompts"] == 3 and q0["fewer_drafts"]["num_prompts"] == 2, q0
    assert q0["tau_curve"], "the watcher's evaluations during training are missing from the summary"
    export = tmp_path / "runs" / "it" / "export" / "q0"
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    assert f"exported drafter: {export}" in out
    assert summary["plots"] and all((tmp_path / p).is_file() or (ROOT / p).is_file() for p in summary["plots"])
