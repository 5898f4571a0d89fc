"""dflash-regen --base-url against a real OpenAI-compatible server (`transformers serve` on a tiny random Llama).

The server is the real thing a user would start (FastAPI + uvicorn, the
model's chat template, greedy generate), on a free loopback port; regen runs
as its own process, is killed, and sees the server die and come back.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import tools.regen as regen
import tools.regen_client as regen_client
from target_server.data import build_dataset, load_conversations
from tests.conftest import ROOT
from tests.ports import free_ports
from tools.regen_client import RetryPolicy, ServerSettings, open_output, pending_prompts

SERVE = Path(sys.executable).parent / "transformers"

pytestmark = pytest.mark.skipif(not SERVE.exists(), reason="transformers[serving] is not installed")


class Served:
    """`transformers serve MODEL` on one loopback port, stopped and started again by the tests."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        self.model_dir = model_dir
        self.port = free_ports(1)[0]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [str(SERVE), "serve", "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                 "--log-level", "info", str(self.model_dir)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"transformers serve exited: {self.log.read_text()[-2000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"transformers serve did not answer within {timeout_s}s: {self.log.read_text()[-2000:]}")

    def ensure_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()

    def stop(self) -> None:
        """Kill the server at once (no graceful shutdown), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.fixtures import make_tiny_target

    # Seed 2: this random model answers words (" cervical ..."), not only blank lines, so answers are not empty.
    model_dir = make_tiny_target(tmp_path_factory.mktemp("served") / "model", seed=2)
    server = Served(model_dir, model_dir.parent / "serve.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def write_prompts(path: Path, n: int) -> list[int]:
    """``n`` prompts (one of them twice, one with a system turn and a stale answer, a blank line); their lines."""
    lines = [json.dumps({"prompt": f"Question {i}: what does `{name}` do?"})
             for i, name in enumerate(["len", "zip", "map", "iter", "next", "sum", "any", "all"] * 8)][: n - 2]
    lines.insert(2, json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "old answer, dropped"}]}))
    lines.insert(5, lines[0])  # the same prompt twice: answered twice
    lines.insert(4, "")
    path.write_text("\n".join(lines) + "\n")
    return [i for i, text in enumerate(lines, start=1) if text]


def regen_args(served: Served, prompts: Path, out: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "tools.regen", "--prompts", str(prompts), "--out", str(out),
            "--base-url", served.base_url, "--max-new-tokens", "4", *more]


def start_regen(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    with open(log, "a") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def wait_for_lines(out: Path, n: int, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, f"regen exited with {proc.returncode} before writing {n} records"
        time.sleep(0.02)
    raise AssertionError(f"regen did not write {n} records within {timeout_s}s")


def test_regen_from_a_server_writes_training_data_and_resumes_after_a_stop(served, tmp_path, capsys):
    served.ensure_running()
    prompts, out, log = tmp_path / "prompts.jsonl", tmp_path / "data" / "regen.jsonl", tmp_path / "regen.log"
    lines = write_prompts(prompts, 16)
    server_args = regen_args(served, prompts, out, "--concurrency", "3")

    # First run, its own process: stopped (SIGTERM) after a few answers; then a torn line as if killed in mid-write.
    proc = start_regen(server_args, log)
    try:
        wait_for_lines(out, 3, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "interrupted; answers received are in" in log.read_text()
    first = records(out)
    assert 3 <= len(first) < len(lines)
    with open(out, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "Hi"')

    # The rerun (in this process from here on) cuts the torn line, keeps what was there and answers only the rest.
    capsys.readouterr()
    assert regen.main(server_args[3:]) == 0
    err = capsys.readouterr().err
    assert "partial line" in err and f"resuming: {len(first)} of {len(lines)} prompts" in err
    done = records(out)
    assert done[: len(first)] == first
    assert sorted(r["prompt_line"] for r in done) == lines  # each prompt once, the repeated one twice
    for r in done:
        assert r["finish_reason"] in ("stop", "length")
        assert r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"]
    by_line = {r["prompt_line"]: r for r in done}
    assert by_line[3]["messages"][:2] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert len(by_line[3]["messages"]) == 3  # the stale answer was dropped, the new one appended

    # Nothing left: a third run writes nothing.
    assert regen.main(server_args[3:]) == 0
    assert records(out) == done
    assert f"0 answers written, {len(lines)} already there" in capsys.readouterr().out

    # The same records as the in-process mode on the same model (greedy, the model's chat template both ways).
    local = tmp_path / "local.jsonl"
    in_process = ["--prompts", str(prompts), "--model", str(served.model_dir), "--batch-size", "1",
                  "--max-new-tokens", "4", "--threads", "1"]
    assert regen.main([*in_process, "--out", str(local)]) == 0
    assert sorted(done, key=lambda r: r["prompt_line"]) == records(local)
    # So either mode resumes the other's file.
    capsys.readouterr()
    assert regen.main([*in_process, "--out", str(out)]) == 0
    assert regen.main(regen_args(served, prompts, local)[3:]) == 0
    assert records(out) == done and records(local) == sorted(done, key=lambda r: r["prompt_line"])
    assert capsys.readouterr().out.count(f"0 answers written, {len(lines)} already there") == 2

    # Valid training data for the target server.
    assert len(load_conversations(str(out), seed=0)) == len(lines)
    from tests.fixtures import smollm2_tokenizer

    dataset = build_dataset(smollm2_tokenizer(), str(out), max_seq_len=128, seed=0, heldout_fraction=0.0)
    assert len(dataset.train) == len(lines) and dataset.num_dropped == 0
    assert all(int(s.loss_mask.sum()) > 1 for s in dataset.train)  # the answer's tokens and the end of turn


def test_regen_reports_prompts_the_server_rejects(served, tmp_path, capsys):
    # A 4xx (here: a model the server does not serve) skips the prompt at once, without retries.
    served.ensure_running()
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "regen.jsonl"
    write_prompts(prompts, 6)
    assert regen.main(regen_args(served, prompts, out, "--model", "not-served", "--limit", "3")[3:]) == 1
    err = capsys.readouterr().err
    assert "3 prompts not answered: line 1 (HTTP 400" in err and "a rerun tries them again" in err
    assert "retrying" not in err
    assert out.read_text() == ""


def test_regen_retries_while_the_server_restarts_and_stops_when_it_stays_down(served, tmp_path, caplog):
    # Last of the tests that use the server: it leaves the server down. regen runs in this process, with a
    # short backoff so the test does not sit out a 30 s delay, and a thread kills the server under it.
    served.ensure_running()
    prompts_path, out = tmp_path / "prompts.jsonl", tmp_path / "regen.jsonl"
    lines = write_prompts(prompts_path, 30)
    prompts = regen.read_prompts(prompts_path)

    def settings(max_attempts: int) -> ServerSettings:
        return ServerSettings(base_url=served.base_url, concurrency=2,
                              retry=RetryPolicy(max_attempts=max_attempts, base_s=0.2, max_s=1.0))

    def kill_after(lines_written: int, restart: bool) -> threading.Thread:
        def run() -> None:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and (not out.exists() or out.read_bytes().count(b"\n") < lines_written):
                time.sleep(0.02)
            served.stop()
            if restart:
                time.sleep(0.5)
                served.start()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    # The server dies mid-run and comes back: regen retries and finishes the first 20 prompts.
    caplog.set_level(logging.INFO, logger="tools.regen")
    thread = kill_after(2, restart=True)
    counts = regen_client.regenerate_from_server(prompts[:20], out, settings(max_attempts=60), max_new_tokens=4)
    thread.join(timeout=120)
    assert counts["written"] == 20 and counts["failed"] == []
    assert "retrying in" in caplog.text
    first = records(out)
    assert sorted(r["prompt_line"] for r in first) == lines[:20]

    # The rest; the server dies for good: every request in flight runs out of tries and regen stops.
    thread = kill_after(len(first) + 2, restart=False)
    with pytest.raises(regen_client.ServerUnavailable, match="stopped answering: 2 prompts in a row"):
        regen_client.regenerate_from_server(prompts, out, settings(max_attempts=3), max_new_tokens=4)
    thread.join(timeout=120)
    kept = records(out)
    assert kept[: len(first)] == first
    assert len(first) + 2 <= len(kept) < len(lines)
    assert len({r["prompt_line"] for r in kept}) == len(kept)  # no prompt twice


def test_regen_without_a_server_says_so(tmp_path, capsys):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "regen.jsonl"
    write_prompts(prompts, 4)
    port = free_ports(1)[0]
    assert regen.main(["--prompts", str(prompts), "--out", str(out), "--base-url", f"http://127.0.0.1:{port}/v1",
                       "--max-attempts", "1"]) == 1
    err = capsys.readouterr().err
    assert "no answer from" in err and "is the server up?" in err


# ---------------------------------------------------------------------------
# Without a server: resume bookkeeping, backoff, arguments
# ---------------------------------------------------------------------------


def record(messages: list[dict], line: int) -> str:
    return json.dumps({"messages": [*messages, {"role": "assistant", "content": "a"}], "prompt_line": line,
                       "finish_reason": "stop"}) + "\n"


def test_resume_matches_records_by_content_counts_repeats_and_refuses_foreign_ones(tmp_path):
    prompts_path, out = tmp_path / "prompts.jsonl", tmp_path / "regen.jsonl"
    write_prompts(prompts_path, 8)
    prompts = regen.read_prompts(prompts_path)
    repeated = [p for p in prompts if p.messages == prompts[0].messages]
    assert [p.line for p in repeated] == [1, 7]
    # Written out of order (as concurrent answers arrive), the repeated prompt answered once, under its 2nd line.
    out.write_text(record(prompts[3].messages, prompts[3].line) + record(prompts[0].messages, 7)
                   + record(prompts[1].messages, 999))  # a wrong prompt_line still counts by content
    fd = open_output(out)
    try:
        todo, done = pending_prompts(fd, out, prompts)
    finally:
        os.close(fd)
    assert done == 3
    assert [p.line for p in todo] == [p.line for p in prompts if p.line not in (prompts[3].line, 7, prompts[1].line)]
    assert 1 in [p.line for p in todo]

    out.write_text(record([{"role": "user", "content": "from another file"}], 1))
    fd = open_output(out)
    try:
        with pytest.raises(regen.RegenError, match="not in the prompts file"):
            pending_prompts(fd, out, prompts)
    finally:
        os.close(fd)

    out.write_text(record(prompts[1].messages, 2) * 2)
    fd = open_output(out)
    try:
        with pytest.raises(regen.RegenError, match="more often than the prompts file asks"):
            pending_prompts(fd, out, prompts)
    finally:
        os.close(fd)


def test_a_second_writer_of_the_same_output_is_refused(tmp_path):
    out = tmp_path / "regen.jsonl"
    fd = open_output(out)
    try:
        with pytest.raises(regen.RegenError, match="another process is writing"):
            open_output(out)
    finally:
        os.close(fd)
    os.close(open_output(out))  # free again once closed


def test_backoff_doubles_with_jitter_up_to_the_cap():
    policy = RetryPolicy(max_attempts=8, base_s=1.0, max_s=10.0)
    rng = random.Random(0)
    for failures, cap in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (9, 10.0)]:
        delays = [policy.delay_s(failures, rng) for _ in range(200)]
        assert cap / 2 <= min(delays) and max(delays) <= cap and len(set(delays)) > 100
    assert policy.delay_s(1, rng, retry_after_s=3.0) == 3.0  # the server's Retry-After wins
    assert policy.delay_s(1, rng, retry_after_s=600.0) == 10.0  # but never past the cap


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "4"], "need --base-url"),
    (["--base-url", "http://127.0.0.1:1/v1", "--batch-size", "4"], "in-process mode"),
    (["--base-url", "http://127.0.0.1:1/v1", "--concurrency", "0"], "--concurrency must be >= 1"),
    (["--base-url", "127.0.0.1:8000/v1"], "must start with http://"),
])
def test_regen_rejects_bad_server_arguments(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        regen.main(["--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
