"""TRL's importable internals of the experimental trainers, at TRL's paths: Nash-MD's `GeometricMixtureWrapper`, PPO's
module-level `batch_generation`, `masked_mean`, `masked_var`, and GKD's static `generate_on_policy_outputs`."""

import inspect
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from trl.assets import get_model_path


PAD = 4089  # the tiny Qwen2's pad id


@pytest.fixture(scope="module")
def models():
    path = get_model_path("tiny-Qwen2ForCausalLM")
    policy = AutoModelForCausalLM.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return policy, reference


# ---------------------------------------------------------------------------------------------------------------------
# nash_md_trainer.GeometricMixtureWrapper
# ---------------------------------------------------------------------------------------------------------------------
def test_geometric_mixture_wrapper_forward_and_generate(models):
    from trl.experimental.nash_md.nash_md_trainer import GeometricMixtureWrapper

    policy, reference = models
    params = inspect.signature(GeometricMixtureWrapper).parameters
    assert list(params) == ["model", "ref_model", "generation_config", "mixture_coef", "device"]
    assert params["mixture_coef"].default == 0.5 and params["device"].default is None

    coef = 0.3
    wrapper = GeometricMixtureWrapper(policy, reference, GenerationConfig(), mixture_coef=coef)
    ids = torch.tensor([[PAD, 6, 7, 8], [9, 10, 11, 12]])
    mask = (ids != PAD).long()
    logits = wrapper(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        expected = torch.log_softmax(
            coef * reference(input_ids=ids, attention_mask=mask).logits
            + (1 - coef) * policy(input_ids=ids, attention_mask=mask).logits,
            dim=-1,
        )
    assert not logits.requires_grad
    assert torch.allclose(logits, expected, atol=1e-5)

    # Greedy decoding of the mixture, recomputed from scratch at each step, against generate with and without cache.
    tokens, attention = ids.clone(), mask.clone()
    for _ in range(5):
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            step = [
                m(input_ids=tokens, attention_mask=attention, position_ids=positions).logits[:, -1] for m in models
            ]
        next_token = torch.log_softmax(coef * step[1] + (1 - coef) * step[0], dim=-1).argmax(-1, keepdim=True)
        tokens, attention = torch.cat([tokens, next_token], 1), torch.cat([attention, torch.ones_like(next_token)], 1)
    for use_cache in (False, True):
        config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=PAD, use_cache=use_cache)
        generated = wrapper.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert generated.tolist() == tokens.tolist(), use_cache


# ---------------------------------------------------------------------------------------------------------------------
# ppo_trainer.batch_generation, masked_mean, masked_var
# ---------------------------------------------------------------------------------------------------------------------
def test_batch_generation_pads_chunks_to_the_longest(models):
    from trl.experimental.ppo.ppo_trainer import batch_generation

    policy, _ = models
    pad = 99
    queries = torch.tensor([[pad, pad, 5, 6, 7], [pad, 8, 9, 10, 11], [1, 2, 3, 4, 5]])
    plain = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=pad)
    full = policy.generate(input_ids=queries, attention_mask=(queries != pad).long(), generation_config=plain)
    stop = full[0, 6].item()  # the first query's second response token ends it early
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=pad, eos_token_id=stop)
    query_responses, logits = batch_generation(policy, queries, 1, pad, config)
    assert query_responses.shape == (3, 9) and logits.shape == (3, 4, policy.config.vocab_size)
    assert query_responses[0, 5:].tolist() == [full[0, 5].item(), stop, pad, pad]
    assert query_responses[1:].tolist() == full[1:].tolist()
    assert (logits[0, 2:] == 0).all()
    with torch.no_grad():
        expected = policy(input_ids=query_responses[2:], attention_mask=torch.ones(1, 9, dtype=torch.long)).logits
    assert torch.allclose(logits[2], expected[0, 4:8], atol=1e-4)

    # Sampling: the scores are the processed ones (temperature applied), the same draws as one `generate` call.
    sampled = GenerationConfig(max_new_tokens=3, do_sample=True, temperature=0.5, top_k=0, pad_token_id=pad)
    torch.manual_seed(3)
    query_responses, logits = batch_generation(policy, queries, 3, pad, sampled)
    torch.manual_seed(3)
    out = policy.generate(
        input_ids=queries,
        attention_mask=(queries != pad).long(),
        generation_config=sampled,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert query_responses.tolist() == out.sequences.tolist()
    assert torch.allclose(logits, torch.stack(out.scores, 1))


def test_masked_mean_and_var_as_in_trl():
    from trl.experimental.ppo.ppo_trainer import masked_mean, masked_var

    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(7 / 3)
    assert masked_mean(values, mask.bool(), axis=1).tolist() == pytest.approx([1.5, 4.0])
    by_column = masked_mean(values, mask, axis=0)
    assert by_column[:2].tolist() == pytest.approx([2.5, 2.0]) and math.isnan(by_column[2].item())
    biased = ((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 3
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(biased)
    assert masked_var(values, mask).item() == pytest.approx(biased * 3 / 2)
    weights = torch.tensor([[0.5, 1.0, 0.0], [1.0, 0.0, 0.0]])  # fractional weights count fractionally
    assert masked_mean(values, weights).item() == pytest.approx(2.6)
    assert masked_var(values, weights).item() == pytest.approx(1.44 * 2.5 / 1.5)
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    assert math.isnan(masked_var(values, one).item()) and masked_var(values, one, unbiased=False).item() == 0.0
    assert math.isnan(masked_var(values, torch.zeros(2, 3), unbiased=False).item())
    with pytest.raises(ValueError, match="The sum of the mask is zero"):
        masked_var(values, torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------------------------------
# GKDTrainer.generate_on_policy_outputs
# ---------------------------------------------------------------------------------------------------------------------
def test_gkd_generate_on_policy_outputs_is_static_and_masks_after_eos(models):
    from trl.experimental.gkd import GKDTrainer

    policy, _ = models
    assert isinstance(inspect.getattr_static(GKDTrainer, "generate_on_policy_outputs"), staticmethod)
    params = inspect.signature(GKDTrainer.generate_on_policy_outputs).parameters
    assert list(params)[:3] == ["model", "inputs", "generation_config"] and params["pad_token_id"].default is None

    prompts = torch.tensor([[PAD, PAD, 5, 6, 7], [PAD, 8, 9, 10, 11]])
    inputs = {"prompts": prompts, "prompt_attention_mask": (prompts != PAD).long()}
    plain = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    free = policy.generate(input_ids=prompts, attention_mask=inputs["prompt_attention_mask"], generation_config=plain)
    eos = free[0, 6].item()  # ends the first completion after two tokens
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=77, eos_token_id=eos)
    for args in ((), (PAD,)):  # TRL 1.16's three arguments, or older releases' four
        ids, attention_mask, labels = GKDTrainer.generate_on_policy_outputs(policy, inputs, config, *args)
        assert ids[0, 5:].tolist() == [free[0, 5].item(), eos, 77, 77]
        assert attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]
        assert labels[0].tolist() == [-100] * 5 + [free[0, 5].item(), eos, -100, -100]
        completion = ids[1, 5:]
        assert labels[1, :5].tolist() == [-100] * 5
        first_end = (completion == eos).nonzero()
        kept = 4 if len(first_end) == 0 else first_end[0].item() + 1
        assert (labels[1, 5 : 5 + kept] == completion[:kept]).all() and (labels[1, 5 + kept :] == -100).all()
        assert attention_mask[1, 5:].sum().item() == kept
