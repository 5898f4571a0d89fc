"""Tests for common/config.py: defaults, TOML loading, per-drafter tables, overrides, errors, hashing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.config import (
    Config,
    ConfigError,
    DataConfig,
    DrafterConfig,
    RunConfig,
    load_config,
    parse_override,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.toml"


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# Defaults and the shipped demo file
# ---------------------------------------------------------------------------


def test_defaults_validate_and_equal_an_empty_load():
    cfg = Config()
    assert load_config() == cfg
    assert load_config(None, ()) == cfg


def test_each_replica_gets_its_address_store_port_and_device():
    cfg = load_config(None, ["target.replicas=3", 'target.devices=["cuda:0", "cuda:1", "cuda:2"]',
                             'control.address="tcp://10.0.0.1:6000"', "control.store_port=6001"])
    r2 = cfg.for_replica(2)
    assert (r2.target.replica, r2.control.address, r2.control.store_port, r2.target.device) == (
        2, "tcp://10.0.0.1:6200", 6201, "cuda:2")
    assert [cfg.replica_address(r) for r in range(3)] == [f"tcp://10.0.0.1:{6000 + 100 * r}" for r in range(3)]
    listed = load_config(None, ["target.replicas=2", 'control.replica_addresses=["tcp://a:1", "tcp://b:2"]'])
    assert listed.for_replica(1).control.address == "tcp://b:2"
    assert listed.shared_hash() != load_config().shared_hash()  # drafters and targets agree on the replica count
    two = ["target.replicas=2"]
    assert load_config(None, [*two, "target.replica=1"]).shared_hash() == load_config(None, two).shared_hash()


@pytest.mark.parametrize("overrides, key", [
    (["target.replicas=2", "target.replica=2"], "target.replica"),
    (["target.replicas=2", 'control.replica_addresses=["tcp://a:1"]'], "control.replica_addresses"),
    (["target.replicas=2", 'target.devices=["cpu"]'], "target.devices"),
])
def test_replica_settings_that_cannot_work_are_refused(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_a_torchrun_rank_takes_its_device_by_local_rank():
    assert load_config(None, ['drafter.device="cuda"']).for_local_rank(2).drafter.device == "cuda:2"
    listed = load_config(None, ['drafter.devices=["cuda:5", "cuda:6", "cuda:7"]'])
    assert listed.for_local_rank(1).drafter.device == "cuda:6"
    with pytest.raises(ConfigError, match="LOCAL_RANK is 3"):
        listed.for_local_rank(3)


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()


def test_demo_toml_loads():
    cfg = load_config(DEMO)
    assert cfg.run.name == "demo"
    assert cfg.target.model == "smollm2"
    assert cfg.data.bucket_lengths == [64, 128, 192]
    assert cfg.data.tokens_per_batch == 768
    assert cfg.transport.kind == "gloo"
    assert cfg.drafter.max_steps == 60
    assert cfg.drafter.checkpoint_every_steps == 20
    # Default drafter id is d0, so [drafters.d0] applies.
    assert cfg.drafter.id == "d0"
    assert cfg.drafter.learning_rate == pytest.approx(1e-3)
    assert cfg.drafter.seed == 0


def test_demo_toml_second_drafter_table():
    cfg = load_config(DEMO, ["drafter.id=d1"])
    assert cfg.drafter.id == "d1"
    assert cfg.drafter.learning_rate == pytest.approx(3e-4)
    assert cfg.drafter.seed == 1
    # Keys the per-drafter table does not name come from [drafter].
    assert cfg.drafter.max_steps == 60


# ---------------------------------------------------------------------------
# Precedence: [drafter] < [drafters.<id>] < --set
# ---------------------------------------------------------------------------


PRECEDENCE = """
[drafter]
id = "a"
learning_rate = 1e-3
warmup_steps = 3
seed = 5

[drafters.a]
learning_rate = 2e-3
seed = 6

[drafters.b]
learning_rate = 4e-3
"""


def test_per_drafter_table_merges_over_drafter(tmp_path):
    cfg = load_config(write(tmp_path, PRECEDENCE))
    assert cfg.drafter.id == "a"
    assert cfg.drafter.learning_rate == pytest.approx(2e-3)
    assert cfg.drafter.seed == 6
    assert cfg.drafter.warmup_steps == 3  # untouched by [drafters.a]


def test_command_line_wins_over_per_drafter_table(tmp_path):
    cfg = load_config(write(tmp_path, PRECEDENCE), ["drafter.learning_rate=9e-4", "drafter.warmup_steps=7"])
    assert cfg.drafter.learning_rate == pytest.approx(9e-4)  # over [drafters.a]
    assert cfg.drafter.warmup_steps == 7  # over [drafter]
    assert cfg.drafter.seed == 6  # [drafters.a] still applies to keys not on the command line


def test_command_line_id_selects_per_drafter_table(tmp_path):
    cfg = load_config(write(tmp_path, PRECEDENCE), ["drafter.id=b"])
    assert cfg.drafter.id == "b"
    assert cfg.drafter.learning_rate == pytest.approx(4e-3)
    assert cfg.drafter.seed == 5  # from [drafter]: [drafters.b] has no seed


def test_id_without_table_uses_drafter_section(tmp_path):
    cfg = load_config(write(tmp_path, PRECEDENCE), ["drafter.id=zz"])
    assert cfg.drafter.learning_rate == pytest.approx(1e-3)


def test_override_without_file():
    cfg = load_config(None, ["data.bucket_lengths=[64,128,256,512]", "data.max_seq_len=512", "run.name=x"])
    assert cfg.data.bucket_lengths == [64, 128, 256, 512]
    assert cfg.data.max_seq_len == 512
    assert cfg.run.name == "x"


def test_int_accepted_for_float_field():
    cfg = load_config(None, ["drafter.learning_rate=1"])
    assert cfg.drafter.learning_rate == 1.0
    assert isinstance(cfg.drafter.learning_rate, float)


# ---------------------------------------------------------------------------
# Errors name the key (or the file)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[bogus]\nx = 1\n", "[bogus]"),
        ("[drafter]\nlerning_rate = 1e-3\n", "drafter.lerning_rate"),
        ("[data]\nmax_seq_len = \"long\"\n", "data.max_seq_len"),
        ("[data]\nmax_seq_len = true\n", "data.max_seq_len"),  # bool is not an int
        ("[data]\nmax_seq_len = 1.5\n", "data.max_seq_len"),
        ("[drafter]\nlearning_rate = \"fast\"\n", "drafter.learning_rate"),
        ("[drafter]\nlearning_rate = false\n", "drafter.learning_rate"),
        ("[data]\nbucket_lengths = 64\n", "data.bucket_lengths"),
        ("[data]\nbucket_lengths = [64, \"x\"]\n", "data.bucket_lengths[1]"),
        ("[target]\ntarget_layer_ids = [1, 2.0]\n", "target.target_layer_ids[1]"),
        ("[run]\nname = 5\n", "run.name"),
        ("run = 5\n", "[run]"),
        ("drafter = 5\n", "[drafter]"),  # regression: was an AttributeError
        ("drafters = 5\n", "[drafters]"),
        ("[drafters]\nd0 = 5\n", "[drafters.d0]"),
        ("[drafters.d0]\nbogus = 1\n", "drafter.bogus"),
        ("[drafters.d0]\nseed = \"x\"\n", "drafter.seed"),
    ],
)
def test_bad_key_or_type_names_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("drafter.block_size=1", "drafter.block_size"),
        ("drafter.credits=0", "drafter.credits"),
        ("drafter.credits=65", "drafter.credits"),
        ("drafter.min_lr_ratio=1.5", "drafter.min_lr_ratio"),
        ("drafter.learning_rate=0", "drafter.learning_rate"),
        ("drafter.id=a/b", "drafter.id"),
        ("drafter.id=[1]", "drafter.id"),  # regression: was "unhashable type: list"
        ("data.max_seq_len=4", "data.max_seq_len"),
        ("data.bucket_lengths=[128,64]", "data.bucket_lengths"),
        ("data.bucket_lengths=[]", "data.bucket_lengths"),
        ("data.heldout_fraction=1.0", "data.heldout_fraction"),
        ("data.tokens_per_batch=100", "data.tokens_per_batch"),
        ("control.store_port=70000", "control.store_port"),
        ("control.address=http://x", "control.address"),
        ("control.heartbeat_timeout_s=1.5", "control.heartbeat_timeout_s"),
        ("transport.kind=tcp", "transport.kind"),
        ("metrics.wandb_mode=maybe", "metrics.wandb_mode"),
        ("target.dtype=int8", "target.dtype"),
        ("target.ready_batches=0", "target.ready_batches"),
        ("run.name=", "run.name"),
        ("bogus.key=1", "[bogus]"),
        ("drafter.nope=1", "drafter.nope"),
        ("drafter.seed.x=1", "drafter.seed"),
    ],
)
def test_bad_override_names_the_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_override_below_a_scalar_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"drafter\.seed\.x"):
        load_config(write(tmp_path, PRECEDENCE), ["drafter.seed.x=1"])


def test_out_of_range_in_file_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"drafter\.block_size must be >= 2, got 1"):
        load_config(write(tmp_path, "[drafter]\nblock_size = 1\n"))


@pytest.mark.parametrize("overrides, key", [
    (["drafter.block_size=4", "drafter.denoise_passes=4"], "drafter.denoise_passes"),
    (["drafter.denoise_passes=0"], "drafter.denoise_passes"),
    (["drafter.reveal_fraction=1.5"], "drafter.reveal_fraction"),
    (["drafter.block_size=4", "drafter.causal_passes=true"], "drafter.causal_passes"),
    (["drafter.block_size=4", "drafter.denoise_passes=3", "drafter.causal_passes=true", "drafter.reveal_fraction=0.25"],
     "drafter.causal_passes"),
])
def test_denoising_settings_out_of_range_are_refused(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize("key", ["drafter.threads", "drafter.threads_while_capturing"])
def test_negative_thread_counts_are_refused(key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + " must be >= 0"):
        load_config(None, [f"{key}=-1"])


@pytest.mark.parametrize("override, key", [
    ("target.dtype=bf16", "target.dtype"),
    ("drafter.autocast=float16", "drafter.autocast"),
])
def test_unknown_dtypes_are_refused(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + " must be"):
        load_config(None, [override])
    # "auto" resolves on the host that runs the forward pass (common.devices.resolve_dtype).
    assert load_config(None, ["target.dtype=auto", "drafter.autocast=auto"]).target.dtype == "auto"


def test_a_head_of_its_own_needs_a_draft_vocabulary():
    with pytest.raises(ConfigError, match=r"drafter\.train_draft_head.*draft_vocab_size"):
        load_config(None, ["drafter.train_draft_head=true"])
    assert load_config(None, ["drafter.train_draft_head=true", "drafter.draft_vocab_size=64"]).drafter.train_draft_head


def test_config_error_is_a_value_error():
    # Dataclass validation follows the STYLE rule: ValueError naming the dotted key.
    with pytest.raises(ValueError, match="drafter.num_layers"):
        DrafterConfig(num_layers=0)


def test_malformed_toml_names_the_path(tmp_path):
    path = write(tmp_path, "[drafter\nseed = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "not valid TOML" in str(info.value)


def test_non_utf8_file_is_a_config_error(tmp_path):
    # Regression: a file that is not UTF-8 escaped as a bare UnicodeDecodeError traceback.
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[run]\nname = \"d\xe9mo\"\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "does not exist" in str(info.value)


def test_directory_instead_of_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value)


# ---------------------------------------------------------------------------
# parse_override
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("drafter.seed=3", "drafter.seed", 3),
        ("drafter.seed=-3", "drafter.seed", -3),
        ("drafter.learning_rate=3e-4", "drafter.learning_rate", 3e-4),
        ("drafter.loss_gamma=7.5", "drafter.loss_gamma", 7.5),
        ("data.bucket_lengths=[64,128]", "data.bucket_lengths", [64, 128]),
        ("data.bucket_lengths=[ 64, 128 ]", "data.bucket_lengths", [64, 128]),
        ("target.model=smollm2", "target.model", "smollm2"),  # bare string
        ("target.model=/models/qwen3-8b", "target.model", "/models/qwen3-8b"),
        ('target.model="quoted"', "target.model", "quoted"),
        ("run.name=a=b", "run.name", "a=b"),  # only the first '=' splits
        ("metrics.wandb_entity=", "metrics.wandb_entity", ""),
        ("x.flag=true", "x.flag", True),
        (" drafter.seed =4", "drafter.seed", 4),  # the key is stripped
        ("drafters.d1.seed=2", "drafters.d1.seed", 2),
    ],
)
def test_parse_override(text, key, value):
    got_key, got_value = parse_override(text)
    assert got_key == key
    assert got_value == value
    assert type(got_value) is type(value)


@pytest.mark.parametrize("text", ["drafter.seed", "seed=3", "=3"])
def test_parse_override_rejects_bad_shapes(text):
    with pytest.raises(ConfigError):
        parse_override(text)


def test_override_of_per_drafter_table(tmp_path):
    cfg = load_config(write(tmp_path, PRECEDENCE), ["drafters.a.seed=11"])
    assert cfg.drafter.seed == 11


# ---------------------------------------------------------------------------
# shared_hash
# ---------------------------------------------------------------------------


def test_shared_hash_is_stable():
    assert Config().shared_hash() == Config().shared_hash()
    assert len(Config().shared_hash()) == 16


@pytest.mark.parametrize(
    "override",
    [
        "data.seed=1",
        "data.max_seq_len=128",
        "data.bucket_lengths=[128,256]",
        "data.tokens_per_batch=2048",
        "data.source=chats.jsonl",
        "data.num_epochs=2",
        "target.model=other",
        "target.dtype=bfloat16",
        "target.num_captured_layers=3",
        "target.target_layer_ids=[1,2]",
        "target.mask_token_id=7",
    ],
)
def test_shared_hash_changes_with_shared_settings(override):
    assert load_config(None, [override]).shared_hash() != Config().shared_hash()


@pytest.mark.parametrize(
    "override",
    [
        "drafter.learning_rate=1e-3",
        "drafter.id=d7",
        "drafter.num_layers=3",
        "drafter.block_size=8",
        "drafter.seed=9",
        "drafter.device=cuda:1",
        "run.name=other",
        "metrics.log_every_steps=1",
        "target.threads=4",  # a target-local knob, not something the drafter must agree on
        "target.device=cuda:0",
    ],
)
def test_shared_hash_ignores_local_settings(override):
    assert load_config(None, [override]).shared_hash() == Config().shared_hash()


def test_demo_drafters_share_a_hash():
    assert load_config(DEMO).shared_hash() == load_config(DEMO, ["drafter.id=d1"]).shared_hash()


# ---------------------------------------------------------------------------
# to_toml round trip
# ---------------------------------------------------------------------------


def _round_trip(tmp_path: Path, cfg: Config) -> Config:
    text = cfg.to_toml()
    return load_config(write(tmp_path, text, "resolved.toml"))


def test_to_toml_round_trips_defaults(tmp_path):
    cfg = Config()
    assert _round_trip(tmp_path, cfg) == cfg


def test_to_toml_round_trips_demo(tmp_path):
    for overrides in ([], ["drafter.id=d1"]):
        cfg = load_config(DEMO, overrides)
        back = _round_trip(tmp_path, cfg)
        assert back == cfg
        assert back.shared_hash() == cfg.shared_hash()


def test_to_toml_round_trips_unusual_values(tmp_path):
    cfg = load_config(None, [
        "drafter.learning_rate=1e-5",
        "drafter.loss_gamma=0.1",
        "target.target_layer_ids=[1,5,9]",
        "metrics.wandb_entity=team",
    ])
    cfg = dataclasses.replace(
        cfg,
        # Regression: json.dumps wrote non-BMP characters as surrogate pairs, which TOML refuses.
        run=RunConfig(name='d\u00e9mo-\U0001f600 "q" \\ \t\x7f', root_dir="/tmp/r\u00fcns"),
        data=DataConfig(bucket_lengths=[32, 256], max_seq_len=200, tokens_per_batch=512),
    )
    text = cfg.to_toml()
    assert text.isascii()
    assert _round_trip(tmp_path, cfg) == cfg
