"""The recipe's pipeline features as real processes: feature cache, steps per batch, schedule over the
plan, and the non-finite stop (exit code 3)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from deploy.launcher import Job
from drafter_worker.checkpoint import verify_lineage
from tests.fixtures import write_config

pytestmark = pytest.mark.timeout(240)


def run_plan(tmp_path: Path, config: Path) -> tuple[Path, Job]:
    """Sidecar, target and drafter d0 on 24 samples until d0 ends its plan; every process exits 0."""
    config.write_text(config.read_text().replace("max_samples = 80", "max_samples = 24"))
    run_dir = tmp_path / "runs" / "it"
    with Job(config, run_dir) as job:
        job.start_metrics()
        job.start_target()
        job.start_drafter("d0")
        assert job.procs["d0"].wait(180) == 0, job.all_consoles()
        codes = {name: job.terminate(name, timeout_s=40) for name in ("target", "metrics")}
        assert codes == {"target": 0, "metrics": 0}, job.all_consoles()
    return run_dir, job


def test_epochs_from_the_feature_cache_with_several_steps_per_batch(tmp_path, tiny_llama_dir):
    config = write_config(tmp_path, str(tiny_llama_dir),
                          drafters={"d0": {"steps_per_batch": 3, "draft_vocab_size": 512, "threads": 2,
                                           "threads_while_capturing": 1}},
                          sections={"target": ["feature_cache_gb = 1.0"], "data": ["num_epochs = 2"]})
    run_dir, job = run_plan(tmp_path, config)  # d0 is DONE after the plan's two epochs
    log = (run_dir / "logs" / "target.log").read_text()
    assert "plan:" in log
    target = [r["values"] for r in job.metrics() if r["source"] == "target"]
    assert max(v["cache_hit_frac"] for v in target) > 0, "the second epoch was not served from the cache"
    assert max(v["feature_cache_gb"] for v in target) > 0
    drafter_log = (run_dir / "logs" / "drafter-d0.log").read_text()
    assert "cosine over the plan's" in drafter_log and "x 3 steps each" in drafter_log
    # One thread while the target computed the batches (BATCH.from_cache false), both once its cache served them.
    assert "[threads] 1 torch threads from batch 0 on: the target computes it" in drafter_log
    assert "[threads] 2 torch threads from batch" in drafter_log and "serves it from its feature cache" in drafter_log
    # Every batch of both epochs trained three steps; the ledger accounts for every step once.
    report = verify_lineage(run_dir, "d0")
    assert report.ok, report.problems
    assert report.final_step == 3 * report.batches
    assert sorted(report.samples_per_epoch) == [0, 1]
    assert report.finished_epochs == [0, 1]  # and every sample of each was trained exactly once
    lrs = [r["values"]["lr"] for r in job.metrics() if r["source"] == "drafter/d0"]
    assert lrs[-1] < 0.5 * max(lrs)  # the schedule decayed over the plan although max_steps = 0
    state = json.loads((run_dir / "checkpoints" / "d0" / (run_dir / "checkpoints" / "d0" / "latest").read_text().strip()
                        / "trainer_state.json").read_text())
    assert state["step"] == report.final_step


def test_a_bf16_target_feeds_its_features_and_its_cache_to_a_drafter_training_under_bf16_autocast(
        tmp_path, tiny_llama_dir):
    # What target.dtype = drafter.autocast = "auto" pick on a CPU with AVX512-BF16 or AMX, set explicitly so every
    # host runs it: the wire dtype (WELCOME, every BATCH) is bfloat16, and the float32 drafter reads it.
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={"d0": {"autocast": "bfloat16"}},
                          sections={"target": ['dtype = "bfloat16"', "feature_cache_gb = 1.0"], "data": ["num_epochs = 2"]})
    run_dir, job = run_plan(tmp_path, config)
    assert "(bfloat16): 6 layers" in (run_dir / "logs" / "target.log").read_text()
    assert "training step computes in bfloat16" in (run_dir / "logs" / "drafter-d0.log").read_text()
    target = [r["values"] for r in job.metrics() if r["source"] == "target"]
    assert max(v["cache_hit_frac"] for v in target) > 0, "the second epoch was not served from the cache"
    losses = [r["values"]["loss"] for r in job.metrics() if r["source"] == "drafter/d0" and "loss" in r["values"]]
    assert losses and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    report = verify_lineage(run_dir, "d0")
    assert report.ok and report.finished_epochs == [0, 1], report.problems


def test_a_cache_the_memory_cannot_hold_stops_growing_and_the_target_computes_every_epoch(tmp_path, tiny_llama_dir):
    # Keep 1 PB free: no machine has it, so the cache takes nothing, says why, and both epochs run the forward pass.
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={"d0": {}},
                          sections={"target": ["feature_cache_gb = 1.0", "feature_cache_keep_free_gb = 1e6"],
                                    "data": ["num_epochs = 2"]})
    run_dir, job = run_plan(tmp_path, config)
    log = (run_dir / "logs" / "target.log").read_text()
    assert "[cache] the feature cache stops growing at 0.00 GB (0 samples):" in log
    assert "target.feature_cache_keep_free_gb = 1e+06 free" in log
    target = [r["values"] for r in job.metrics() if r["source"] == "target"]
    assert max(v["cache_hit_frac"] for v in target) == 0 and max(v["feature_cache_gb"] for v in target) == 0
    report = verify_lineage(run_dir, "d0")
    assert report.ok and report.finished_epochs == [0, 1], report.problems


def poisoned_target(source: Path, out: Path) -> Path:
    """A copy of the tiny target whose first layer outputs inf: every captured feature is non-finite."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, out)
    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.fill_(float("inf"))
    model.save_pretrained(out)
    return out


def test_a_drafter_whose_steps_are_all_non_finite_stops_with_exit_code_3(tmp_path, tiny_llama_dir):
    # A target that sends non-finite features: no step changes anything, and ten in a row stop the drafter.
    target = poisoned_target(tiny_llama_dir, tmp_path / "poisoned")
    config = write_config(tmp_path, str(target), drafters={"d0": {"checkpoint_every_steps": 1000}})
    run_dir = tmp_path / "runs" / "it"
    with Job(config, run_dir) as job:
        job.start_metrics()
        job.start_target()
        job.start_drafter("d0")
        code = job.procs["d0"].wait(150)
        assert code == 3, job.all_consoles()
    log = (run_dir / "logs" / "drafter-d0.log").read_text()
    assert "steps in a row had a non-finite loss or gradient norm" in log
    nonfinite = [r["values"].get("nonfinite_steps", 0) for r in job.metrics() if r["source"] == "drafter/d0"]
    assert sum(nonfinite) >= 8, nonfinite
    # Windows without a finite step report no loss rather than a made-up one.
    assert all(math.isfinite(r["values"].get("loss", 0.0)) for r in job.metrics() if r["source"] == "drafter/d0")
    # Nothing was checkpointed from those steps.
    assert not (run_dir / "checkpoints" / "d0" / "latest").exists()


def test_a_drafter_distils_the_targets_distribution_from_its_captured_last_layer(tmp_path, tiny_llama_dir):
    # The tiny target has 6 layers: capturing layer 5 lets the drafter compute the target's own distribution
    # from WELCOME.final_norm_weight; the drafter also has its own key/value head count.
    # It trains an LM head of its own over a draft vocabulary, starting from the target's rows.
    config = write_config(tmp_path, str(tiny_llama_dir),
                          drafters={"d0": {"distill_weight": 0.5, "num_key_value_heads": 4, "draft_vocab_size": 64,
                                           "train_draft_head": True}},
                          sections={"target": ["target_layer_ids = [1, 3, 5]"], "data": ["num_epochs = 1"]})
    run_dir, job = run_plan(tmp_path, config)
    report = verify_lineage(run_dir, "d0")
    assert report.ok, report.problems
    losses = [r["values"]["loss"] for r in job.metrics() if r["source"] == "drafter/d0" and "loss" in r["values"]]
    assert losses and all(math.isfinite(x) for x in losses)
    from drafter_worker.model.dflash_model import load_drafter
    step_dir = run_dir / "checkpoints" / "d0" / (run_dir / "checkpoints" / "d0" / "latest").read_text().strip()
    trained = load_drafter(step_dir)
    assert trained.config.num_key_value_heads == 4
    from transformers import AutoModelForCausalLM
    target_rows = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).lm_head.weight.detach()[trained.draft_vocab]
    moved = (trained.draft_head - target_rows).norm() / target_rows.norm()
    assert 0 < moved < 0.5, float(moved)  # started at the target's rows, then trained
