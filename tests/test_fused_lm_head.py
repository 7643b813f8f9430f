"""The fused, chunked LM head + log-softmax: equal to the unfused path (values and gradients) for the kernel itself,
for `compute_token_logps`, and for one SGD step of every trainer that uses it (with padding, padding-free, PEFT and
gradient accumulation)."""

import math

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from trainer_utils import SGD_STEP_ARGS, sgd_step_update
from transformers import AutoModelForCausalLM

from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.kernels import linear_selective_log_softmax, selective_log_softmax_and_entropy
from trl.trainer import sft_trainer
from trl.trainer.utils import compute_token_logps, fusable_lm_head, logits_statistics
from trl.trainer.utils import logprobs as logprobs_module


TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("max_rows", [4, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_head_then_log_softmax(temperature, with_bias, max_rows):
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True) if with_bias else None
    index = torch.randint(0, 50, (3, 5))
    upstream_logps, upstream_entropy = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    inputs = [hidden, weight] + ([bias] if with_bias else [])

    # max_rows=4: several chunks, the last one partial (the logits recomputed in the backward); None: one chunk (the
    # forward's log-probabilities kept for the backward, read twice here)
    logps, entropy, stats = linear_selective_log_softmax(
        hidden,
        weight,
        index,
        bias,
        temperature,
        compute_entropy=True,
        logits_stats_fn=logits_statistics,
        max_rows=max_rows,
    )
    objective = (logps * upstream_logps).sum() + (entropy * upstream_entropy).sum()
    first = torch.autograd.grad(objective, inputs, retain_graph=True)
    grads = torch.autograd.grad(objective, inputs)
    for once, twice in zip(first, grads, strict=True):
        assert torch.equal(once, twice)

    logits = F.linear(hidden, weight, bias)
    expected_logps = torch.log_softmax(logits / temperature, dim=-1).gather(-1, index[..., None]).squeeze(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    expected_entropy = -(probs * probs.log()).sum(-1)
    expected_grads = torch.autograd.grad(
        (expected_logps * upstream_logps).sum() + (expected_entropy * upstream_entropy).sum(), inputs
    )
    torch.testing.assert_close(logps, expected_logps, **TOLERANCE)
    torch.testing.assert_close(entropy, expected_entropy, **TOLERANCE)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, **TOLERANCE)
    expected_stats = logits_statistics(logits.detach(), index)
    assert sorted(stats) == sorted(expected_stats)
    for name, value in stats.items():
        torch.testing.assert_close(value, expected_stats[name])


def test_kernel_entropy_with_a_masked_vocabulary_entry():
    """A logit at -inf (a masked vocabulary entry) contributes 0 to the entropy, not NaN (0 * -inf)."""
    torch.manual_seed(2)
    hidden = torch.randn(4, 8)
    weight = torch.randn(30, 8)
    bias = torch.zeros(30)
    bias[3] = float("-inf")
    index = torch.randint(4, 30, (4,))
    logps, entropy, _ = linear_selective_log_softmax(hidden, weight, index, bias, compute_entropy=True)
    probs = torch.softmax(F.linear(hidden, weight, bias), dim=-1)
    expected = -(probs[:, torch.arange(30) != 3] * probs[:, torch.arange(30) != 3].log()).sum(-1)
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy, expected, **TOLERANCE)


def test_kernel_log_probs_only_and_frozen_head():
    """Only the log-probs flow back, and the head needs no gradient (PEFT): the hidden states' gradient is exact."""
    torch.manual_seed(1)
    hidden = torch.randn(7, 8, requires_grad=True)
    weight = torch.randn(30, 8)
    index = torch.randint(0, 30, (7,))
    logps, entropy, stats = linear_selective_log_softmax(hidden, weight, index, max_rows=3)
    assert entropy is None and stats == {}
    (grad,) = torch.autograd.grad(logps.sum(), hidden)
    expected, _ = selective_log_softmax_and_entropy(hidden @ weight.T, index)
    (expected_grad,) = torch.autograd.grad(expected.sum(), hidden)
    torch.testing.assert_close(logps, expected, **TOLERANCE)
    torch.testing.assert_close(grad, expected_grad, **TOLERANCE)


def test_kernel_rejects_mismatched_index():
    with pytest.raises(ValueError, match="`index` must have the shape"):
        linear_selective_log_softmax(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 2, dtype=torch.long))


@pytest.fixture(scope="module")
def causal_lm():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_compute_token_logps_fused_equals_unfused(causal_lm, layout):
    torch.manual_seed(2)
    input_ids = torch.randint(0, 4000, (3, 10))
    kwargs = {}
    if layout == "padded":
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 7:] = 0
        kwargs["attention_mask"] = attention_mask
    else:  # three sequences in one row
        input_ids = input_ids.reshape(1, 30)
        kwargs["position_ids"] = torch.cat([torch.arange(12), torch.arange(10), torch.arange(8)])[None]
    target_mask = torch.rand(input_ids.shape[0], input_ids.shape[1] - 1) > 0.3
    assert fusable_lm_head(causal_lm) is not None

    results = {}
    for fused in (True, False):
        causal_lm.zero_grad()
        result = compute_token_logps(
            causal_lm, input_ids, target_mask=target_mask, compute_entropy=True, fused=fused,
            logits_stats_fn=logits_statistics, **kwargs,
        )  # fmt: skip
        (result.logps.sum() + 0.5 * result.entropy.sum()).backward()
        grads = {name: p.grad.clone() for name, p in causal_lm.named_parameters()}
        results[fused] = (result, grads)
    (fused_result, fused_grads), (plain_result, plain_grads) = results[True], results[False]
    assert fused_result.outputs.logits is None
    torch.testing.assert_close(fused_result.logps, plain_result.logps, **TOLERANCE)
    torch.testing.assert_close(fused_result.entropy, plain_result.entropy, **TOLERANCE)
    for name in plain_result.stats:
        torch.testing.assert_close(fused_result.stats[name], plain_result.stats[name], **TOLERANCE)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_model_accepts_argument_looks_through_peft_only():
    """A LoRA-wrapped model takes `logits_to_keep` as the transformers model under it does: the wrapper's own
    signature (`**kwargs`) and the decoder under the transformers model (its `base_model`) do not decide."""
    from peft import get_peft_model

    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    assert logprobs_module.model_accepts_argument(model, "logits_to_keep")
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert logprobs_module.model_accepts_argument(wrapped, "logits_to_keep")
    assert not logprobs_module.model_accepts_argument(wrapped, "no_such_argument")
    assert not logprobs_module.model_accepts_argument(model.model, "logits_to_keep")  # the decoder has no head


def test_heads_that_cannot_fuse(causal_lm):
    """Post-processed logits and wrapped heads keep the unfused path."""
    from peft import get_peft_model

    causal_lm.config.final_logit_softcapping = 30.0
    try:
        assert fusable_lm_head(causal_lm) is None
    finally:
        causal_lm.config.final_logit_softcapping = None
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["lm_head"]))
    assert fusable_lm_head(wrapped) is None
    # A forward hook on the head reads the logits, which the fused head never builds.
    from torch.nn.modules.module import register_module_forward_hook

    for register in (causal_lm.lm_head.register_forward_hook, register_module_forward_hook):
        handle = register(lambda module, args, output: None)
        try:
            assert fusable_lm_head(causal_lm) is None
        finally:
            handle.remove()
    assert fusable_lm_head(causal_lm) is not None


# ---------------------------------------------------------------------------------------------------------------------
# One SGD step of each trainer, fused vs unfused: the parameter updates (the gradients) are equal
# ---------------------------------------------------------------------------------------------------------------------
def _unfused(monkeypatch):
    monkeypatch.setattr(logprobs_module, "fusable_lm_head", lambda model: None)
    monkeypatch.setattr(sft_trainer, "fusable_lm_head", lambda model: None)


def _lora():
    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])


CASES = {
    "sft_padded": (SFTTrainer, SFTConfig, "standard_language_modeling", {}),
    "sft_padding_free_accumulated": (
        SFTTrainer, SFTConfig, "standard_language_modeling",
        {"padding_free": True, "max_length": None, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
    ),
    "sft_prompt_completion_peft": (SFTTrainer, SFTConfig, "standard_prompt_completion", {"peft": True}),
    "dpo": (DPOTrainer, DPOConfig, "standard_preference", {}),
    "dpo_peft_accumulated": (
        DPOTrainer, DPOConfig, "standard_preference", {"peft": True, "gradient_accumulation_steps": 2},
    ),
    "kto": (KTOTrainer, KTOConfig, "standard_unpaired_preference", {}),
    "grpo": (GRPOTrainer, GRPOConfig, "standard_prompt_only", {"num_generations": 2, "max_completion_length": 6}),
}  # fmt: skip


def _reward_low_ids(completion_ids, **kwargs):
    return [float(sum(token < 2000 for token in ids)) for ids in completion_ids]


def _one_sgd_step(case, tmp_path):
    trainer_class, config_class, dataset_name, options = CASES[case]
    options = dict(options)
    peft_config = _lora() if options.pop("peft", False) else None
    args = config_class(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
        **{"per_device_train_batch_size": 4, **SGD_STEP_ARGS, **options},
    )  # fmt: skip
    kwargs = {"reward_funcs": _reward_low_ids} if trainer_class is GRPOTrainer else {}
    if peft_config is not None:
        kwargs["peft_config"] = peft_config
    dataset = load_test_dataset(dataset_name, split="train")
    torch.manual_seed(0)  # the LoRA weights are drawn while the model is wrapped, before the Trainer seeds
    trainer = trainer_class(get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=dataset, **kwargs)
    assert fusable_lm_head(trainer.model) is not None
    update = sgd_step_update(trainer)
    return update, [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_step_fused_equals_unfused(case, tmp_path, monkeypatch):
    fused_update, fused_loss = _one_sgd_step(case, tmp_path / "fused")
    _unfused(monkeypatch)
    plain_update, plain_loss = _one_sgd_step(case, tmp_path / "plain")
    assert fused_loss == pytest.approx(plain_loss, rel=1e-5)
    assert any(update.abs().max() > 0 for update in fused_update.values())
    for name, update in plain_update.items():
        torch.testing.assert_close(fused_update[name], update, rtol=1e-5, atol=1e-6, msg=name)


def test_head_placeholder_stays_zero_stride_under_mixed_precision(tmp_path, monkeypatch):
    """The captured head returns a zero-stride float32 placeholder whatever its own dtype: accelerate's mixed
    precision converts a model's bf16 outputs to float32, which would materialise a bf16 placeholder as full logits.
    End to end: SFT with bf16 weights under bf16 mixed precision never sees a logits tensor with memory behind it."""
    head = torch.nn.Linear(8, 50, bias=False, dtype=torch.bfloat16)
    with logprobs_module.capture_lm_head_inputs(head) as captured:
        placeholder = head(torch.randn(2, 3, 8, dtype=torch.bfloat16))
    assert len(captured) == 1 and placeholder.shape == (2, 3, 50)
    assert placeholder.dtype == torch.float32 and placeholder.stride() == (0, 0, 0)
    assert placeholder.float() is placeholder  # what `convert_outputs_to_fp32` calls: no copy

    seen = []
    original = logprobs_module._fused_token_logps

    def spy(head, hidden, outputs, *args, **kwargs):
        seen.append(outputs.logits.untyped_storage().nbytes())
        return original(head, hidden, outputs, *args, **kwargs)

    dataset = load_test_dataset("standard_language_modeling", split="train")
    args = SFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to="none", bf16=True,
        use_cpu=True, model_init_kwargs={"dtype": "bfloat16"}, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = SFTTrainer(get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=dataset)
    assert trainer.accelerator.native_amp and trainer.model.dtype == torch.bfloat16
    monkeypatch.setattr(logprobs_module, "_fused_token_logps", spy)
    trainer.train()
    assert seen and max(seen) <= 4, seen


def test_kernel_under_autocast_runs_in_the_heads_dtype():
    """Called under autocast (a trainer's forward with bf16 mixed precision), the kernel runs with autocast off, in
    the float32 head's dtype, so the backward pass recomputes the very logits the forward normalised: values and
    gradients are those of the float32 head without autocast, and the bf16 hidden states get a bf16 gradient."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16).to(torch.bfloat16)
    weight = torch.randn(40, 16) * 0.3
    index = torch.randint(0, 40, (2, 7))
    results = {}
    for name in ("autocast", "float32"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "autocast"):
            source = h if name == "autocast" else h.float()
            logps, entropy, _ = linear_selective_log_softmax(source, w, index, compute_entropy=True, max_rows=5)
        (logps.sum() + entropy.sum()).backward()
        results[name] = (logps.detach(), entropy.detach(), h.grad, w.grad)
    assert results["autocast"][2].dtype == torch.bfloat16
    for a, b in zip(results["autocast"], results["float32"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("max_rows", [4, None])
@pytest.mark.parametrize("proportional", [True, False])
@pytest.mark.parametrize("entropy", [None, "metric", "in_loss"])
def test_kernel_gradients_computed_in_the_forward(max_rows, proportional, entropy):
    """With `expected_grad`, the gradients come from the forward's logits (scaled by the backward), and a gradient
    that is not proportional to the promise (or that reaches the entropy) still gets the exact result through the
    recomputing backward."""
    torch.manual_seed(3)
    hidden = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(40, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 40, (9,))
    promise = -torch.rand(9, dtype=torch.float64)
    upstream = promise * 0.37 if proportional else torch.randn(9, dtype=torch.float64)
    logps, entropy_values, _ = linear_selective_log_softmax(
        hidden, weight, index, bias, temperature=0.8, compute_entropy=entropy is not None, max_rows=max_rows,
        expected_grad=promise,
    )  # fmt: skip
    objective = (logps * upstream).sum() + (0.3 * entropy_values.sum() if entropy == "in_loss" else 0.0)
    grads = torch.autograd.grad(objective, [hidden, weight, bias], retain_graph=True)
    again = torch.autograd.grad(objective, [hidden, weight, bias])
    reference = F.log_softmax(F.linear(hidden, weight, bias) / 0.8, dim=-1)
    expected = reference.gather(-1, index[:, None]).squeeze(-1)
    torch.testing.assert_close(logps, expected, **TOLERANCE)
    expected_objective = (expected * upstream).sum()
    if entropy is not None:
        expected_entropy = -(reference.exp() * reference).sum(-1)
        torch.testing.assert_close(entropy_values, expected_entropy, **TOLERANCE)
        if entropy == "in_loss":
            expected_objective = expected_objective + 0.3 * expected_entropy.sum()
    want = torch.autograd.grad(expected_objective, [hidden, weight, bias])
    for got, second, ref in zip(grads, again, want, strict=True):
        torch.testing.assert_close(got, ref, **TOLERANCE)
        torch.testing.assert_close(second, ref, **TOLERANCE)


@pytest.mark.parametrize("max_rows", [4, None])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_kernel_frozen_head_gradients_computed_in_the_forward(max_rows, entropy_grad):
    """A frozen head (only the hidden states need a gradient): the forward computes each row's gradient and the
    backward scales it by any upstream gradient; exact twice (retain_graph), and an entropy with a gradient is
    handled by the recomputing backward."""
    torch.manual_seed(4)
    hidden = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64)
    bias = torch.randn(40, dtype=torch.float64)
    index = torch.randint(0, 40, (9,))
    upstream, entropy_upstream = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    logps, entropy, _ = linear_selective_log_softmax(
        hidden, weight, index, bias, temperature=0.8, compute_entropy=True, max_rows=max_rows
    )
    objective = (logps * upstream).sum() + ((entropy * entropy_upstream).sum() if entropy_grad else 0.0)
    (grad,) = torch.autograd.grad(objective, [hidden], retain_graph=True)
    (again,) = torch.autograd.grad(objective, [hidden])
    reference = F.log_softmax(F.linear(hidden, weight, bias) / 0.8, dim=-1)
    expected = reference.gather(-1, index[:, None]).squeeze(-1)
    expected_entropy = -(reference.exp() * reference).sum(-1)
    torch.testing.assert_close(logps, expected, **TOLERANCE)
    torch.testing.assert_close(entropy, expected_entropy, **TOLERANCE)
    want_objective = (expected * upstream).sum() + ((expected_entropy * entropy_upstream).sum() if entropy_grad else 0)
    (want,) = torch.autograd.grad(want_objective, [hidden])
    torch.testing.assert_close(grad, want, **TOLERANCE)
    torch.testing.assert_close(again, want, **TOLERANCE)


def test_kernel_entropy_with_a_vocabulary_entry_of_probability_zero():
    """A logit of -inf (an entry the head can never produce) contributes 0 to the entropy, not NaN."""
    torch.manual_seed(6)
    hidden, weight = torch.randn(5, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
    bias = torch.zeros(12, dtype=torch.float64)
    bias[4] = -math.inf
    index = torch.randint(0, 4, (5,))
    _, entropy, _ = linear_selective_log_softmax(hidden, weight, index, bias, compute_entropy=True, max_rows=2)
    probs = torch.softmax(F.linear(hidden, weight, bias), dim=-1)
    torch.testing.assert_close(entropy, -(probs * probs.log()).nan_to_num(0.0).sum(-1))
