"""The rollout decode loop (`trl/trainer/fast_paths/rollout_decode.py`) against transformers `generate`: same tokens, same
random stream, and `generate` whenever the loop cannot reproduce it."""

import pytest
import torch
from trainer_utils import (
    DECODER_PAD,
    DECODER_VOCAB,
    GROUP_ARGS,
    LLAMA_STYLE_FAMILIES,
    args_builder,
    llama_style_decoder,
    low_id_reward,
    train_logs,
)
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, GenerationConfig

from trl import GRPOConfig, GRPOTrainer
from trl._compat import cache_kwargs
from trl.assets import get_model_path
from trl.trainer.fast_paths import rollout_decode
from trl.trainer.fast_paths.rollout_decode import decode_rollouts, rollout_decode_fallback_reason
from trl.trainer.online_generation import generate_with_shared_prompts


pytestmark = pytest.mark.usefixtures("single_thread")

PAD = 0


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM")).eval()


@pytest.fixture(scope="module")
def batch(model):
    """Three distinct prompts, left-padded to unequal lengths, each repeated three times."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size - 10, (3, 9), generator=generator)
    mask = torch.ones_like(ids)
    for row, padding in ((1, 3), (2, 5)):
        ids[row, :padding], mask[row, :padding] = PAD, 0
    return ids, mask, torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])


def _generate_both(model, batch, config, seed, share=True):
    """`generate` (through `generate_with_shared_prompts`) and the loop from the same seed; also one draw from the
    random stream after each, which equal only if both consumed it alike."""
    ids, mask, rows = batch
    torch.manual_seed(seed)
    reference = generate_with_shared_prompts(model, ids, mask, rows, config, share_prompt_cache=share)
    after_reference = torch.rand(3)
    torch.manual_seed(seed)
    output = decode_rollouts(model, ids, mask, rows, config, share_prompt_cache=share, return_logps=True)
    return reference, output, after_reference, torch.rand(3)


SETTINGS = {
    "greedy": dict(do_sample=False),
    "greedy_repetition_penalty": dict(do_sample=False, repetition_penalty=1.5),
    "sample": dict(do_sample=True, top_k=0),
    "temperature": dict(do_sample=True, temperature=0.6, top_k=0),
    "top_k": dict(do_sample=True, top_k=7),
    "top_p": dict(do_sample=True, top_k=0, top_p=0.8),
    "min_p": dict(do_sample=True, top_k=0, min_p=0.2, temperature=1.4),
    "repetition_penalty": dict(do_sample=True, top_k=0, repetition_penalty=1.3),
    "all": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    "model_default_top_k": dict(do_sample=True),  # top_k left unset: generate's default (50) applies
}


@pytest.mark.parametrize("share", [True, False], ids=["shared_prefill", "plain_prefill"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_same_tokens_and_random_stream_as_generate(model, batch, name, share):
    config = GenerationConfig(max_new_tokens=10, pad_token_id=PAD, eos_token_id=[5], **SETTINGS[name])
    assert rollout_decode_fallback_reason(model, config, {"disable_compile": True}) is None
    for seed in range(3):
        reference, output, after_reference, after_loop = _generate_both(model, batch, config, seed, share)
        assert torch.equal(output.sequences, reference)
        assert torch.equal(after_loop, after_reference)


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sample"])
def test_end_of_sequence_mid_rollout(model, batch, do_sample):
    """Rows that emit an end token stop (padded after it, still drawn for, as in `generate`); the rollout ends early
    when every row has ended."""
    ids, mask, rows = batch
    settings = dict(max_new_tokens=12, do_sample=do_sample, top_k=0, pad_token_id=PAD, temperature=0.5)
    torch.manual_seed(0)
    probe = generate_with_shared_prompts(model, ids, mask, rows, GenerationConfig(**settings, eos_token_id=None))
    # End tokens: what two rows emit early on with seed 0, so that rows end at different steps.
    probe = probe[:, ids.shape[1] :]
    eos = sorted({int(probe[0, 2]), int(probe[4, 5])})
    config = GenerationConfig(**settings, eos_token_id=eos)
    ended_early = False
    for seed in range(4):
        reference, output, after_reference, after_loop = _generate_both(model, batch, config, seed)
        assert torch.equal(output.sequences, reference) and torch.equal(after_loop, after_reference)
        completions = output.sequences[:, ids.shape[1] :]
        ended = torch.isin(completions, torch.tensor(eos))
        ended_early |= bool(ended.any())
        for row, logps in zip(completions, output.logps):
            hits = torch.isin(row, torch.tensor(eos)).nonzero()
            if len(hits):
                end = int(hits[0]) + 1
                assert (row[end:] == PAD).all() and (logps[end:] == 0).all()
    assert ended_early


def test_logps_are_the_sampling_distribution(model, batch):
    """Returned log-probs: the sampled tokens under the tempered distribution, recomputed here with one full forward."""
    ids, mask, rows = batch
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=0, temperature=0.7, pad_token_id=PAD)
    torch.manual_seed(0)
    output = decode_rollouts(model, ids, mask, rows, config, return_logps=True)
    sequences = output.sequences
    full_mask = torch.cat([mask[rows], torch.ones(len(rows), 6, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=full_mask, position_ids=positions).logits
    expected = torch.log_softmax(logits[:, ids.shape[1] - 1 : -1] / 0.7, dim=-1)
    expected = expected.gather(2, sequences[:, ids.shape[1] :, None]).squeeze(2)
    torch.testing.assert_close(output.logps, expected, atol=1e-4, rtol=1e-4)


def test_preallocated_cache_gives_the_dynamic_cache_logits(model, batch):
    """The preallocated layers hand attention the same keys and values as `DynamicCache`: bitwise equal logits."""
    from transformers import DynamicCache

    ids, mask, rows = batch
    ids, mask = ids[rows], mask[rows]
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = []
    for preallocate in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, cache))
            if preallocate:
                rollout_decode._preallocate(cache, ids.shape[1] + 4)
            step_mask = mask
            for step in range(3):
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], dim=1)
                token = torch.full((len(ids), 1), 11 + step)
                out = model(
                    input_ids=token,
                    attention_mask=step_mask,
                    position_ids=positions[:, -1:] + 1 + step,
                    **cache_kwargs(model, cache),
                )
                logits.append(out.logits)
    for plain, preallocated in zip(logits[:3], logits[3:]):
        assert torch.equal(plain, preallocated)


@pytest.mark.parametrize(
    "settings, kwargs, reason",
    [
        (dict(num_beams=2), {}, "num_beams"),
        (dict(no_repeat_ngram_size=2), {}, "no_repeat_ngram_size"),
        (dict(suppress_tokens=[3]), {}, "suppress_tokens"),
        (dict(stop_strings=["x"]), {}, "stop_strings"),
        (dict(num_return_sequences=2, do_sample=True), {}, "num_return_sequences"),
        (dict(cache_implementation="static"), {}, "static"),
        (dict(max_new_tokens=None, max_length=30), {}, "max_new_tokens"),
        (dict(use_cache=False), {}, "use_cache"),
        (dict(), {"logits_processor": []}, "logits_processor"),
        (dict(), {"streamer": None}, "streamer"),
    ],
)
def test_fallback_reasons(model, settings, kwargs, reason):
    config = GenerationConfig(**{"max_new_tokens": 4, "pad_token_id": PAD, "do_sample": False, **settings})
    found = rollout_decode_fallback_reason(model, config, kwargs)
    assert found is not None and reason in found


def test_fallback_for_model_generation_defaults_and_models(model):
    """A setting coming from the model's own generation config counts as well; encoder-decoders use `generate`."""
    config = GenerationConfig(max_new_tokens=4, pad_token_id=PAD, do_sample=True)
    original = model.generation_config.no_repeat_ngram_size  # None from transformers 5, 0 before
    model.generation_config.no_repeat_ngram_size = 3
    try:
        assert "no_repeat_ngram_size" in rollout_decode_fallback_reason(model, config)
    finally:
        model.generation_config.no_repeat_ngram_size = original
    assert rollout_decode_fallback_reason(model, config) is None
    t5 = AutoModelForSeq2SeqLM.from_pretrained(get_model_path("tiny-T5ForConditionalGeneration"))
    assert rollout_decode_fallback_reason(t5, config) is not None


def test_saved_output_flags_set_off_keep_the_loop(model, batch):
    """`save_pretrained` writes `output_attentions: false` (and the like) into `generation_config.json`: off, as when
    unset, so the loop still runs, and its tokens are `generate`'s; set on, they make the caller use `generate`."""
    ids, mask, rows = batch
    config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    flags = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")
    originals = {flag: getattr(model.generation_config, flag) for flag in flags}
    try:
        for flag in flags:
            setattr(model.generation_config, flag, False)
        assert rollout_decode_fallback_reason(model, config, {"disable_compile": True}) is None
        expected = generate_with_shared_prompts(model, ids, mask, rows, config)
        assert torch.equal(generate_with_shared_prompts(model, ids, mask, rows, config, rollout_decode=True), expected)
        model.generation_config.output_scores = True
        assert "output_scores" in rollout_decode_fallback_reason(model, config)
    finally:
        for flag, value in originals.items():
            setattr(model.generation_config, flag, value)


def test_unsupported_settings_still_generate(model, batch):
    """With a fallback reason, `generate_with_shared_prompts(rollout_decode=True)` is plain `generate`."""
    ids, mask, rows = batch
    config = GenerationConfig(max_new_tokens=5, do_sample=False, no_repeat_ngram_size=2, pad_token_id=PAD)
    expected = generate_with_shared_prompts(model, ids, mask, rows, config)
    assert torch.equal(generate_with_shared_prompts(model, ids, mask, rows, config, rollout_decode=True), expected)


make_args = args_builder(GRPOConfig, **GROUP_ARGS)


def test_grpo_trains_with_the_loop_as_with_generate(tmp_path, model_path, prompts, monkeypatch):
    """GRPO with the rollout loop logs the same completions and losses as with `generate`, step for step."""
    calls = []
    original = rollout_decode.decode_rollouts

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr("trl.trainer.online_generation.decode_rollouts", counting)
    results = []
    for use_loop in (True, False):
        seen = []

        def recording_reward(completion_ids, seen=seen, **kwargs):
            seen.extend(completion_ids)
            return low_id_reward(completion_ids)

        args = make_args(tmp_path / str(use_loop), temperature=0.9, top_p=0.95)
        trainer = GRPOTrainer(model_path, reward_funcs=recording_reward, args=args, train_dataset=prompts)
        trainer._use_rollout_decode = use_loop
        trainer.train()
        losses = [log["loss"] for log in train_logs(trainer) if "loss" in log]
        results.append((seen, losses))
    assert len(calls) == GROUP_ARGS["max_steps"]
    assert results[0] == results[1]


@pytest.mark.parametrize("shape", [(8, 4096), (3, 37), (1, 5)])
def test_sample_next_tokens_is_multinomial(shape):
    """The CPU draw picks `torch.multinomial`'s tokens from the same seed, over peaked, flat and partly masked
    distributions, and leaves the random stream where `torch.multinomial` leaves it."""
    assert rollout_decode._cpu_draw_matches_multinomial()  # the fast draw runs on this build, not the fallback
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(shape, generator=generator) * (0.1 + trial)
        if trial % 3 == 0:
            logits[:, shape[1] // 2 :] = -float("inf")
        probs = torch.softmax(logits, dim=-1)
        torch.manual_seed(trial)
        expected = torch.multinomial(probs, num_samples=1).squeeze(1)
        after_expected = torch.rand(3)
        torch.manual_seed(trial)
        drawn = rollout_decode.sample_next_tokens(probs)
        assert torch.equal(drawn, expected)
        assert torch.equal(torch.rand(3), after_expected)


@pytest.mark.parametrize("bad", [float("nan"), -0.5, float("inf")])
def test_sample_next_tokens_rejects_what_multinomial_rejects(bad):
    probs = torch.full((2, 6), 1 / 6)
    probs[1, 2] = bad
    with pytest.raises(RuntimeError) as expected:
        torch.multinomial(probs, num_samples=1)
    with pytest.raises(RuntimeError) as raised:
        rollout_decode.sample_next_tokens(probs)
    assert str(raised.value) == str(expected.value)


def test_sample_next_tokens_other_dtypes_go_to_multinomial():
    probs = torch.softmax(torch.randn(4, 50, dtype=torch.float64), dim=-1)
    torch.manual_seed(3)
    expected = torch.multinomial(probs, num_samples=1).squeeze(1)
    torch.manual_seed(3)
    assert torch.equal(rollout_decode.sample_next_tokens(probs), expected)


@pytest.mark.parametrize("settings", ["greedy_repetition_penalty", "all"])
@pytest.mark.parametrize("family", LLAMA_STYLE_FAMILIES)
def test_rollouts_of_each_family_equal_generate(family, settings):
    """The loop yields `generate`'s sequences for every Llama-style family and leaves the random stream alike; some
    rows end on an end token mid-rollout."""
    torch.manual_seed(0)
    model = llama_style_decoder(family).eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, DECODER_VOCAB, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = DECODER_PAD, 0
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    base = dict(max_new_tokens=12, pad_token_id=DECODER_PAD, **SETTINGS[settings])
    torch.manual_seed(0)
    probe = generate_with_shared_prompts(model, ids, mask, rows, GenerationConfig(**base))[:, ids.shape[1] :]
    eos = sorted({int(probe[0, 3]), int(probe[4, 6])})  # rows end at different steps
    config = GenerationConfig(**base, eos_token_id=eos)
    ended = False
    for seed in range(3):
        reference, output, after_reference, after_output = _generate_both(model, (ids, mask, rows), config, seed)
        assert torch.equal(output.sequences, reference)
        assert torch.equal(after_output, after_reference)
        ended |= bool(torch.isin(output.sequences[:, ids.shape[1] :], torch.tensor(eos)).any())
    assert ended


@pytest.mark.parametrize("name", ["greedy_repetition_penalty", "all"])
def test_lora_model_decodes_through_its_transformers_model(batch, name):
    """A LoRA model's rollouts run the loop on the transformers model that carries the adapters, with the tokens and
    random stream of `PeftModel.generate`; prompt tuning (virtual tokens added by the wrapper) keeps `generate`."""
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    # Random adapter weights (not the zero-initialised B), so that the adapters change the tokens.
    lora = LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=False)
    model = get_peft_model(base, lora).eval()
    assert rollout_decode.decoding_model(model) is model.get_base_model()
    ids, mask, rows = batch
    config = GenerationConfig(max_new_tokens=10, pad_token_id=PAD, eos_token_id=[5], **SETTINGS[name])
    assert rollout_decode_fallback_reason(model.get_base_model(), config) is None
    for seed in range(2):
        torch.manual_seed(seed)
        reference = generate_with_shared_prompts(model, ids, mask, rows, config)
        after_reference = torch.rand(3)
        torch.manual_seed(seed)
        output = generate_with_shared_prompts(model, ids, mask, rows, config, rollout_decode=True)
        assert torch.equal(output, reference)
        assert torch.equal(torch.rand(3), after_reference)
    with model.disable_adapter():  # the adapters do change the rollouts
        torch.manual_seed(0)
        plain = generate_with_shared_prompts(model, ids, mask, rows, config)
    torch.manual_seed(0)
    assert not torch.equal(plain, generate_with_shared_prompts(model, ids, mask, rows, config))

    tuned = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    prompt_tuning = get_peft_model(tuned, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert rollout_decode.decoding_model(prompt_tuning) is prompt_tuning
    assert rollout_decode_fallback_reason(prompt_tuning, config) == "not a transformers generative model"
