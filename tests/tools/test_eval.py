"""dflash-eval (tools/eval.py) on a fake run directory with a tiny random target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import zmq

from common.config import load_config
from drafter_worker.model.dflash_model import DFlashDrafter, build_target_layer_ids, make_drafter_config
from common.metrics_client import parse_metrics_record
from drafter_worker.checkpoint import CheckpointStore, Coverage, TrainerState
from tests.conftest import free_ports
from tools.eval import find_checkpoint, main as eval_main, tau_stderr, training_eal


@pytest.fixture(scope="module")
def run_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    data = root / "chats.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Question number {i}?"},
                                             {"role": "assistant", "content": f"Answer {i}."}]}) + "\n")
    cfg = load_config(None, [f"run.root_dir={json.dumps(str(root))}", 'run.name="tiny"',
                             f"target.model={json.dumps(str(tiny_llama_dir))}", "target.threads=1",
                             f"data.source={json.dumps(str(data))}", "data.heldout_fraction=0.5",
                             "data.max_seq_len=64", "data.bucket_lengths=[64]", "data.tokens_per_batch=64"])
    run = cfg.run.path
    run.mkdir(parents=True)
    (run / "config.toml").write_text(cfg.to_toml())
    config = make_drafter_config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=49152, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
        num_hidden_layers=1, num_target_layers=6, target_layer_ids=build_target_layer_ids(6, 2),
        block_size=4, mask_token_id=49151,
    )
    torch.manual_seed(0)
    model = DFlashDrafter(config)
    state = TrainerState(step=10, coverage=[Coverage()], drafter_id="d0", model_id="tiny")
    CheckpointStore(run, "d0", keep=2).save(state, model, torch.optim.AdamW(model.parameters()), torch.Generator())
    with open(run / "metrics.jsonl", "w") as f:
        for step, eal in ((5, 0.1), (10, 0.25), (15, 0.5)):
            f.write(json.dumps({"source": "drafter/d0", "step": step, "values": {"eal": eal, "loss": 3.0}}) + "\n")
            f.write(json.dumps({"source": "drafter/d1", "step": step, "values": {"eal": 9.0}}) + "\n")
    return run


def test_run_directory_helpers(run_dir):
    found = find_checkpoint(run_dir, "d0")
    assert found is not None and found.step == 10 and found.path.name == "step-10"
    assert find_checkpoint(run_dir, "d9") is None
    assert training_eal(run_dir, "d0", 10) == 0.25
    assert training_eal(run_dir, "d0", 7) == 0.1
    assert training_eal(run_dir, "d0", 1) is None


def test_training_eal_parses_records_instead_of_searching_lines(tmp_path):
    # Guards against a proxy reported as "not found": metrics.jsonl escapes a non-ASCII
    # drafter id ("drafter/d\u00e9"), which a substring search for the source never matched.
    with open(tmp_path / "metrics.jsonl", "w", encoding="utf-8") as f:
        for source, step, values in (("drafter/d\u00e9", 4, {"eal": 0.5}), ("drafter/d\u00e9", 6, {"eal": 0.7}),
                                     ("drafter/d\u00e92", 5, {"eal": 9.0}), ("drafter/d\u00e9", 5, {"loss": 3.0})):
            f.write(json.dumps({"source": source, "step": step, "values": values}) + "\n")
        f.write('{"source": "drafter/d\u00e9", "step": 5, "val')  # a line being written
    assert training_eal(tmp_path, "d\u00e9", 5) == 0.5
    assert training_eal(tmp_path, "d\u00e9", 6) == 0.7
    assert training_eal(tmp_path, "d\u00e9", 3) is None


def test_tau_stderr_is_the_ratio_estimators():
    # tau = 19 / 8 over three prompts; residuals y - tau * x = -1.125, -0.75, 1.875:
    # sqrt(3 * 5.34375 / 2) / 8. A mean of per-prompt taus or a missing n / (n - 1) gives another value.
    assert tau_stderr([6, 4, 9], [3, 2, 3]) == pytest.approx(0.3538985, abs=1e-6)
    assert tau_stderr([6, 4, 9], [3, 2, 4.5]) == 0.0  # every prompt at the same tau: no spread
    assert math.isnan(tau_stderr([6], [3]))


def test_eval_reports_tau_and_speedup(run_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = eval_main([str(run_dir), "--drafter", "d0", "--num-prompts", "2", "--max-new-tokens", "9",
                    "--ignore-eos", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report == json.loads((run_dir / "eval" / "d0" / "step-10.json").read_text())
    assert report["step"] == 10 and report["num_prompts"] == report["prompts_requested"] == 2
    assert report["greedy_mismatches"] == 0  # speculative == greedy at temperature 0
    assert 1.0 <= report["tau"] <= 4.0 and len(report["tau_per_prompt"]) == 2
    steps = [row["steps"] for row in report["per_prompt"]]
    assert report["tau_stderr"] == tau_stderr([t * n for t, n in zip(report["tau_per_prompt"], steps)], steps)
    assert len(report["acceptance_rate"]) == 3
    assert report["training_eal"] == 0.25 and report["tau_predicted_by_eal"] == 1.25
    assert report["generated_tokens"] == 18
    assert report["speedup"] > 0 and report["plain_tokens_per_s"] > 0
    text = capsys.readouterr().out
    assert "tau:" in text and "speed-up:" in text and "training EAL proxy: 0.250" in text
    assert f"+- {report['tau_stderr']:.3f}" in text


def test_time_limit_decodes_a_prefix_of_the_prompts_and_says_so(run_dir, tmp_path, capsys):
    # A limit already spent: the minimum is decoded, nothing more, and the report and the text say
    # how many of how many; the prompts decoded are the full evaluation's first ones, in order.
    reports = {}
    for limit in ("0", "3600"):
        out = tmp_path / f"report-{limit}.json"
        assert eval_main([str(run_dir), "--drafter", "d0", "--num-prompts", "5", "--max-new-tokens", "6",
                          "--ignore-eos", "--time-limit-s", limit, "--min-prompts", "2", "--json", str(out)]) == 0
        reports[limit] = json.loads(out.read_text())
    cut, full = reports["0"], reports["3600"]
    assert cut["num_prompts"] == 2 and cut["prompts_requested"] == 5 and cut["generated_tokens"] == 12
    assert full["num_prompts"] == full["prompts_requested"] == 5
    assert cut["tau_per_prompt"] == full["tau_per_prompt"][:2]
    assert [r["prompt_tokens"] for r in cut["per_prompt"]] == [r["prompt_tokens"] for r in full["per_prompt"][:2]]
    text = capsys.readouterr().out
    assert "prompts: 2 of 5, time limit" in text and "prompts: 5 (" in text


def test_draft_confidence_cuts_the_drafts_a_step_verifies(run_dir, tmp_path, capsys):
    # A random drafter is never 99.9% sure of a draft: every step verifies one draft, in one pass.
    reports = {}
    for confidence in ("0", "0.999"):
        out = tmp_path / f"report-{confidence}.json"
        assert eval_main([str(run_dir), "--drafter", "d0", "--num-prompts", "2", "--max-new-tokens", "9",
                          "--ignore-eos", "--draft-confidence", confidence, "--json", str(out)]) == 0
        reports[confidence] = json.loads(out.read_text())
    full, cut = reports["0"], reports["0.999"]
    assert full["drafts_per_step"] > 2 and cut["drafts_per_step"] <= 1 and cut["drafting_passes_per_step"] <= 1
    assert cut["draft_confidence"] == 0.999 and cut["greedy_mismatches"] == 0
    assert cut["generated_tokens"] == full["generated_tokens"] == 18
    assert "drafts cut below confidence 0.999" in capsys.readouterr().out


def test_prompt_lookup_drafts_where_the_sequence_repeats_and_stays_greedy(run_dir, tmp_path, capsys):
    # 40 new tokens of a tiny random target repeat some of its bigrams: the lookup drafts those steps.
    out = tmp_path / "report.json"
    assert eval_main([str(run_dir), "--drafter", "d0", "--num-prompts", "2", "--max-new-tokens", "40",
                      "--ignore-eos", "--prompt-lookup", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["prompt_lookup"] is True and 0 < report["lookup_steps_frac"] < 1
    assert report["greedy_mismatches"] == 0 and report["generated_tokens"] == 80
    assert "prompt lookup drafting" in capsys.readouterr().out


def test_eval_watch_pushes_tau_at_the_checkpoint_step(run_dir):
    (port,) = free_ports(1)
    address = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(address)
    try:
        rc = eval_main(["--watch", str(run_dir), "--drafter", "d0", "--every-s", "0.1", "--max-evals", "1",
                        "--num-prompts", "2", "--max-new-tokens", "5", "--metrics-address", address])
        assert rc == 0
        assert pull.poll(10_000), "no metrics record from the watcher"
        record = parse_metrics_record(pull.recv())
    finally:
        pull.close()
        ctx.term()
    assert record.source == "drafter/d0" and record.step == 10
    assert record.values["eval/tau"] >= 1.0
    assert "eval/accept/pos_1" in record.values and "eval/tokens_per_s" in record.values
    assert record.values["eval/tau_stderr"] >= 0.0  # two prompts: the spread of their taus goes with tau


def test_eval_errors(run_dir, tmp_path, capsys):
    assert eval_main([str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert eval_main([str(run_dir), "--drafter", "d9", "--num-prompts", "1"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
