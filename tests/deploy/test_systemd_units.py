"""The systemd units (deploy/systemd/), their installer, and deploy/run_process.sh which they start."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from common.config import DrafterConfig, TargetConfig
from tests.conftest import ROOT

SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = ("dflash-target.service", "dflash-metrics.service", "dflash-drafter@.service")

# Keys these units may use, per section: a typo (or a key systemd does not know) fails here
# even where systemd-analyze is not installed.
KNOWN_KEYS = {
    "Unit": {"Description", "Documentation", "After", "Before", "Wants", "Requires", "BindsTo", "PartOf",
             "StartLimitIntervalSec", "StartLimitBurst"},
    "Service": {"Type", "User", "Group", "EnvironmentFile", "Environment", "WorkingDirectory", "ExecStart",
                "ExecStop", "Restart", "RestartSec", "RestartPreventExitStatus", "KillSignal", "KillMode",
                "TimeoutStopSec", "TimeoutStartSec", "StandardOutput", "StandardError", "SyslogIdentifier"},
    "Install": {"WantedBy", "RequiredBy", "Alias"},
}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file as {section: {key: [values]}} (keys may repeat; no line continuations allowed)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"line {number}: keep unit lines unbroken"
        if line.startswith("["):
            assert line.endswith("]"), f"line {number}: bad section header {line!r}"
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"line {number}: {line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep and key.strip() == key and key, f"line {number}: not key=value: {line!r}"
        current.setdefault(key, []).append(value)
    return sections


def one(unit: dict, section: str, key: str) -> str:
    values = unit.get(section, {}).get(key, [])
    assert len(values) == 1, f"[{section}] {key} must appear exactly once, got {values}"
    return values[0]


def render(tmp_path: Path, *extra: str, env: dict | None = None) -> tuple[Path, Path, Path]:
    """Install into a temporary tree: a copy of deploy/ as the checkout, units and env file beside it."""
    home = tmp_path / "checkout"
    shutil.copytree(ROOT / "deploy" / "systemd", home / "deploy" / "systemd")
    shutil.copy2(ROOT / "deploy" / "run_process.sh", home / "deploy" / "run_process.sh")
    units, env_file = tmp_path / "units", tmp_path / "etc" / "dflash.env"
    run_env = {k: v for k, v in os.environ.items() if k != "SUDO_USER"}
    run_env.update(env or {})
    done = subprocess.run(
        ["bash", str(home / "deploy" / "systemd" / "install.sh"), "--dest", str(units), "--env-file", str(env_file), *extra],
        capture_output=True, text=True, timeout=60, env=run_env,
    )
    assert done.returncode == 0, done.stderr
    return home, units, env_file


def test_unit_templates_have_the_required_shape():
    stop_timeouts = [f.default for cls in (DrafterConfig, TargetConfig) for f in dataclasses.fields(cls)
                     if f.name == "stop_timeout_s"]
    assert stop_timeouts, "the processes' own stop timeouts (config stop_timeout_s)"
    assert os.access(ROOT / "deploy" / "run_process.sh", os.X_OK)
    assert os.access(SYSTEMD / "install.sh", os.X_OK)
    for name in UNITS:
        unit = parse_unit((SYSTEMD / name).read_text())
        for section, keys in unit.items():
            assert section in KNOWN_KEYS, f"{name}: unknown section [{section}]"
            assert set(keys) <= KNOWN_KEYS[section], f"{name}: unknown keys {set(keys) - KNOWN_KEYS[section]}"
        assert one(unit, "Unit", "Description")
        exec_start = one(unit, "Service", "ExecStart").split()
        assert exec_start[0] == "@DFLASH_HOME@/deploy/run_process.sh"
        assert one(unit, "Service", "EnvironmentFile") == "@ENV_FILE@"
        assert one(unit, "Service", "WorkingDirectory") == "@DFLASH_HOME@"
        assert one(unit, "Service", "Restart") == "on-failure"
        assert one(unit, "Service", "KillSignal") == "SIGTERM"
        # SIGTERM reaches the Python process; its own stop timeout must run out before systemd's.
        assert int(one(unit, "Service", "TimeoutStopSec")) > max(stop_timeouts) + 10
        assert one(unit, "Service", "StandardOutput") == "journal"
        assert one(unit, "Service", "StandardError") == "journal"
        assert one(unit, "Install", "WantedBy") == "@WANTED_BY@"
        process = name.split(".")[0].split("@")[0].removeprefix("dflash-")
        assert exec_start[1] == process
        if process == "drafter":
            assert exec_start[2:] == ["%i"], "the instance names the drafter id"
            assert "%i" in one(unit, "Service", "SyslogIdentifier")
        else:
            assert len(exec_start) == 2
            assert one(unit, "Service", "SyslogIdentifier") == f"dflash-{process}"

    drafter = parse_unit((SYSTEMD / "dflash-drafter@.service").read_text())
    for key in ("Requires", "BindsTo", "PartOf", "Requisite", "Wants"):
        assert not any("dflash-target" in v for v in drafter["Unit"].get(key, [])), \
            f"drafters must start without the target (found {key}=)"
    target_text = (SYSTEMD / "dflash-target.service").read_text()
    assert "dflash-drafter" not in re.sub(r"#.*", "", target_text), "the target depends on no drafter"


def test_environment_example_holds_what_the_units_need():
    example = (SYSTEMD / "dflash.env.example").read_text()
    values = dict(line.split("=", 1) for line in example.splitlines() if line and not line.startswith("#"))
    for key in ("DFLASH_CONFIG", "DFLASH_VENV", "DFLASH_RUN_NAME", "DFLASH_TARGET_CUDA_VISIBLE_DEVICES"):
        assert key in values
    assert values["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert values["DFLASH_DRAFTER_1_CUDA_VISIBLE_DEVICES"] == "1"
    assert "DFLASH_DRAFTER_${drafter_id//[^A-Za-z0-9]/_}_CUDA_VISIBLE_DEVICES" in (ROOT / "deploy" / "run_process.sh").read_text()


@pytest.mark.parametrize("scope", ["system", "user"])
def test_installer_fills_in_every_placeholder(tmp_path, scope):
    home, units, env_file = render(tmp_path, f"--{scope}", "--service-user", "dflash")
    for name in UNITS:
        text = (units / name).read_text()
        assert not re.search(r"@[A-Z_]+@", text), text
        unit = parse_unit(text)
        assert one(unit, "Service", "ExecStart").startswith(f"{home}/deploy/run_process.sh ")
        assert one(unit, "Service", "EnvironmentFile") == str(env_file)
        assert one(unit, "Install", "WantedBy") == ("multi-user.target" if scope == "system" else "default.target")
        assert unit["Service"].get("User") == (["dflash"] if scope == "system" else None)
    env_text = env_file.read_text()
    assert f"DFLASH_VENV={home}/.venv" in env_text and not re.search(r"@[A-Z_]+@", env_text)
    # A second install keeps the operator's environment file.
    env_file.write_text("DFLASH_CONFIG=/mine.toml\n")
    render(tmp_path / "again", f"--{scope}", "--env-file", str(env_file))
    assert env_file.read_text() == "DFLASH_CONFIG=/mine.toml\n"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian package systemd); the structural checks above still ran")
def test_units_pass_systemd_analyze_verify(tmp_path):
    home, units, _ = render(tmp_path, "--system")
    # The instance unit resolves to the template in the same directory.
    paths = [str(units / "dflash-target.service"), str(units / "dflash-metrics.service"), str(units / "dflash-drafter@1.service")]
    done = subprocess.run(["systemd-analyze", "verify", *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    problems = [line for line in done.stderr.splitlines() if re.search(r"ignoring|unknown|not executable|Failed", line, re.I)]
    assert not problems, done.stderr
    # verify notices a missing executable, so the check above is not vacuous.
    (home / "deploy" / "run_process.sh").unlink()
    broken = subprocess.run(["systemd-analyze", "verify", paths[0]], capture_output=True, text=True, timeout=120)
    assert broken.returncode != 0 and "run_process.sh" in broken.stderr


def _fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text('#!/usr/bin/env bash\necho "pid=$$"\necho "cvd=${CUDA_VISIBLE_DEVICES-unset}"\necho "args=$*"\necho "cwd=$PWD"\n')
    python.chmod(0o755)
    return venv


@pytest.mark.parametrize("process, args, devices", [
    ("target", [], "0"),
    ("drafter", ["1"], "5"),
    ("drafter", ["exp-a"], "6,7"),
    ("metrics", [], "unset"),
])
def test_run_process_execs_python_with_the_right_gpus_and_args(tmp_path, process, args, devices):
    env = {
        "PATH": os.environ["PATH"], "DFLASH_VENV": str(_fake_venv(tmp_path)), "DFLASH_CONFIG": "/job.toml",
        "DFLASH_RUN_NAME": "exp2", "DFLASH_EXTRA_ARGS": "--set a.b=1",
        "DFLASH_TARGET_CUDA_VISIBLE_DEVICES": "0", "DFLASH_DRAFTER_1_CUDA_VISIBLE_DEVICES": "5",
        "DFLASH_DRAFTER_exp_a_CUDA_VISIBLE_DEVICES": "6,7",
    }
    proc = subprocess.Popen(["bash", str(ROOT / "deploy" / "run_process.sh"), process, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    got = dict(line.split("=", 1) for line in out.splitlines())
    # exec: the Python process keeps the pid systemd / tmux started.
    assert got["pid"] == str(proc.pid)
    assert got["cvd"] == devices
    module = {"target": "target_server", "drafter": "drafter_worker", "metrics": "metrics_sidecar"}[process]
    expected = f'-m {module} --config /job.toml --set run.name="exp2"' + (f" --id {args[0]}" if args else "") + " --set a.b=1"
    assert got["args"] == expected
    assert got["cwd"] == str(ROOT)


def test_run_process_refuses_a_missing_config_or_venv_in_one_line(tmp_path):
    base = {"PATH": os.environ["PATH"]}
    for env, message in (({**base, "DFLASH_VENV": str(_fake_venv(tmp_path))}, "DFLASH_CONFIG is not set"),
                         ({**base, "DFLASH_VENV": str(tmp_path / "none"), "DFLASH_CONFIG": "x"}, "no Python at")):
        done = subprocess.run(["bash", str(ROOT / "deploy" / "run_process.sh"), "target"], env=env,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1


def test_readme_documents_the_operations_commands():
    readme = (ROOT / "README.md").read_text()
    for snippet in ("make install-systemd", "systemctl restart dflash-drafter@1", "journalctl -fu dflash-metrics",
                    "make tmux", "make restart-drafter ID=1", "make stop", "make status", "dflash-status",
                    "make logs", "dflash-report"):
        assert snippet in readme, snippet
