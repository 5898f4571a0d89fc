"""The options every entry point shares (common/cli.py): --print-config, the environment, --help."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from common import cli
from common.config import Config, DataConfig, load_config

ROOT = Path(__file__).resolve().parents[2]

JOB = """
[run]
name = "exp"
root_dir = "{root}"

[data]
max_seq_len = 192
bucket_lengths = [64, 128, 192]

[drafter]
learning_rate = 1e-3

[drafters.d1]
learning_rate = 3e-4
seed = 1
"""


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (cli.ENV_CONFIG, cli.ENV_RUN_NAME)}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**base, **(env or {})})


def _doc(section: type, key: str) -> str:
    return next(f.metadata["doc"] for f in dataclasses.fields(section) if f.name == key)


def _job(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(root=tmp_path / "runs"))
    return path


@pytest.mark.parametrize("command, flags", [
    (("target_server",), ()),
    (("drafter_worker",), ("--id", "d1")),
    (("metrics_sidecar",), ()),
    (("tools.status",), ()),
])
def test_print_config_is_the_resolved_config_as_toml_with_docs(tmp_path, command, flags):
    job = _job(tmp_path)
    done = _run(*command, "--config", str(job), *flags, "--set", "data.max_samples=7", "--print-config")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # A key's value under its doc (the doc of data.max_samples is short enough for one line).
    assert f"# {_doc(DataConfig, 'max_samples')}\nmax_samples = 7  # default: 0\n" in out, out
    assert "bucket_lengths = [64, 128, 192]" in out
    # The output is a config file: it parses, and loads back into the same values.
    parsed = tomllib.loads(out)
    assert parsed["data"]["max_samples"] == 7
    expected = load_config(job, [*(['drafter.id="d1"'] if flags else []), "data.max_samples=7"])
    assert load_config_text(tmp_path, out) == expected
    if flags:
        assert parsed["drafter"]["id"] == "d1" and parsed["drafter"]["learning_rate"] == 3e-4  # [drafters.d1]
    # Printing the config starts nothing and writes nothing (no run directory, no logs).
    assert not (tmp_path / "runs").exists()


def test_print_config_applies_the_environment_before_set(tmp_path):
    job = _job(tmp_path)
    done = _run("target_server", "--print-config", env={cli.ENV_CONFIG: str(job), cli.ENV_RUN_NAME: "from-env"})
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["run"] == {"name": "from-env", "root_dir": str(tmp_path / "runs")}
    done = _run("drafter_worker", "--id", "d1", "--set", 'run.name="from-set"', "--print-config",
                env={cli.ENV_CONFIG: str(job), cli.ENV_RUN_NAME: "from-env"})
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["run"]["name"] == "from-set"


def test_print_config_of_eval_is_the_run_directory_config(tmp_path):
    run_dir = tmp_path / "runs" / "exp"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(load_config(_job(tmp_path)).to_toml())
    done = _run("tools.eval", str(run_dir), "--set", "target.device=cuda:3", "--print-config")
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(done.stdout)["target"]["device"] == "cuda:3"
    assert f"# {_doc(type(Config().target), 'device')}\n" in done.stdout
    assert not (run_dir / "logs").exists()
    done = _run("tools.eval", str(tmp_path / "nowhere"), "--print-config")
    assert done.returncode == 2 and "no config.toml" in done.stderr


def test_metrics_flags_are_part_of_the_resolved_config(tmp_path):
    done = _run("metrics_sidecar", "--run-dir", str(tmp_path / "x" / "r9"), "--window-s", "0.5",
                "--wandb-mode", "disabled", "--print-config")
    assert done.returncode == 0, done.stderr
    parsed = tomllib.loads(done.stdout)
    assert parsed["run"] == {"name": "r9", "root_dir": str(tmp_path / "x")}
    assert parsed["metrics"]["window_s"] == 0.5 and parsed["metrics"]["wandb_mode"] == "disabled"


def test_a_bad_override_is_one_line_and_exit_2(tmp_path):
    done = _run("target_server", "--set", "data.bogus=1", "--print-config")
    assert done.returncode == 2
    assert done.stderr.startswith("dflash-target: config error: unknown config key data.bogus"), done.stderr
    assert "Traceback" not in done.stderr


def test_config_toml_round_trips_awkward_values(tmp_path):
    cfg = load_config(None, ['run.name="quote\\"d-\U0001F600"', "target.target_layer_ids=[1, 3]",
                             "drafter.learning_rate=1e-07", "drafter.feature_scale_init=false"])
    text = cli.config_toml(cfg, header="a header\nover two lines")
    assert text.startswith("# a header\n# over two lines\n")
    assert load_config_text(tmp_path, text) == cfg
    # Table values (e.g. chat template arguments) are written as inline tables.
    assert tomllib.loads("v = " + cli.toml_value({"enable_thinking": False, "a b": [1, "x"]}))["v"] == {
        "enable_thinking": False, "a b": [1, "x"]}


def load_config_text(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "printed.toml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("module, prog, print_config", [
    ("target_server", "dflash-target", True),
    ("drafter_worker", "dflash-drafter", True),
    ("metrics_sidecar", "dflash-metrics", True),
    ("tools.status", "dflash-status", True),
    ("tools.eval", "dflash-eval", True),
    ("tools.report", "dflash-report", False),
    ("common.sockets", "dflash-keys", False),
])
def test_help_names_the_command_and_its_options(module, prog, print_config):
    done = _run(module, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {prog} ")
    assert ("--print-config" in done.stdout) == print_config
    # Regression: dflash-metrics printed a stale docstring ("Flags for now; the shared config replaces them").
    assert "for now" not in done.stdout and "``" not in done.stdout


def test_log_lines_carry_the_date(tmp_path):
    # In a process of its own: setup_logging replaces the root handlers and the process title.
    code = ("import logging, sys; from pathlib import Path; from common.logging_setup import setup_logging; "
            "setup_logging('cli-test', Path(sys.argv[1])); logging.getLogger('tests.cli').info('hello %d', 42); "
            "print(__import__('os').getpid())")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    pid = done.stdout.strip()
    pattern = rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d I \[cli-test pid={pid}\] tests.cli: hello 42"
    for line in (done.stderr.splitlines()[-1], (tmp_path / "cli-test.log").read_text().splitlines()[-1]):
        assert re.fullmatch(pattern, line), line
