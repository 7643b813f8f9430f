"""The lean decode step (`trl/trainer/fast_paths/lean_decode.py`) against the transformers forward: bitwise equal logits
for every supported family, the same rollouts as `generate`, and the fallback for everything it does not reproduce."""

import functools

import pytest
import torch
from trainer_utils import DECODER_PAD, DECODER_SIZES, DECODER_VOCAB, LLAMA_STYLE_FAMILIES, llama_style_decoder
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2ForCausalLM,
)

from trl._compat import cache_kwargs
from trl.assets import get_model_path
from trl.trainer.fast_paths import lean_decode, rollout_decode
from trl.trainer.fast_paths.lean_decode import LeanDecoder, lean_decode_fallback_reason
from trl.trainer.fast_paths.lean_modules import lean_modules
from trl.trainer.fast_paths.rollout_decode import decode_rollouts
from trl.trainer.online_generation import generate_with_shared_prompts
from trl.trainer.utils.packing import packed_sdpa_attention


pytestmark = pytest.mark.usefixtures("single_thread")

PAD, VOCAB = DECODER_PAD, DECODER_VOCAB
_SIZES = DECODER_SIZES
FAMILIES = {family: functools.partial(llama_style_decoder, family) for family in LLAMA_STYLE_FAMILIES}


def _build(family: str, attn_implementation: str = "sdpa", dtype=torch.float32):
    torch.manual_seed(0)
    model = FAMILIES[family]().to(dtype).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def _prompts(num_rows: int = 4, length: int = 7, padded: bool = True):
    """Left-padded prompts of unequal lengths (or none padded)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (num_rows, length), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        for row, padding in ((1, 2), (3, 4))[: num_rows // 2]:
            ids[row, :padding], mask[row, :padding] = PAD, 0
    return ids, mask


def _assert_steps_equal(model, padded: bool, steps: int = 5):
    """Prefill, then `steps` one-token steps through the model and through the lean step on twin caches."""
    ids, mask = _prompts(padded=padded)
    num_rows, length = ids.shape
    capacity = length + steps
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    full_mask = torch.ones((num_rows, capacity), dtype=mask.dtype)
    full_mask[:, :length] = mask
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for cache in caches:
            model(
                input_ids=ids,
                attention_mask=mask if padded else None,
                position_ids=positions,
                **cache_kwargs(model, cache),
            )
            rollout_decode._preallocate(cache, capacity)
        lean = LeanDecoder(model, full_mask if padded else None, num_rows, capacity)
        step_positions = positions[:, -1:]
        for _ in range(steps):
            tokens = torch.randint(5, VOCAB, (num_rows, 1), generator=generator)
            step_positions = step_positions + 1
            length += 1
            expected = model(
                input_ids=tokens,
                attention_mask=full_mask[:, :length] if padded else None,
                position_ids=step_positions,
                **cache_kwargs(model, caches[0]),
                logits_to_keep=1,
            ).logits
            assert torch.equal(lean(tokens, step_positions, caches[1], length), expected)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lean_step_logits_equal_the_forward(family, attn_implementation, padded):
    model = _build(family, attn_implementation)
    assert lean_decode_fallback_reason(model) is None
    _assert_steps_equal(model, padded)


def test_lean_step_in_bfloat16():
    model = _build("qwen2", dtype=torch.bfloat16)
    assert lean_decode_fallback_reason(model) is None
    _assert_steps_equal(model, padded=True)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_lean_step_under_the_training_kernels(family):
    """Generation inside a training step runs with the lean MLPs / RMSNorms and packed SDPA switched on: the lean step
    calls what is switched in, so it still equals the forward."""
    model = _build(family).train()  # attention_dropout is 0: train mode changes nothing
    with lean_modules(model) as switched, packed_sdpa_attention(model):
        assert switched > 0 and model.config._attn_implementation != "sdpa"
        assert lean_decode_fallback_reason(model) is None
        _assert_steps_equal(model, padded=True)


def _count_lean_steps(monkeypatch):
    calls = []
    original = LeanDecoder.__call__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LeanDecoder, "__call__", counting)
    return calls


SETTINGS = {
    "greedy": dict(do_sample=False, repetition_penalty=1.3),
    "sample": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.2),
}


@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rollouts_equal_generate(family, settings, monkeypatch):
    """`decode_rollouts` through the lean step yields `generate`'s sequences and leaves the random stream alike;
    some rows end on an end token mid-rollout."""
    model = _build(family)
    calls = _count_lean_steps(monkeypatch)
    ids, mask = _prompts(num_rows=2)
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    base = dict(max_new_tokens=12, pad_token_id=PAD, **SETTINGS[settings])
    torch.manual_seed(0)
    probe = generate_with_shared_prompts(model, ids, mask, rows, GenerationConfig(**base))[:, ids.shape[1] :]
    eos = sorted({int(probe[0, 3]), int(probe[4, 6])})  # rows end at different steps
    config = GenerationConfig(**base, eos_token_id=eos)
    ended = False
    for seed in range(3):
        torch.manual_seed(seed)
        expected = generate_with_shared_prompts(model, ids, mask, rows, config)
        after_expected = torch.rand(3)
        torch.manual_seed(seed)
        output = decode_rollouts(model, ids, mask, rows, config)
        assert torch.equal(output.sequences, expected)
        assert torch.equal(torch.rand(3), after_expected)
        ended |= bool(torch.isin(output.sequences[:, ids.shape[1] :], torch.tensor(eos)).any())
    assert ended
    assert len(calls) > 0


def test_rollouts_with_the_assets_model(monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-LlamaForCausalLM")).eval()
    calls = _count_lean_steps(monkeypatch)
    _assert_sampled_rollouts_equal_generate(model, max_new_tokens=8)
    assert len(calls) == 8  # after the shared prefill, every step feeds one token per row


def test_first_step_runs_the_whole_prompts_through_the_model_without_a_shared_prefill(monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-LlamaForCausalLM")).eval()
    calls = _count_lean_steps(monkeypatch)
    ids, mask = _prompts(num_rows=2)
    rows = torch.tensor([0, 0, 1, 1])
    config = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=PAD)
    torch.manual_seed(0)
    expected = model.generate(input_ids=ids[rows], attention_mask=mask[rows], generation_config=config)
    torch.manual_seed(0)
    output = decode_rollouts(model, ids, mask, rows, config, share_prompt_cache=False)
    assert torch.equal(output.sequences, expected)
    assert len(calls) == 7  # every step after the first


def _assert_sampled_rollouts_equal_generate(model, max_new_tokens):
    ids, mask = _prompts(num_rows=2)
    rows = torch.tensor([0, 0, 1, 1])
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, top_k=0, pad_token_id=PAD)
    torch.manual_seed(0)
    expected = generate_with_shared_prompts(model, ids, mask, rows, config)
    torch.manual_seed(0)
    assert torch.equal(decode_rollouts(model, ids, mask, rows, config).sequences, expected)


class _Qwen2Subclass(Qwen2ForCausalLM):
    pass


def _peft(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))


def _with_hook(model, kind):
    target = model.model.layers[1].self_attn  # the lean step computes attention from the weights, not this module
    if kind == "forward":
        target.register_forward_hook(lambda module, args, output: None)
    else:
        target.register_forward_pre_hook(lambda module, args: None)
    return model


def _sliding_mistral(model):
    return MistralForCausalLM(MistralConfig(**_SIZES, sliding_window=4)).eval()


def _train_with_dropout(model):
    model.train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    return model


def _unsupported_attention(model):
    model.config._attn_implementation = "flex_attention"
    return model


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda model: _Qwen2Subclass(model.config), "not one of"),
        (_peft, "not one of"),
        (lambda model: _peft(model).base_model.model, "not plain nn.Linear"),
        (lambda model: _with_hook(model, "forward"), "hooks on Qwen2Attention"),
        (lambda model: _with_hook(model, "pre"), "hooks on Qwen2Attention"),
        (_sliding_mistral, "sliding-window"),
        (_train_with_dropout, "dropout"),
        (_unsupported_attention, "attention implementation"),
    ],
    ids=["subclass", "peft_model", "lora_layers", "forward_hook", "pre_hook", "sliding_window", "dropout", "flex"],
)
def test_fallback_reasons(change, reason):
    model = change(_build("qwen2"))
    found = lean_decode_fallback_reason(model)
    assert found is not None and reason in found, found


def test_fallback_for_global_hooks_autocast_and_sharding(monkeypatch):
    model = _build("qwen2")
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        assert "global module hooks" in lean_decode_fallback_reason(model)
    finally:
        handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in lean_decode_fallback_reason(model)
    monkeypatch.setattr(lean_decode, "parameters_sharded", lambda model: True)
    assert "sharded" in lean_decode_fallback_reason(model)


def test_fallback_still_generates(monkeypatch):
    """A model the lean step refuses (a hook that changes an attention projection's output, a module the step does
    not call) decodes through the forward, hook included: still `generate`'s tokens."""
    model = _build("llama")
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda module, args, output: output * 2)
    calls = _count_lean_steps(monkeypatch)
    _assert_sampled_rollouts_equal_generate(model, max_new_tokens=6)
    assert calls == []


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hooks_on_modules_the_step_calls_run(family, monkeypatch):
    """Hooks on the modules the lean step calls whole (embeddings, norms, MLPs and what is inside them, Qwen3's
    query/key norms) run in every step, as in the forward: `generate`'s tokens, and as many hook calls."""
    counts = {}

    def hooks(model):
        targets = {
            "embed": model.model.embed_tokens,  # what gradient checkpointing registers (input embeddings)
            "norm": model.model.layers[1].input_layernorm,
            "mlp": model.model.layers[0].mlp,
            "gate": model.model.layers[1].mlp.gate_proj,
        }
        if family == "qwen3":
            targets["q_norm"] = model.model.layers[0].self_attn.q_norm
        for name, module in targets.items():
            counts[name] = 0

            def hook(module, args, output, name=name):
                counts[name] += 1
                return output * 1.5 if name in ("mlp", "gate") else None

            module.register_forward_hook(hook)
        return model

    model = hooks(_build(family))
    assert lean_decode_fallback_reason(model) is None
    calls = _count_lean_steps(monkeypatch)
    _assert_sampled_rollouts_equal_generate(model, max_new_tokens=6)
    assert len(calls) > 0
    per_call = dict(counts)
    assert len(set(per_call.values())) == 1  # every hooked module ran once per forward or lean step


def test_grpo_rollouts_take_the_lean_step(tmp_path, model_path, prompts, monkeypatch):
    """Inside GRPO's training step (training kernels switched in, model in train mode) the rollouts decode through
    the lean step (that they equal `generate`'s there is `test_rollout_decode.py`'s GRPO test)."""
    from trainer_utils import GROUP_ARGS, args_builder, low_id_reward

    from trl import GRPOConfig, GRPOTrainer

    calls = _count_lean_steps(monkeypatch)
    # Gradient checkpointing (GRPO's default) puts a hook on the input embeddings: the lean step runs it.
    args = args_builder(GRPOConfig, **GROUP_ARGS)(tmp_path, max_steps=1, gradient_checkpointing=True)
    GRPOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts).train()
    assert len(calls) > 0


def _record_model_calls(model, change: str | None):
    """Hooks on the model itself, as a token counter or a logits filter would register them: they record the inputs
    of every call and, with `change`, alter the inputs (`"inputs"`) or the logits (`"logits"`)."""
    seen = []

    def pre_hook(module, args, kwargs):
        seen.append({name: value.clone() for name, value in kwargs.items() if torch.is_tensor(value)})
        if change == "inputs":  # shift the positions: a different (still valid) decode
            return args, {**kwargs, "position_ids": kwargs["position_ids"] + 1}
        return None

    def forward_hook(module, args, output):
        if change == "logits":
            output.logits[..., 7] += 5.0
        return output

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(forward_hook)
    return seen


@pytest.mark.parametrize("change", [None, "inputs", "logits"])
def test_model_hooks_run_around_the_lean_step(change, monkeypatch):
    """Hooks on the model itself see every decode step's call, with the inputs the forward would get, and what they
    change takes effect: the rollouts, the recorded inputs and the random stream equal the forward-only loop's."""
    ids, mask = _prompts(num_rows=2)
    rows = torch.tensor([0, 0, 1, 1])
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=PAD)
    results = []
    for lean in (True, False):
        model = _build("qwen2")
        seen = _record_model_calls(model, change)
        assert lean_decode_fallback_reason(model) is None
        calls = _count_lean_steps(monkeypatch)
        if not lean:
            monkeypatch.setattr(rollout_decode, "lean_decode_fallback_reason", lambda model: "off")
        torch.manual_seed(0)
        sequences = decode_rollouts(model, ids, mask, rows, config).sequences
        results.append((sequences, seen, torch.rand(2), len(calls)))
        monkeypatch.undo()
    (lean_out, lean_seen, lean_rand, lean_calls), (out, seen, rand, calls) = results
    assert lean_calls == 6 and calls == 0
    assert torch.equal(lean_out, out) and torch.equal(lean_rand, rand)
    assert len(lean_seen) == len(seen) == 7  # the shared prompts' prefill, then one call per new token
    for lean_kwargs, kwargs in zip(lean_seen, seen):
        assert lean_kwargs.keys() == kwargs.keys()
        assert all(torch.equal(lean_kwargs[name], kwargs[name]) for name in kwargs)
