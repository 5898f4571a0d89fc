"""drafter.init_target_layers: a fresh drafter's layers start as copies of the target's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common import protocol as P
from common.config import ConfigError, load_config
from drafter_worker.connection import FatalError
from common.model_loader import decoder_layers
from common.model_loader import final_norm_weight, load_target
from tests import messages

# tests/fixtures.make_tiny_target: hidden 64, 6 layers, 4 query heads and 2 key/value heads of 16.
ARCH = P.TargetArch(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=1024)
CAPTURED = [1, 3, 5]


def welcome(target, **overrides) -> P.Welcome:
    fields = dict(hidden_size=64, num_target_layers=6, target_layer_ids=CAPTURED, vocab_size=target.vocab_size,
                  mask_token_id=0, target_arch=ARCH,
                  final_norm_weight=final_norm_weight(target.model)[0].float().tolist())
    fields.update(overrides)
    return messages.welcome(**fields)


def make_worker(tmp_path: Path, model_dir: Path, *extra: str):
    from drafter_worker.worker import DrafterWorker

    return DrafterWorker(load_config(None, [
        f'run.root_dir="{tmp_path}"', 'run.name="w"', 'drafter.id="d0"', "drafter.block_size=4",
        f'target.model="{model_dir}"', "drafter.num_layers=2", *extra,
    ]))


def test_a_fresh_drafter_starts_from_the_targets_last_layers(tmp_path, tiny_llama_dir):
    target = load_target(str(tiny_llama_dir))
    source = decoder_layers(target.model)
    # 4 key/value heads where the target has 2: each query head must keep the target head it shared.
    worker = make_worker(tmp_path, tiny_llama_dir, "drafter.init_target_layers=[4, 5]", "drafter.num_key_value_heads=4")
    try:
        worker._ensure_model(welcome(target))
        model = worker.trainer.model
        for j, lid in enumerate([4, 5]):
            ours, theirs = model.layers[j], source[lid]
            for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                         "input_layernorm", "post_attention_layernorm"):
                assert torch.equal(ours.get_submodule(name).weight, theirs.get_submodule(name).weight), (lid, name)
            for proj in ("k_proj", "v_proj"):
                w_ours = getattr(ours.self_attn, proj).weight.view(4, 16, 64)
                w_theirs = getattr(theirs.self_attn, proj).weight.view(2, 16, 64)
                for head in range(4):  # transformers' repeat_kv: query head h reads key/value head h // 2
                    assert torch.equal(w_ours[head], w_theirs[head // 2]), (lid, proj, head)
        # fc passes captured layer 3 (the input of target layer 4) through; the other captured layers start at 0.
        features = torch.randn(2, 5, 3 * 64)
        assert torch.equal(model.fc(features), features[..., 64:128])
        assert torch.equal(model.hidden_norm.weight, source[4].input_layernorm.weight)
        # ... so the first batch must not rescale fc's columns.
        assert worker._fc_from_target and worker._fresh_model
        worker._embed = worker._head = target.model.get_input_embeddings().weight.detach().float()
        worker._initial_scales()
        assert worker._scale_features is False
    finally:
        worker.close()


def test_without_the_layer_below_fc_stays_random_and_is_scaled(tmp_path, tiny_llama_dir):
    target = load_target(str(tiny_llama_dir))
    worker = make_worker(tmp_path, tiny_llama_dir, "drafter.init_target_layers=[3]")
    try:
        worker._ensure_model(welcome(target, target_layer_ids=[1, 4, 5]))
        assert torch.equal(worker.trainer.model.layers[0].mlp.up_proj.weight, decoder_layers(target.model)[3].mlp.up_proj.weight)
        assert not worker._fc_from_target
        assert worker.trainer.model.fc.weight.abs().sum(0).min() > 0  # no column was zeroed
    finally:
        worker.close()


@pytest.mark.parametrize("overrides, expected", [
    ({"num_target_layers": 5, "target_layer_ids": [1, 3, 4]}, "no layer 5"),
    ({"final_norm_weight": [2.0] * 64}, "not the model the target serves"),
])
def test_a_target_model_that_is_not_the_served_one_is_refused(tmp_path, tiny_llama_dir, overrides, expected):
    target = load_target(str(tiny_llama_dir))
    worker = make_worker(tmp_path, tiny_llama_dir, "drafter.init_target_layers=[4, 5]")
    try:
        with pytest.raises(FatalError, match=expected):
            worker._ensure_model(welcome(target, **overrides))
    finally:
        worker.close()


@pytest.mark.parametrize("setting, expected", [
    (["drafter.init_target_layers=[3, 4, 5]"], "more layers than drafter.num_layers"),
    (["drafter.init_target_layers=[-1]"], "indices >= 0"),
    (["drafter.init_target_layers=[5]", 'drafter.init_from="x"'], "two starting points"),
])
def test_init_target_layers_that_cannot_work_are_refused(setting, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["drafter.num_layers=2", *setting])


def test_ranks_other_than_0_do_not_load_the_target(tmp_path, tiny_llama_dir):
    # Rank 0's weights reach them at DDP's first round; they only need to know whether fc passes a layer through.
    from drafter_worker import model_setup

    target = load_target(str(tiny_llama_dir))
    cfg = load_config(None, ['target.model="/nowhere/model"', "drafter.num_layers=2", "drafter.init_target_layers=[4, 5]"])
    model = model_setup.fresh_model(cfg.drafter, welcome(target), torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert model_setup.copy_target_layers_into(model, cfg.target, cfg.drafter, welcome(target), load=False) is True
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(FatalError, match="on the drafter's host"):
        model_setup.copy_target_layers_into(model, cfg.target, cfg.drafter, welcome(target))
