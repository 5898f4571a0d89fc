"""Speculative decoding (tools/speculative.py) on a tiny random Llama target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafter_worker.model.dflash_model import DFlashDrafter, build_target_layer_ids, make_drafter_config
from tools.speculative import (
    DFlashProposer,
    SpecStats,
    _new_cache,
    _target_forward,
    _verify_sampled,
    crop_cache,
    evaluation_decoding,
    plain_generate,
    speculative_generate,
    target_features,
)

VOCAB = 256
HIDDEN = 64
LAYERS = 6
BLOCK = 4


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    # A larger init than the default 0.02 so the random target's argmax is not
    # a near-tie everywhere (ties would make greedy equality depend on rounding).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.requires_grad_(False)
    return model


def make_drafter(seed: int = 0, block_size: int = BLOCK) -> DFlashDrafter:
    config = make_drafter_config(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        num_hidden_layers=1, num_target_layers=LAYERS, target_layer_ids=build_target_layer_ids(LAYERS, 2),
        block_size=block_size, mask_token_id=VOCAB - 1,
    )
    torch.manual_seed(seed)
    return DFlashDrafter(config).eval()


def dflash_proposer(target, drafter: DFlashDrafter) -> DFlashProposer:
    return DFlashProposer(drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight)


def hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 17, 99, 3, 42], [7], list(range(10, 40))]


class OracleProposer:
    """Test-only proposer that drafts the target's own greedy continuation.

    ``wrong_from`` (1-based block position) makes every draft from that
    position on wrong, so each step must accept exactly ``wrong_from - 1``.
    """

    layer_ids = None

    def __init__(self, prompt: list[int], continuation: list[int], block_size: int, wrong_from: int | None = None):
        self.sequence = prompt + continuation
        self.block_size = block_size
        self.wrong_from = wrong_from
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0

    def propose(self, features, anchor, start, num_draft, tokens=()):
        self.calls += 1
        assert features is None
        assert self.sequence[start] == anchor
        drafts = list(self.sequence[start + 1 : start + 1 + num_draft])
        if self.wrong_from is not None:
            for k in range(self.wrong_from - 1, len(drafts)):
                drafts[k] = (drafts[k] + 1) % VOCAB
        return F.one_hot(torch.tensor(drafts), VOCAB).float() * 10.0


def test_speculative_equals_plain_greedy_with_random_drafter(target):
    proposer = dflash_proposer(target, make_drafter())
    stats = SpecStats(BLOCK)
    for i, prompt in enumerate(PROMPTS):
        n = 17
        plain = plain_generate(target, prompt, max_new_tokens=n)
        spec = speculative_generate(target, proposer, prompt, max_new_tokens=n)
        assert spec.tokens == plain.tokens
        if i == 0:  # plain_generate is itself the target's greedy decoding
            assert plain.tokens == hf_greedy(target, prompt, n)
        assert sum(spec.step_tokens) + 1 == n  # the prefill gives the first token
        stats.add(spec)
    # An untrained drafter is (nearly) always rejected: one token per step.
    assert 1.0 <= stats.tau < 1.5
    assert len(stats.acceptance_rate()) == BLOCK - 1


def test_draft_tokens_caps_what_a_step_verifies(target):
    # A perfect drafter verified 2 drafts at a time: every step yields exactly 3 tokens
    # (2 accepted + the target's), the output is still greedy decoding, and no step drafts more.
    n = 1 + 4 * 3
    prompt = PROMPTS[0]
    reference = plain_generate(target, prompt, max_new_tokens=n + BLOCK).tokens
    oracle = OracleProposer(prompt, reference, BLOCK, None)
    spec = speculative_generate(target, oracle, prompt, max_new_tokens=n, draft_tokens=2)
    assert spec.tokens == reference[:n]
    assert spec.step_drafts == [2] * 4 and spec.step_tokens == [3] * 4
    with pytest.raises(ValueError, match="draft_tokens"):
        speculative_generate(target, oracle, prompt, max_new_tokens=n, draft_tokens=BLOCK)


@pytest.mark.parametrize("wrong_from, tau", [(None, BLOCK), (3, 3), (1, 1)])
def test_oracle_drafter_reaches_block_size(target, wrong_from, tau):
    # max_new_tokens = 1 + k * block_size: every step can accept a full block.
    n = 1 + 4 * BLOCK
    for prompt in PROMPTS[:2]:
        reference = plain_generate(target, prompt, max_new_tokens=n + BLOCK).tokens
        oracle = OracleProposer(prompt, reference, BLOCK, wrong_from)
        spec = speculative_generate(target, oracle, prompt, max_new_tokens=n)
        assert spec.tokens == reference[:n]
        if wrong_from is None:
            assert spec.step_tokens == [BLOCK] * 4 and spec.tau == BLOCK
        else:
            assert spec.step_tokens[:-1] == [tau] * (len(spec.step_tokens) - 1)
        stats = SpecStats(BLOCK)
        stats.add(spec)
        rates = stats.acceptance_rate()
        if wrong_from is None:
            assert rates == [1.0] * (BLOCK - 1)
        else:
            assert rates[: wrong_from - 1] == [1.0] * (wrong_from - 1)
            assert all(r == 0.0 for r in rates[wrong_from - 1 :])


def test_stop_token_ends_generation(target):
    prompt = PROMPTS[0]
    reference = plain_generate(target, prompt, max_new_tokens=20).tokens
    stop = reference[6]
    expected = reference[: reference.index(stop) + 1]
    assert plain_generate(target, prompt, max_new_tokens=20, stop_token_ids=[stop]).tokens == expected
    oracle = OracleProposer(prompt, reference, BLOCK)
    assert speculative_generate(target, oracle, prompt, max_new_tokens=20, stop_token_ids=[stop]).tokens == expected
    proposer = dflash_proposer(target, make_drafter())
    assert speculative_generate(target, proposer, prompt, max_new_tokens=20, stop_token_ids=[stop]).tokens == expected


def record_proposals(proposer: DFlashProposer) -> list:
    """Wrap ``proposer.propose`` so each call's ``(anchor, start, logits)`` lands in the returned list."""
    calls = []
    inner = proposer.propose

    def logged(features, anchor, start, num_draft, tokens=()):
        logits = inner(features, anchor, start, num_draft, tokens)
        calls.append((anchor, start, logits))
        return logits

    proposer.propose = logged
    return calls


def test_drafter_sees_the_same_context_as_in_training(target):
    # The cached, incrementally built drafter context must give the drafts a
    # full-sequence pass gives (what training computes from the target server's features).
    drafter = make_drafter(seed=3)
    proposer = dflash_proposer(target, drafter)
    calls = record_proposals(proposer)
    prompt = PROMPTS[2]
    spec = speculative_generate(target, proposer, prompt, max_new_tokens=17)
    sequence = prompt + spec.tokens
    with torch.no_grad():
        hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        features = target_features(hidden, drafter.target_layer_ids)
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
        assert len(calls) == sum(1 for d in spec.step_drafts if d) >= 3
        for anchor, start, logits in calls:
            assert sequence[start] == anchor
            block = torch.full((1, BLOCK), drafter.mask_token_id)
            block[0, 0] = anchor
            out = drafter(features[:, :start], F.embedding(block, embed), torch.arange(start + BLOCK)[None])
            expected = F.linear(out[0, 1 : 1 + logits.shape[0]], head)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_temperature_sampling_runs_and_is_seeded(target):
    proposer = dflash_proposer(target, make_drafter())
    prompt = PROMPTS[0]
    runs = [speculative_generate(target, proposer, prompt, max_new_tokens=12, temperature=0.8,
                                 generator=torch.Generator().manual_seed(7)).tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12
    assert all(0 <= t < VOCAB for t in runs[0])


def test_rejection_sampling_keeps_the_target_distribution():
    # Speculative sampling must emit tokens distributed as the target's p,
    # whatever the draft distribution q is.
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    target_logits = torch.log(torch.stack([p, p]))  # position 0 and the bonus position
    counts = torch.zeros(4)
    trials = 2000
    drafts = torch.multinomial(q.expand(trials, 4), 1, replacement=True, generator=gen)[:, 0].tolist()
    for d in drafts:
        accepted, correction = _verify_sampled([d], q[None], target_logits, 1.0, gen)
        counts[d if accepted == 1 else correction] += 1
    torch.testing.assert_close(counts / trials, p, rtol=0, atol=0.04)


def make_denoising_drafter(passes: int, causal: bool = False, own_head: bool = False) -> DFlashDrafter:
    config = make_drafter_config(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        num_hidden_layers=2, num_target_layers=LAYERS, target_layer_ids=build_target_layer_ids(LAYERS, 2),
        block_size=BLOCK, mask_token_id=VOCAB - 1, denoise_passes=passes, draft_vocab_size=128,
        layer_types=["sliding_attention", "full_attention"], sliding_window=BLOCK, causal_passes=causal,
        draft_head=own_head,
    )
    torch.manual_seed(5)
    drafter = DFlashDrafter(config).eval()
    drafter.set_draft_vocab(list(range(VOCAB - 1, VOCAB - 129, -1)))
    if own_head:
        with torch.no_grad():
            drafter.draft_head.normal_()
    return drafter


def test_denoising_passes_show_each_fixed_draft_to_the_next_pass(target):
    # Pass i fixes slot i + 1 to its argmax: every slot's logits must equal an uncached pass over the
    # whole context and the block with the earlier slots' drafts in place of their masks (what training
    # shows with drafter.reveal_fraction), through the sliding window and the draft vocabulary alike.
    drafter = make_denoising_drafter(passes=BLOCK - 1)
    proposer = dflash_proposer(target, drafter)
    assert proposer.denoise_passes == BLOCK - 1  # the drafter's own setting is the default
    calls = record_proposals(proposer)
    prompt = PROMPTS[2]
    spec = speculative_generate(target, proposer, prompt, max_new_tokens=17)
    assert spec.tokens == plain_generate(target, prompt, max_new_tokens=17).tokens
    sequence = prompt + spec.tokens
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    rows = head[drafter.draft_vocab]
    with torch.no_grad():
        features = target_features(target(torch.tensor([sequence]), output_hidden_states=True).hidden_states,
                                   drafter.target_layer_ids)
        assert len(calls) >= 3 and any(logits.shape[0] == BLOCK - 1 for _, _, logits in calls)
        for anchor, start, logits in calls:
            block = torch.full((1, BLOCK), drafter.mask_token_id)
            block[0, 0] = anchor
            for slot in range(1, logits.shape[0] + 1):
                out = drafter(features[:, :start], F.embedding(block, embed), torch.arange(start + BLOCK)[None])
                expected = F.linear(out[0, slot], rows)
                torch.testing.assert_close(logits[slot - 1, drafter.draft_vocab], expected, rtol=1e-4, atol=1e-4)
                block[0, slot] = int(drafter.draft_vocab[expected.argmax()])
    # One pass drafts differently: the later slots no longer see the earlier drafts.
    single = DFlashProposer(drafter, embed, head, denoise_passes=1)
    features_0 = features[:, : len(prompt)]
    assert not torch.equal(single.propose(features_0, sequence[len(prompt)], len(prompt), BLOCK - 1)[1:],
                           DFlashProposer(drafter, embed, head).propose(features_0, sequence[len(prompt)],
                                                                         len(prompt), BLOCK - 1)[1:])
    with pytest.raises(ValueError, match="denoise_passes"):
        DFlashProposer(drafter, embed, head, denoise_passes=BLOCK)



@pytest.mark.parametrize("own_head", [False, True], ids=["target-rows", "own-head"])
def test_causal_passes_draft_each_slot_seeing_only_the_drafts_before_it(target, own_head):
    # A drafter trained with drafter.causal_passes: pass i fixes slot i + 1 and every slot sees only the
    # slots up to itself, so each slot's logits equal an uncached causal pass over the whole context and
    # the block [anchor, earlier drafts, masks]; the output stays exactly greedy. A drafter with a head of
    # its own (drafter.train_draft_head) scores its drafts with that head, not the target's rows.
    from drafter_worker.model.modeling_dflash import causal_block_mask

    drafter = make_denoising_drafter(passes=BLOCK - 1, causal=True, own_head=own_head)
    proposer = dflash_proposer(target, drafter)
    calls = record_proposals(proposer)
    prompt = PROMPTS[1]
    spec = speculative_generate(target, proposer, prompt, max_new_tokens=17)
    assert spec.tokens == plain_generate(target, prompt, max_new_tokens=17).tokens
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    rows = drafter.draft_head.detach() if own_head else head[drafter.draft_vocab]
    with torch.no_grad():
        features = target_features(target(torch.tensor([prompt + spec.tokens]), output_hidden_states=True).hidden_states,
                                   drafter.target_layer_ids)
        assert len(calls) >= 3 and any(logits.shape[0] == BLOCK - 1 for _, _, logits in calls)
        for anchor, start, logits in calls:
            block = torch.full((1, BLOCK), drafter.mask_token_id)
            block[0, 0] = anchor
            for slot in range(1, logits.shape[0] + 1):
                out = drafter(features[:, :start], F.embedding(block, embed), torch.arange(start + BLOCK)[None],
                              causal_block_mask(start, BLOCK))
                expected = F.linear(out[0, slot], rows)
                torch.testing.assert_close(logits[slot - 1, drafter.draft_vocab], expected, rtol=1e-4, atol=1e-4)
                block[0, slot] = int(drafter.draft_vocab[expected.argmax()])
    with pytest.raises(ValueError, match="causally"):  # fewer passes would read slots drafted beside masks
        DFlashProposer(drafter, embed, head, denoise_passes=1)


@pytest.mark.parametrize("causal", [False, True], ids=["denoising", "causal"])
def test_draft_confidence_ends_the_drafts_where_the_drafter_expects_a_rejection(target, causal):
    # The drafts end before the first slot whose chain probability (the product of the top
    # probabilities of it and every slot before it) is below draft_confidence; no pass refines
    # the slots cut, and the drafts kept are those of full decoding.
    drafter = make_denoising_drafter(passes=BLOCK - 1, causal=causal)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = PROMPTS[2]
    with torch.no_grad():
        features = target_features(target(torch.tensor([prompt]), output_hidden_states=True).hidden_states,
                                   drafter.target_layer_ids)

    def propose(confidence: float) -> tuple[torch.Tensor, int]:
        proposer = DFlashProposer(drafter, embed, head, draft_confidence=confidence)
        return proposer.propose(features, prompt[-1], len(prompt), BLOCK - 1), proposer.passes_taken

    every, taken = propose(0.0)
    assert (every.shape[0], taken) == (BLOCK - 1, BLOCK - 1)
    chain = torch.softmax(every, dim=-1).amax(dim=-1).cumprod(0).tolist()
    assert chain[0] < 0.99 and chain[2] < chain[1] * 0.999 < chain[0]  # a random drafter is far from sure
    # Slots 1 and 2 together just likely enough, slot 3 not once the third pass has drafted it.
    two, taken = propose(chain[1] * 0.999)
    assert taken == 3
    torch.testing.assert_close(two, every[:2], rtol=0, atol=0)
    # Slot 1 alone below it: one pass, one draft (a step verifies one at least).
    one, taken = propose(chain[0] * 1.001)
    assert taken == 1
    torch.testing.assert_close(one, every[:1], rtol=0, atol=0)
    # Greedy output stays the target's.
    proposer = DFlashProposer(drafter, embed, head, draft_confidence=chain[1] * 0.999)
    spec = speculative_generate(target, proposer, prompt, max_new_tokens=17)
    assert spec.tokens == plain_generate(target, prompt, max_new_tokens=17).tokens
    assert max(spec.step_drafts) < BLOCK - 1
    with pytest.raises(ValueError, match="draft_confidence"):
        DFlashProposer(drafter, embed, head, draft_confidence=1.0)


def test_a_bf16_verification_rounds_each_row_as_a_plain_step_does():
    # Greedy equality rests on this: the target's logits for a position are bit for bit the same whether a
    # five-token verification or a one-token step computes them. The real SmolLM2, whose activations showed
    # both causes: a single row's GEMV at the 1536-wide down projection, and the fused attention.
    from common.model_loader import load_target

    loaded = load_target("smollm2", dtype=torch.bfloat16)
    model = loaded.model
    text = "The quick brown fox jumps over the lazy dog and then some more words follow."
    prompt = loaded.tokenizer(text)["input_ids"]
    block = [1234, 55, 66, 77, 88]
    with torch.inference_mode(), evaluation_decoding(model):
        assert model.config._attn_implementation == "eager"
        cache = _new_cache(model)
        _target_forward(model, prompt, 0, cache, hidden=False, last_only=True)
        verified = _target_forward(model, block, len(prompt), cache, hidden=False, last_only=False).logits[0]
        crop_cache(cache, len(prompt))
        for i, token in enumerate(block):
            step = _target_forward(model, [token], len(prompt) + i, cache, hidden=False, last_only=True).logits[0, -1]
            assert torch.equal(step, verified[i]), f"row {i}: {(step - verified[i]).abs().max()}"
    assert model.config._attn_implementation == "sdpa"  # the model's own again


def test_prompt_lookup_in_front_of_the_drafter_keeps_decoding_exact(target):
    # The lookup (here of a single token) drafts wherever the anchor occurred before, the drafter elsewhere;
    # the drafter's context must still get every position's features (it raises if not).
    from tools.prompt_lookup import PromptLookupProposer

    prompt = [5, 17, 99, 3, 42, 8, 5, 17, 99, 3, 42, 8, 5, 17]
    inner = dflash_proposer(target, make_drafter())
    proposer = PromptLookupProposer(inner, VOCAB, min_ngram=1)
    n = 24
    plain = plain_generate(target, prompt, max_new_tokens=n)
    spec = speculative_generate(target, proposer, prompt, max_new_tokens=n)
    assert spec.tokens == plain.tokens
    assert proposer.lookup_steps >= 1 and inner.passes_taken >= 1  # both drafted, in turn
    sampled = [speculative_generate(target, proposer, prompt, max_new_tokens=n, temperature=0.8,
                                    generator=torch.Generator().manual_seed(3)).tokens for _ in range(2)]
    assert sampled[0] == sampled[1]
