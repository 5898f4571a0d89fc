"""The quality recipe's configs validate and its shipped data is usable as the target reads it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.config import load_config
from tools.prompts import build_prompts

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["quality.toml", "quality-gpu.toml"])
def test_recipe_configs_validate(name):
    cfg = load_config(REPO / "configs" / name)
    assert cfg.data.source == "data/regen-smollm2.jsonl"
    assert cfg.drafter.max_steps == 0 and cfg.data.num_epochs > 0  # the schedule spans the plan
    assert cfg.target.feature_cache_gb > 0
    assert cfg.data.heldout_fraction > 0  # the evaluation's prompts are never trained on
    if cfg.drafter.distill_weight > 0:  # the soft-target loss reads SmolLM2's last layer (29 of 30)
        assert cfg.target.target_layer_ids and cfg.target.target_layer_ids[-1] == 29
    if name == "quality.toml":  # the cosine ends by the time make quality stops training, not after
        from deploy.quality import TRAIN_MINUTES

        assert 0.9 * TRAIN_MINUTES < cfg.drafter.decay_minutes < TRAIN_MINUTES


def test_shipped_regen_data_loads_as_training_data_with_held_out_prompts():
    from target_server.data import build_dataset, load_conversations
    from tests.fixtures import smollm2_tokenizer

    cfg = load_config(REPO / "configs" / "quality.toml")
    path = REPO / cfg.data.source
    conversations = load_conversations(str(path), seed=0)
    assert len(conversations) >= 1000
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    prompts = (REPO / "data" / "prompts.jsonl").read_text(encoding="utf-8").splitlines()
    # Every answer belongs to the prompt on its line of the shipped prompt set.
    for record in records[:50]:
        assert record["messages"][0]["content"] == json.loads(prompts[record["prompt_line"] - 1])["prompt"]
    dataset = build_dataset(smollm2_tokenizer(), str(path), max_seq_len=cfg.data.max_seq_len, seed=cfg.data.seed,
                            heldout_fraction=cfg.data.heldout_fraction, max_samples=20)
    assert len(dataset.train) == 20 and len(dataset.heldout) >= 16


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the prompt set is derived from Python 3.11's module list and reference text")
def test_prompt_set_is_deterministic_and_matches_the_shipped_file():
    prompts = build_prompts(seed=0)
    assert len(prompts) == len(set(prompts)) > 2000
    shipped = [json.loads(line)["prompt"] for line in (REPO / "data" / "prompts.jsonl").read_text().splitlines()]
    assert shipped == prompts


@pytest.mark.parametrize("argv, message", [
    (["--draft-tokens", "5"], "--draft-tokens must be in 0..4"),
    (["--draft-tokens", "-1"], "--draft-tokens must be in 0..4"),
    (["--draft-confidence", "1"], "--draft-confidence must be in [0, 1)"),
    (["--started-at", "99999999999"], "--started-at must be a Unix time within the last day"),
    (["--total-minutes", "0"], "--total-minutes must be > 0"),
    (["--progress-every-s", "0"], "--progress-every-s must be > 0"),
    (["--eval-dtype", "bf16"], "target.dtype"),
])
def test_quality_rejects_decoding_settings_the_recipe_cannot_run_before_touching_the_run(argv, message, tmp_path,
                                                                                       capsys):
    from deploy.quality import main

    earlier = tmp_path / "quality" / "summary.json"  # an earlier run's results survive a rejected command
    earlier.parent.mkdir()
    earlier.write_text("{}")
    assert main(["--set", f"run.root_dir={tmp_path}", *argv]) == 2
    assert message in capsys.readouterr().err
    assert earlier.read_text() == "{}"


def test_final_evaluations_share_the_minutes_left_by_prompts_and_reserve_the_exports():
    # 64 + 16 prompts for each of two drafters, 1,000 s left after the exports' reserve: the first
    # evaluation gets 64/160 of it; an evaluation that ends early leaves its seconds to the next.
    from deploy.quality import EXPORT_RESERVE_S, _time_limits

    limits = _time_limits([64, 16, 64, 16], time.time() + 1000.0 + 2 * EXPORT_RESERVE_S, drafters=2)
    assert next(limits) == pytest.approx(400.0, abs=1.0)
    assert next(limits) == pytest.approx(1000.0 * 16 / 96, abs=1.0)  # the first took no time
    assert next(limits) == pytest.approx(1000.0 * 64 / 80, abs=1.0)
    assert next(limits) == pytest.approx(1000.0, abs=1.0)  # the last gets all that is left
    past = _time_limits([64, 16], time.time() - 60.0, drafters=1)
    assert next(past) == next(past) == 0.0  # past the hour: each evaluation decodes its minimum


def test_make_quality_counts_the_hour_from_makes_start():
    # make reads the Makefile before it builds .venv: the hour's start is make's, so .venv counts.
    before = int(time.time())
    lines = subprocess.run(["make", "-n", "quality"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    after = int(time.time())
    (line,) = [line for line in lines.splitlines() if "deploy/quality.py" in line]
    argv = shlex.split(line)
    assert before <= int(argv[argv.index("--started-at") + 1]) <= after
