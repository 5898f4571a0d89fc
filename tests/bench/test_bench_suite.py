"""The benchmark suite's own logic: end-to-end rates from metric records, the table, and gpu_check on CPU."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
import pipeline_bench  # noqa: E402
import run_all  # noqa: E402


def _record(step: int, t: float, tokens_per_s: float = 100.0) -> dict:
    return {"source": "drafter/d0", "step": step, "time": t,
            "values": {"tokens_per_s": tokens_per_s, "data_wait_frac": 0.1, "compute_ms": 5.0}}


def test_window_rate_counts_only_records_inside_the_window():
    records = [_record(s, 100.0 + s) for s in range(0, 40, 2)]  # 2 steps every 2 s
    rate = pipeline_bench.window_rate(records, start=110.0, end=130.0)
    assert rate["steps"] == 20 and rate["seconds"] == pytest.approx(20.0)
    assert rate["steps_per_s"] == pytest.approx(1.0)
    # Under two records in the window there is no rate (not a division by zero).
    assert pipeline_bench.window_rate(records, start=110.5, end=111.5) is None


def _results(shm: bool) -> dict:
    transport = {
        "nbytes": 8_851_264, "GBps": {"memcpy": 30.0, "memcpy_ring": 20.0, "gloo_raw": 2.0, "gloo_pair": 1.9},
        "gloo_pair_vs_raw": 0.95, "shm_vs_memcpy": None,
    }
    if shm:
        transport["GBps"].update(shm=10.0, shm_copy=9.0, memcpy_pair=12.0)
        transport.update(shm_vs_memcpy=0.5, shm_vs_memcpy_hot=0.33, shm_vs_memcpy_pair=0.83, memcpy_ring_ms=0.4,
                         shm_copy_vs_memcpy=0.45, shm_copy_vs_memcpy_pair=0.75, consume="sum", shm_breakdown_ms={
            f"{kind}/{key}": 0.5 for kind in ("shm", "shm_copy")
            for key in ("producer_write_ms", "producer_ack_wait_ms", "consumer_wait_ms", "consumer_read_ms")})
    job = {"drafters": {"d0": {"tokens_per_s": 950.0}}, "total_tokens_per_s": 950.0, "cpu_cores_used": {"target": 0.9}}
    return {
        "pipeline": {
            "pipeline_efficiency": 0.95, "end_to_end_tokens_per_s": 950.0, "bottleneck": "target",
            "target_alone_tokens_per_s": 1000.0, "drafter_alone_tokens_per_s": 1500.0, "alone_cpu_cores_used": 1.0,
            "bottleneck_cpu_share_vs_alone": 0.9, "pipeline_efficiency_cpu_adjusted": 1.05,
            "concurrent_target_alone_tokens_per_s": 800.0, "concurrent_drafter_alone_tokens_per_s": 900.0,
            "pipeline_efficiency_vs_concurrent_alone": 1.19,
            "jobs": {"1": job, "2": {**job, "drafters": {"d0": {"tokens_per_s": 900.0}, "d1": {"tokens_per_s": 880.0}},
                                     "total_tokens_per_s": 1780.0}},
        },
        "transport": transport,
        "capture": {"model": "smollm2", "batch": 2, "seq_len": 128, "capture_tokens_per_s": 380.0,
                    "plain_tokens_per_s": 270.0, "capture_vs_plain": 1.4},
        "fused_loss": {"vocab": 49152, "n": 1920, "methods": {
            "plain": {"peak_bytes": 2**30, "median_s": 2.0},
            "chunked": {"peak_bytes": 2**26, "median_s": 1.5, "mem_ratio_vs_plain": 0.06, "time_ratio_vs_plain": 0.75}}},
        "metrics": {"throughput_ratio_metrics_on_vs_off": 0.98, "step_ms_metrics_on": 102.0, "step_ms_metrics_off": 100.0,
                    "host_syncs_per_step": 0.0},
    }


def test_table_has_a_row_per_measurement_and_says_which_goals_are_met():
    table = run_all.rows(_results(shm=True), {})
    by_row = {r[0]: r for r in table if r[0]}
    assert set(by_row) == {"1", "2a", "2b", "3", "4", "5", "6"}
    assert by_row["1"][4:] == ("0.95", ">= 0.9", "yes")
    assert by_row["2a"][-1] == "NO" and by_row["2b"][-1] == "yes"
    assert "read in place" in by_row["2a"][1]
    assert any("copying ring" in r[1] and r[4] == "0.45" for r in table)
    assert sum("ms/batch" in r[1] for r in table) == 2  # shm and shm_copy breakdowns
    assert by_row["6"][-1] == "NO"  # 0.98 < 0.99
    scaling = [r for r in table if "scaling" in r[1]]
    assert [r[4] for r in scaling] == ["1.00", "1.87"]
    text = run_all.format_table(table)
    assert "pipeline efficiency" in text and len(text.splitlines()) == len(table) + 2  # header, rule, rows


def test_a_missing_shm_transport_and_a_failed_benchmark_are_rows_not_crashes():
    results = _results(shm=False)
    del results["capture"]
    table = run_all.rows(results, {"capture": "capture_bench.py failed (1) after 3s:\nTraceback ..."})
    shm = next(r for r in table if r[0] == "2a")
    assert shm[2] == "n/a (shm transport missing)" and shm[-1] == "n/a"
    capture = next(r for r in table if r[0] == "3")
    assert capture[2].startswith("failed: capture_bench.py failed")


def test_gpu_check_runs_on_cpu(tmp_path):
    # The CPU path of bench/gpu_check.py (tiny target): what gpu_check.sh runs on CUDA must at least run here.
    assert gpu_check.main(["--device", "cpu", "--steps", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tiny"]["sync"]["capture"]["ok"] and report["tiny"]["sync"]["train_step"]["ok"]
    assert report["tiny"]["sync"]["train_step"]["snapshots_read"] >= 1
    assert report["tiny"]["throughput"]["capture_tokens_per_s"] > 0
    overlap = report["tiny"]["overlap"]
    assert overlap["ok"] and overlap["drafter"]["host_reads"] == 0, overlap


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_spec_cost_bench_times_the_three_parts_of_a_step(dtype, tmp_path, tiny_llama_dir, capsys):
    # Runs the bench end to end on the tiny target: the drafter's cache is rolled back
    # between rounds (a length mismatch would raise), and the break-even tau is the
    # ratio of the printed timings.
    import spec_cost_bench

    from drafter_worker.model.dflash_model import save_drafter
    from tests.fixtures import tiny_drafter

    # The tiny target's shape: hidden 64, 4 heads, vocabulary 49152.
    save_drafter(tmp_path / "drafter", tiny_drafter(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                    intermediate_size=128, vocab_size=49152, mask_token_id=49151,
                                                    max_position_embeddings=1024, draft_vocab_size=512))
    assert spec_cost_bench.main(["--drafter", str(tmp_path / "drafter"), "--model", str(tiny_llama_dir),
                                 "--context", "40", "--rounds", "3", "--threads", "1", "--tau", "2",
                                 "--verify-lengths", "1,9", "--dtype", dtype]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["dtype"] == dtype  # the drafter cast to it too, as dflash-eval does
    assert result["draft_tokens"] == result["block_size"] - 1
    assert sorted(result["verify_ms_by_tokens"]) == ["1", "9"]  # a tree's or a longer block's verification
    for mode in ("own", "small_rows"):  # the models' own linear layers, then tools.small_linears
        row = result[mode]
        assert row["break_even_tau"] == pytest.approx((row["verify_ms"] + row["draft_ms"]) / row["plain_ms"], rel=0.01)
        assert row["speedup_at_tau"] == pytest.approx(2 / row["break_even_tau"], rel=0.01)


def test_gpu_check_trains_the_recipe_drafter_on_cpu(tmp_path):
    # gpu_check.sh's sync-recipe section: the CPU recipe's drafter (draft vocabulary, soft-target loss
    # on the last captured layer, sliding-window layer) built and stepped under the guard.
    assert gpu_check.main(["--device", "cpu", "--steps", "1", "--sections", "sync", "--drafter-config",
                           str(ROOT / "configs" / "quality.toml"), "--set", "drafter.num_key_value_heads=0",
                           "--out", str(tmp_path)]) == 0
    sync = json.loads((tmp_path / "gpu_check.json").read_text())["tiny"]["sync"]
    assert sync["train_step"]["ok"] and sync["train_step"]["loss_finite"], sync
