"""deploy/node.py (the layout of one node: check, commands, torchrun supervision), the units and the
run_process.sh modes that start replicas and torchrun groups, and the tmux layout of such a node."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from common.config import load_config
from deploy.node import resolve
from tests.conftest import ROOT
from tests.deploy.test_systemd_units import KNOWN_KEYS, one, parse_unit, render
from tests.fixtures import write_config

NODE_CONFIG = ROOT / "configs" / "node-8gpu.toml"
SYSTEMD = ROOT / "deploy" / "systemd"
NEW_UNITS = ("dflash-target@.service", "dflash-drafter-group@.service")


def _node(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "CUDA_VISIBLE"))}
    run_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "deploy.node", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=run_env)


# ---------------------------------------------------------------------------
# The shipped 8-GPU node


def test_the_shipped_node_config_loads_and_validates():
    cfg = load_config(NODE_CONFIG)
    assert cfg.target.replicas == 5 and cfg.target.devices == [f"cuda:{i}" for i in range(5)]
    assert cfg.transport.kind == "nccl"
    assert load_config(NODE_CONFIG, ['drafter.id="g0"']).drafter.devices == ["cuda:5", "cuda:6", "cuda:7"]

    node = resolve(str(NODE_CONFIG), [], environ={})
    assert node.problems == [] and node.notes == []
    assert [(t.name, t.device, t.address, t.store_port) for t in node.targets] == [
        (f"target-{r}", f"cuda:{r}", f"tcp://127.0.0.1:{5555 + 100 * r}", 5556 + 100 * r) for r in range(5)]
    (g0,) = node.drafters
    assert (g0.id, g0.nproc, g0.devices, g0.torchrun) == ("g0", 3, ["cuda:5", "cuda:6", "cuda:7"], True)
    assert sorted({t.gpu for t in node.targets} | set(g0.gpus)) == [str(i) for i in range(8)]

    done = _node("--config", str(NODE_CONFIG), "--check")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for r in range(5):
        assert re.search(rf"target-{r} +replica {r} of 5 on cuda:{r}, control tcp://127.0.0.1:{5555 + 100 * r}, "
                         rf"store 127.0.0.1:{5556 + 100 * r}", out), out
    assert "3 ranks under torchrun" in out and "rank 0 cuda:5, rank 1 cuda:6, rank 2 cuda:7" in out
    assert "sidecar at tcp://127.0.0.1:5557" in out
    assert out.rstrip().endswith("layout ok: 5 target replica(s), 1 drafter(s) (3 rank(s)), 8 GPU(s) in use")


def test_print_commands_are_the_exact_command_lines():
    done = _node("--config", str(NODE_CONFIG), "--print-commands", "--set", "run.name=\"n1\"")
    assert done.returncode == 0, done.stderr
    cfg_args = f"--config {NODE_CONFIG} --set 'run.name=\"n1\"'"
    assert done.stdout.splitlines() == [
        f"dflash-metrics {cfg_args}",
        *(f"dflash-target {cfg_args} --replica {r}" for r in range(5)),
        f"torchrun --standalone --nproc-per-node 3 --max-restarts 3 -m drafter_worker {cfg_args} --group g0",
    ]
    # The environment of the units: torchrun restarts, and a GPU list the ranks are mapped through.
    done = _node("--config", str(NODE_CONFIG), "--print-commands",
                 env={"DFLASH_TORCHRUN_MAX_RESTARTS": "7", "DFLASH_TARGET_2_CUDA_VISIBLE_DEVICES": "2"})
    lines = done.stdout.splitlines()
    assert f"CUDA_VISIBLE_DEVICES=2 dflash-target --config {NODE_CONFIG} --replica 2" in lines
    assert lines[-1].startswith("torchrun --standalone --nproc-per-node 3 --max-restarts 7 ")


def test_shell_assignments_for_the_launcher():
    done = _node("--config", str(NODE_CONFIG), "--shell")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["TARGET_REPLICAS=5", "NODE_REPLICAS='0 1 2 3 4'", "DRAFTER_NPROCS=g0:3",
                                        "NODE_SIDECAR=1"]
    demo = _node("--config", str(ROOT / "configs" / "demo.toml"), "--shell")
    assert demo.stdout.splitlines() == ["TARGET_REPLICAS=1", "NODE_REPLICAS=0", "DRAFTER_NPROCS='d0:1 d1:1'",
                                        "NODE_SIDECAR=1"]


# ---------------------------------------------------------------------------
# Layouts that cannot work

DEVICES_8 = 'target.devices=["cuda:0","cuda:1","cuda:2","cuda:3","cuda:5"]'


@pytest.mark.parametrize("overrides, env, expected", [
    ([DEVICES_8], {},
     r"target-4 and drafter g0 rank 0 are both on cuda:5: their data-plane pair is NCCL, which needs two GPUs"),
    (['drafters.g0.devices=["cuda:5","cuda:6","cuda:5"]'], {},
     r"drafter g0: ranks 0 and 2 are both on cuda:5; its ranks average gradients over NCCL"),
    ([], {"DFLASH_DRAFTER_g0_NPROC": "4"},
     r"drafter g0: drafter\.devices names 3 device\(s\) \(cuda:5, cuda:6, cuda:7\) for 4 ranks "
     r"\(DFLASH_DRAFTER_g0_NPROC = 4\)"),
    (["control.replica_port_step=1"], {},
     r"target-0 data-plane store 127\.0\.0\.1:5556 and target-1 control tcp://127\.0\.0\.1:5556 would bind the same port"),
    (['control.replica_addresses=["tcp://127.0.0.1:6000","tcp://127.0.0.1:6100","tcp://127.0.0.1:6000",'
      '"tcp://127.0.0.1:6300","tcp://127.0.0.1:6400"]'], {},
     r"target-0 control tcp://127\.0\.0\.1:6000 and target-2 control tcp://127\.0\.0\.1:6000 would bind the same port"),
    (['metrics.address="tcp://127.0.0.1:5855"'], {},
     r"target-3 control tcp://127\.0\.0\.1:5855 and metrics sidecar tcp://127\.0\.0\.1:5855 would bind the same port"),
    (['target.devices=["cuda:0","cuda:1","cpu","cuda:3","cuda:4"]'], {},
     r"target-2: transport\.kind = 'nccl' needs a CUDA device, it is on cpu"),
    ([], {"DFLASH_TARGET_4_CUDA_VISIBLE_DEVICES": "4"},
     r"target-4: cuda:4 does not exist with CUDA_VISIBLE_DEVICES=4 \(1 GPU\(s\) visible\)"),
    # Each unit sees only its GPUs: replica 0's "cuda:0" is physical GPU 5, which rank 0 of g0 also uses.
    (['drafters.g0.devices=["cuda:0","cuda:1","cuda:2"]'],
     {"DFLASH_TARGET_0_CUDA_VISIBLE_DEVICES": "5", "DFLASH_DRAFTER_g0_CUDA_VISIBLE_DEVICES": "5,6,7"},
     r"target-0 and drafter g0 rank 0 are both on cuda:0 \(GPU 5\): their data-plane pair is NCCL"),
    (['drafters.g0.devices=["cuda:5","cuda:6","cuda:7"]'], {"DFLASH_DRAFTER_g0_CUDA_VISIBLE_DEVICES": "5,6,7"},
     r"drafter g0 rank 0: cuda:5 does not exist with CUDA_VISIBLE_DEVICES=5,6,7 \(3 GPU\(s\) visible\)"),
])
def test_a_layout_that_cannot_work_is_refused_with_a_clear_message(overrides, env, expected):
    args = ["--config", str(NODE_CONFIG), "--check"]
    for o in overrides:
        args += ["--set", o]
    done = _node(*args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    problems = [line for line in done.stderr.splitlines() if line.startswith("deploy.node: problem: ")]
    assert problems and done.stderr.splitlines()[-1] == f"deploy.node: this layout cannot work ({len(problems)} problem(s))"
    assert "Traceback" not in done.stderr
    assert any(re.search(expected, line) for line in problems), done.stderr
    # --print-commands refuses it too, after printing what it would run.
    args[-1] = "--print-commands"
    assert _node(*args, env=env).returncode == 2


def test_visible_devices_map_to_physical_gpus():
    # drafter.devices cuda:0-2 with DFLASH_DRAFTER_g0_CUDA_VISIBLE_DEVICES=5,6,7: GPUs 5-7, fine.
    env = {"DFLASH_DRAFTER_g0_CUDA_VISIBLE_DEVICES": "5,6,7"}
    node = resolve(str(NODE_CONFIG), ['drafters.g0.devices=["cuda:0","cuda:1","cuda:2"]'], environ=env)
    assert node.problems == [] and node.drafters[0].gpus == ["5", "6", "7"]
    # The same with nothing hidden collides with replicas 0-2.
    node = resolve(str(NODE_CONFIG), ['drafters.g0.devices=["cuda:0","cuda:1","cuda:2"]'], environ={})
    assert [p for p, _ in node.problems] == ["target-0", "target-1", "target-2"]
    # drafter.device = "cuda" and no list: rank k takes cuda:k (ranks from DFLASH_DRAFTER_<ID>_NPROC).
    node = resolve(str(NODE_CONFIG), ["drafters.g0.devices=[]"],
                   environ={"DFLASH_DRAFTER_g0_NPROC": "3", "DFLASH_DRAFTER_g0_CUDA_VISIBLE_DEVICES": "5,6,7"})
    assert node.problems == [] and node.drafters[0].devices == ["cuda:0", "cuda:1", "cuda:2"]
    # Without a list, one process.
    node = resolve(str(NODE_CONFIG), ["drafters.g0.devices=[]", 'drafter.device="cuda:5"'], environ={})
    assert node.problems == [] and (node.drafters[0].nproc, node.drafters[0].torchrun) == (1, False)


def test_replicas_on_two_hosts_are_checked_one_host_at_a_time(tmp_path):
    addresses = ('control.replica_addresses=["tcp://10.0.0.1:5555","tcp://10.0.0.1:5655","tcp://10.0.0.1:5755",'
                 '"tcp://10.0.0.2:5555","tcp://10.0.0.2:5655"]')
    node = resolve(str(NODE_CONFIG), [addresses], environ={})
    messages = [m for _, m in node.problems]
    assert any("the target replicas listen on 2 hosts (10.0.0.1, 10.0.0.2): check one host at a time with --host" in m
               for m in messages), messages
    assert any("binding beyond loopback needs security.curve_dir" in m for m in messages)

    keys = tmp_path / "keys"
    keys.mkdir()
    per_host = [addresses, f'security.curve_dir="{keys}"', 'control.store_host="10.0.0.2"']
    node = resolve(str(NODE_CONFIG), per_host, environ={}, host="10.0.0.2")
    assert node.problems == [], node.problems
    assert [(t.name, t.address, t.store_host, t.store_port) for t in node.targets] == [
        ("target-3", "tcp://10.0.0.2:5555", "10.0.0.2", 5856), ("target-4", "tcp://10.0.0.2:5655", "10.0.0.2", 5956)]
    # A store left on loopback cannot be reached by the other host's drafters.
    node = resolve(str(NODE_CONFIG), per_host[:2], environ={}, host="10.0.0.2")
    assert any("announces its data-plane store at 127.0.0.1" in m for _, m in node.problems)
    # shm never crosses a host.
    node = resolve(str(NODE_CONFIG), [*per_host, 'transport.kind="shm"'], environ={}, host="10.0.0.2")
    assert any("'shm' works within one host only" in m for _, m in node.problems)
    # This host runs none of the drafters.
    node = resolve(str(NODE_CONFIG), per_host, environ={}, host="10.0.0.2", drafters="none")
    assert node.drafters == [] and node.problems == []


def test_a_bad_config_is_one_line():
    done = _node("--config", str(ROOT / "nope.toml"), "--check")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "config error" in done.stderr


# ---------------------------------------------------------------------------
# --run-group: torchrun stopped the way a drafter expects


def test_supervise_relays_sigterm_to_the_ranks_and_torchrun_exits_0(tmp_path):
    """Real torchrun (CPU, 2 ranks of a stand-in module): SIGTERM to the supervisor reaches each rank, which
    exits 0, and so does torchrun (signalled itself it would exit 1)."""
    (tmp_path / "rank_stub.py").write_text(textwrap.dedent("""\
        import os, signal, sys, time
        def stop(*_):
            print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} got SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print(f"rank {os.environ['RANK']} up, LOCAL_RANK {os.environ['LOCAL_RANK']}", flush=True)
        time.sleep(120)
        sys.exit(5)
    """))
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from deploy.node import supervise; "
              "import os; env = dict(os.environ, PYTHONPATH=" + repr(str(tmp_path)) + "); "
              "sys.exit(supervise([sys.executable, '-m', 'torch.distributed.run', '--standalone', "
              "'--nproc-per-node', '2', '--max-restarts', '0', '-m', 'rank_stub'], env, 5.0, 'stub'))")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path)
    seen = []
    try:
        deadline = time.monotonic() + 90
        # Counted in the text, not by line: the two ranks' lines can arrive glued into one.
        for line in proc.stdout:
            seen.append(line)
            if "".join(seen).count(" up, LOCAL_RANK ") == 2 or time.monotonic() > deadline:
                break
        assert "".join(seen).count(" up, LOCAL_RANK ") == 2, "".join(seen)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = "".join(seen) + rest
    assert proc.returncode == 0, out
    assert "rank 0 of 2 got SIGTERM" in out and "rank 1 of 2 got SIGTERM" in out
    assert "stub: torchrun exited with status 0" in out


def test_run_group_refuses_an_unknown_drafter_or_a_broken_group():
    done = _node("--config", str(NODE_CONFIG), "--run-group", "nope")
    assert done.returncode == 2 and "--drafters names nope, which the config does not have" in done.stderr
    done = _node("--config", str(NODE_CONFIG), "--run-group", "g0", env={"DFLASH_DRAFTER_g0_NPROC": "5"})
    assert done.returncode == 2 and "drafter.devices names 3 device(s)" in done.stderr


# ---------------------------------------------------------------------------
# run_process.sh and the units


def _fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text('#!/usr/bin/env bash\necho "pid=$$"\necho "cvd=${CUDA_VISIBLE_DEVICES-unset}"\necho "args=$*"\n')
    python.chmod(0o755)
    return venv


@pytest.mark.parametrize("argv, devices, expected", [
    (["target", "3"], "3", '-m target_server --config /job.toml --set run.name="exp2" --replica 3 --set a.b=1'),
    (["target", "1"], "unset", '-m target_server --config /job.toml --set run.name="exp2" --replica 1 --set a.b=1'),
    (["target"], "0", '-m target_server --config /job.toml --set run.name="exp2" --set a.b=1'),
    (["drafter-group", "g0"], "5,6,7", '-m deploy.node --config /job.toml --set run.name="exp2" --run-group g0 --set a.b=1'),
])
def test_run_process_starts_replicas_and_torchrun_groups(tmp_path, argv, devices, expected):
    env = {
        "PATH": os.environ["PATH"], "DFLASH_VENV": str(_fake_venv(tmp_path)), "DFLASH_CONFIG": "/job.toml",
        "DFLASH_RUN_NAME": "exp2", "DFLASH_EXTRA_ARGS": "--set a.b=1",
        # The single-target variable never applies to a replica.
        "DFLASH_TARGET_CUDA_VISIBLE_DEVICES": "0", "DFLASH_TARGET_3_CUDA_VISIBLE_DEVICES": "3",
        "DFLASH_DRAFTER_g0_CUDA_VISIBLE_DEVICES": "5,6,7",
    }
    proc = subprocess.Popen(["bash", str(ROOT / "deploy" / "run_process.sh"), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    got = dict(line.split("=", 1) for line in out.splitlines())
    assert got["pid"] == str(proc.pid) and got["cvd"] == devices and got["args"] == expected


def test_run_process_refuses_a_replica_that_is_not_a_number(tmp_path):
    env = {"PATH": os.environ["PATH"], "DFLASH_VENV": str(_fake_venv(tmp_path)), "DFLASH_CONFIG": "/job.toml"}
    done = subprocess.run(["bash", str(ROOT / "deploy" / "run_process.sh"), "target", "x"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "the replica must be a number" in done.stderr


def test_replica_and_group_units_have_the_required_shape(tmp_path):
    known = {**KNOWN_KEYS, "Unit": KNOWN_KEYS["Unit"] | {"Conflicts"}}
    for name in NEW_UNITS:
        unit = parse_unit((SYSTEMD / name).read_text())
        for section, keys in unit.items():
            assert set(keys) <= known[section], f"{name}: unknown keys {set(keys) - known[section]}"
        assert one(unit, "Service", "EnvironmentFile") == "@ENV_FILE@"
        assert one(unit, "Service", "Restart") == "on-failure"
        assert one(unit, "Service", "KillSignal") == "SIGTERM" and one(unit, "Service", "KillMode") == "mixed"
        assert int(one(unit, "Service", "TimeoutStopSec")) > 90 + 10 + 10  # stop timeout, then the group's grace
        assert one(unit, "Install", "WantedBy") == "@WANTED_BY@"
        for key in ("Requires", "BindsTo", "PartOf", "Wants"):
            assert key not in unit["Unit"], f"{name}: ordering only, no dependency"
    target = parse_unit((SYSTEMD / "dflash-target@.service").read_text())
    assert one(target, "Service", "ExecStart") == "@DFLASH_HOME@/deploy/run_process.sh target %i"
    assert one(target, "Unit", "Conflicts") == "dflash-target.service"
    assert one(target, "Service", "SyslogIdentifier") == "dflash-target-%i"
    group = parse_unit((SYSTEMD / "dflash-drafter-group@.service").read_text())
    assert one(group, "Service", "ExecStart") == "@DFLASH_HOME@/deploy/run_process.sh drafter-group %i"
    assert one(group, "Unit", "Conflicts") == "dflash-drafter@%i.service"

    home, units, env_file = render(tmp_path, "--system", "--service-user", "dflash")
    for name in NEW_UNITS:
        text = (units / name).read_text()
        assert not re.search(r"@[A-Z_]+@", text)
        assert parse_unit(text)["Service"]["User"] == ["dflash"]
    env_text = env_file.read_text()
    assert "DFLASH_TORCHRUN_MAX_RESTARTS=3" in env_text and "DFLASH_NODE_HOST=" in env_text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_replica_and_group_units_pass_systemd_analyze_verify(tmp_path):
    _, units, _ = render(tmp_path, "--system")
    paths = [str(units / "dflash-target@0.service"), str(units / "dflash-target@4.service"),
             str(units / "dflash-drafter-group@g0.service")]
    done = subprocess.run(["systemd-analyze", "verify", *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    problems = [line for line in done.stderr.splitlines() if re.search(r"ignoring|unknown|not executable|Failed", line, re.I)]
    assert not problems, done.stderr


# ---------------------------------------------------------------------------
# The tmux launcher on a node of two replicas and a torchrun group (stand-in processes)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.timeout(120)
def test_tmux_windows_follow_the_node_layout(tmp_path):
    """Two replicas and drafter g0 of two ranks: windows target-0, target-1, drafter-g0 (a torchrun group) and
    drafter-d1 (one process). The job's processes are stand-ins (the fake Python below) that print their
    arguments and exit 0 on SIGTERM; the launcher's own tools run on the real Python."""
    config = write_config(tmp_path, "unused", drafters={"g0": {"devices": ["cpu", "cpu"]}, "d1": {}},
                          sections={"target": ["replicas = 2"]})
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        case " $* " in
            *" -m target_server "*|*" -m drafter_worker "*|*" -m metrics_sidecar "*|*" --run-group "*)
                echo "stand-in: $*"
                trap 'echo "stand-in stopping"; exit 0' TERM
                while true; do sleep 0.1; done ;;
            *) exec {sys.executable} "$@" ;;
        esac
    """))
    fake.chmod(0o755)
    socket = f"dflash-node-test-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "TMUX"))}
    env.update(DFLASH_TMUX_SOCKET=socket, DFLASH_TMUX_ATTACH="0", DFLASH_VENV=str(venv))

    def launch(action: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "deploy" / "tmux" / "launch.sh"), action, str(config), *args],
                              capture_output=True, text=True, timeout=90, env=env, cwd=ROOT)

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, timeout=30).stdout

    def pane_text(window: str) -> str:
        return tmux("capture-pane", "-p", "-J", "-t", f"=dflash-it:={window}")

    try:
        started = launch("start")
        assert started.returncode == 0, started.stdout + started.stderr
        windows = tmux("list-windows", "-t", "=dflash-it", "-F", "#{window_name}").split()
        assert windows == ["overview", "metrics", "target-0", "target-1", "drafter-g0", "drafter-d1"]
        expected = {"target-0": "-m target_server --config {c} --replica 0",
                    "target-1": "-m target_server --config {c} --replica 1",
                    "drafter-g0": "-m deploy.node --config {c} --run-group g0",
                    "drafter-d1": "-m drafter_worker --config {c} --id d1",
                    "metrics": "-m metrics_sidecar --config {c}"}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all("stand-in:" in pane_text(w) for w in expected):
            time.sleep(0.2)
        for window, args in expected.items():
            assert f"stand-in: {args.format(c=config)}" in pane_text(window), pane_text(window)

        restarted = launch("restart-drafter", "g0")
        assert restarted.returncode == 0, restarted.stdout + restarted.stderr
        assert "drafter-g0 exited with status 0" in restarted.stdout

        stopped = launch("stop")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        order = [line.split()[1] for line in stopped.stdout.splitlines() if "exited with status 0" in line]
        assert set(order[:2]) == {"drafter-g0", "drafter-d1"} and set(order[2:4]) == {"target-0", "target-1"}
        assert order[4:] == ["metrics"]
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, timeout=30)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tmux_start_refuses_a_layout_that_cannot_work(tmp_path):
    config = write_config(tmp_path, "unused", drafters={"g0": {}},
                          sections={"target": ["replicas = 2"], "control": ["replica_port_step = 1"]})
    # replica 1's control port is replica 0's store port when write_config's ports are consecutive; force it.
    text = config.read_text()
    control = int(re.search(r'address = "tcp://127\.0\.0\.1:(\d+)"', text).group(1))
    config.write_text(re.sub(r"store_port = \d+", f"store_port = {control + 1}", text))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "TMUX"))}
    env.update(DFLASH_TMUX_SOCKET=f"dflash-node-test-{os.getpid()}-bad", DFLASH_TMUX_ATTACH="0")
    done = subprocess.run(["bash", str(ROOT / "deploy" / "tmux" / "launch.sh"), "start", str(config)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "would bind the same port" in done.stderr and "cannot work" in done.stderr.splitlines()[-1]
    assert subprocess.run(["tmux", "-L", env["DFLASH_TMUX_SOCKET"], "has-session", "-t", "=dflash-it"],
                          capture_output=True, timeout=30).returncode != 0
