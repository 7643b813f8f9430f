"""DistillationTrainer: on-policy distillation with the generalized JSD, teacher handling, training, the CLI."""

import contextlib
import math
import os
import subprocess
import sys
import warnings

import pandas as pd
import pytest
import torch
from datasets import Dataset
from trainer_utils import (
    LOGGED_LOSS_TOLERANCE,
    ROLLOUT_METRICS,
    args_builder,
    assert_saved_model_reloads,
    changed_params,
    requires_response_parser,
    resume_from_first_checkpoint,
    snapshot,
    train_logs,
    uses_example_yaml_assets,
)
from transformers import AutoConfig, AutoModelForCausalLM

from trl import DistillationConfig, DistillationTrainer
from trl.assets import get_dataset_path, get_model_path, load_test_dataset
from trl.trainer.utils.logprobs import small_head_output


TEACHER = "small-Qwen2ForCausalLM"
GREEDY = {"do_sample": False}

DISTILLATION_METRICS = [*ROLLOUT_METRICS, "entropy"]

pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(
    DistillationConfig,
    max_steps=2,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    max_completion_length=6,
    learning_rate=1e-2,
    seed=0,
)


@pytest.fixture(scope="module")
def teacher_path():
    return get_model_path(TEACHER)


def build(tmp_path, model_path, teacher, prompts, **overrides):
    return DistillationTrainer(
        model_path, teacher_model=teacher, args=make_args(tmp_path, **overrides), train_dataset=prompts
    )


def two_rollouts(pad: int) -> dict:
    """Two left-padded prompts with right-padded completions of 3 and 1 tokens, as a rollout batch."""
    return {
        "prompt_ids": torch.tensor([[pad, 11, 12, 13, 14], [21, 22, 23, 24, 25]]),
        "prompt_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
        "completion_ids": torch.tensor([[31, 32, 33], [41, pad, pad]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "num_items_in_batch": torch.tensor(4.0),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Configuration and construction errors
# ---------------------------------------------------------------------------------------------------------------------
def test_config_defaults_and_beta_validation(tmp_path):
    args = DistillationConfig(str(tmp_path))
    assert (args.beta, args.temperature, args.max_completion_length, args.learning_rate) == (1.0, 1.0, 512, 1e-6)
    assert args.remove_unused_columns is False and args.teacher_model_name_or_path is None
    for beta in (0.0, 0.5, 1.0):
        assert DistillationConfig(str(tmp_path), beta=beta).beta == beta
    for beta in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"beta must be in \[0.0, 1.0\]"):
            DistillationConfig(str(tmp_path), beta=beta)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        DistillationConfig(str(tmp_path), temperature=0.0)
    # One generation round per optimizer step, one completion per prompt.
    args = DistillationConfig(str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2)
    assert (args.steps_per_generation, args.generation_batch_size, args.num_generations) == (2, 6, 1)


def test_vocabulary_mismatch_is_refused(tmp_path, model_path, prompts):
    config = AutoConfig.from_pretrained(model_path)
    config.vocab_size = 5000
    teacher = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="vocab_size 4096 but the teacher model has vocab_size 5000"):
        build(tmp_path, model_path, teacher, prompts)


def test_teacher_is_required_before_training(tmp_path, model_path, prompts):
    trainer = build(tmp_path, model_path, None, prompts)
    with pytest.raises(ValueError, match="has no teacher"):
        trainer.train()
    student = AutoModelForCausalLM.from_pretrained(model_path)
    with pytest.raises(ValueError, match="same object as model"):
        build(tmp_path, student, student, prompts)


def test_the_same_path_for_student_and_teacher_loads_two_models(tmp_path, model_path, prompts):
    trainer = build(tmp_path, model_path, model_path, prompts)
    assert trainer.teacher_model is not trainer.model
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())


def test_teacher_loaded_from_config_path_with_init_kwargs(tmp_path, model_path, teacher_path, prompts):
    args = make_args(
        tmp_path, teacher_model_name_or_path=teacher_path, teacher_model_init_kwargs={"dtype": "bfloat16"}
    )
    trainer = DistillationTrainer(model_path, args=args, train_dataset=prompts)
    teacher = trainer.teacher_model
    assert teacher.dtype == torch.bfloat16 and trainer.model.dtype == torch.float32
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert teacher.config.num_hidden_layers == AutoConfig.from_pretrained(teacher_path).num_hidden_layers


def test_experimental_aliases_warn(tmp_path):
    from trl.experimental.distillation import DistillationConfig as OldConfig
    from trl.experimental.distillation import DistillationTrainer as OldTrainer

    with pytest.warns(FutureWarning, match="use trl.DistillationConfig"):
        args = OldConfig(str(tmp_path))
    assert isinstance(args, DistillationConfig) and issubclass(OldTrainer, DistillationTrainer)


# ---------------------------------------------------------------------------------------------------------------------
# The loss against a hand-written formula
# ---------------------------------------------------------------------------------------------------------------------
def naive_generalized_jsd(student_logits, teacher_logits, beta, temperature):
    """Per-position generalized JSD written out with full-vocabulary softmaxes (the test's oracle)."""
    p_s = torch.softmax(student_logits.double() / temperature, dim=-1)
    p_t = torch.softmax(teacher_logits.double() / temperature, dim=-1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    if beta == 0.0:
        return kl(p_t, p_s)
    if beta == 1.0:
        return kl(p_s, p_t)
    mixture = (1 - beta) * p_s + beta * p_t
    return beta * kl(p_t, mixture) + (1 - beta) * kl(p_s, mixture)


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 0.7), (1.0, 2.0), (0.3, 1.0)])
def test_loss_matches_formula(tmp_path, model_path, teacher_path, prompts, beta, temperature, monkeypatch):
    from trl.trainer.fast_paths import last_layer_selection

    selections = []
    last_layer_at = last_layer_selection.last_layer_at

    @contextlib.contextmanager
    def recording_last_layer_at(*args):
        with last_layer_at(*args) as selected:
            selections.append(selected)
            yield selected

    monkeypatch.setattr(last_layer_selection, "last_layer_at", recording_last_layer_at)
    trainer = build(tmp_path, model_path, teacher_path, prompts, beta=beta, temperature=temperature)
    inputs = two_rollouts(trainer.pad_token_id)
    loss = trainer._compute_loss(trainer.model, inputs)
    assert selections == [True, True]  # teacher and student: the last layer only where the completion is predicted

    expected_sum = 0.0
    for row in range(2):
        prompt = [t for t, m in zip(inputs["prompt_ids"][row].tolist(), inputs["prompt_mask"][row].tolist()) if m]
        completion = [
            t for t, m in zip(inputs["completion_ids"][row].tolist(), inputs["completion_mask"][row].tolist()) if m
        ]
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            student = trainer.model(input_ids=ids).logits[0]
            teacher = trainer.teacher_model(input_ids=ids).logits[0]
        # Completion token k is predicted at position len(prompt) - 1 + k.
        positions = slice(len(prompt) - 1, len(prompt) - 1 + len(completion))
        expected_sum += naive_generalized_jsd(student[positions], teacher[positions], beta, temperature).sum().item()
    assert loss.item() == pytest.approx(expected_sum / 4, rel=1e-5)
    loss.backward()
    assert trainer.model.lm_head.weight.grad is not None
    assert all(p.grad is None for p in trainer.teacher_model.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------
def test_training_changes_params_and_logs_metrics(tmp_path, model_path, teacher_path, prompts):
    args = make_args(tmp_path, eval_strategy="steps", eval_steps=2, log_completions=True)
    eval_prompts = load_test_dataset("standard_prompt_only", split="test")
    trainer = DistillationTrainer(
        model_path, teacher_model=teacher_path, args=args, train_dataset=prompts, eval_dataset=eval_prompts
    )
    teacher_before = snapshot(trainer.teacher_model)
    before = snapshot(trainer.model)
    output = trainer.train()
    assert changed_params(before, trainer.model)
    assert not changed_params(teacher_before, trainer.teacher_model, trainable_only=False)

    logs = train_logs(trainer)
    assert len(logs) == 2 and output.global_step == 2
    for log in logs:
        assert set(DISTILLATION_METRICS) <= set(log)
        assert not any(key.startswith(("reward", "frac_reward", "kl", "clip_ratio")) for key in log)
        assert math.isfinite(log["loss"]) and log["loss"] >= 0
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    assert {f"eval_{name}" for name in DISTILLATION_METRICS} <= set(metrics)

    # The completions table: step, prompt, completion (no reward or advantage columns), as in TRL.
    table = pd.read_parquet(os.path.join(tmp_path, "completions", "completions_00001.parquet"))
    assert list(table.columns) == ["step", "prompt", "completion"] and len(table) == 4


def test_gradient_accumulation_gives_the_step_token_mean(tmp_path, model_path, teacher_path, prompts):
    """One round of 4 prompts per optimizer step either way; the loss is the mean over all its completion tokens."""
    eos_bias = {"sequence_bias": [[[4091], 6.0]]}  # sampled: some completions end early
    common = dict(max_steps=1, generation_kwargs=eos_bias, shuffle_dataset=False)
    whole = build(tmp_path / "a", model_path, teacher_path, prompts, **common)
    whole.train()
    split = build(
        tmp_path / "b", model_path, teacher_path, prompts, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        **common,
    )  # fmt: skip
    split.train()
    lengths = train_logs(whole)[0]
    assert lengths["completions/min_length"] < lengths["completions/max_length"]  # uneven lengths: a real check
    expected = pytest.approx(train_logs(whole)[0]["loss"], rel=1e-5, abs=2 * LOGGED_LOSS_TOLERANCE)
    assert train_logs(split)[0]["loss"] == expected


def test_save_reload_and_resume(tmp_path, model_path, teacher_path, prompts):
    trainer = build(tmp_path / "run", model_path, teacher_path, prompts, max_steps=1, generation_kwargs=GREEDY)
    trainer.train()
    assert_saved_model_reloads(trainer, tmp_path / "saved")

    args = make_args(tmp_path / "resume", save_strategy="steps", save_steps=1, generation_kwargs=GREEDY)
    resume_from_first_checkpoint(
        DistillationTrainer, args, tmp_path / "resume", model=model_path, teacher_model=teacher_path,
        train_dataset=prompts,
    )  # fmt: skip


def test_peft_student_trains_adapters_only(tmp_path, model_path, teacher_path, prompts):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = make_args(tmp_path, max_steps=1)
    trainer = DistillationTrainer(
        model_path, teacher_model=teacher_path, args=args, train_dataset=prompts, peft_config=lora
    )
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model)
    assert changed and all("lora" in name for name in changed)


@requires_response_parser
def test_tool_calls_during_rollouts(tmp_path, model_path, teacher_path):
    from test_grpo_tools import ScriptedReplies, make_multiply, tool_call

    calls = []
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 3 times 4?"}]] * 4})
    args = make_args(tmp_path, max_steps=1, max_completion_length=64)
    trainer = DistillationTrainer(
        model_path, teacher_model=teacher_path, args=args, train_dataset=prompts, tools=[make_multiply(calls)]
    )
    ScriptedReplies(trainer, lambda text, turn: tool_call("multiply", a=3, b=4) if turn == 0 else "It is 12.")
    trainer.train()
    assert calls == [(3, 4)] * 4
    log = train_logs(trainer)[-1]
    assert (log["tools/call_frequency"], log["tools/failure_frequency"]) == (1.0, 0.0)
    # Tool results are attended to but left out of the divergence.
    batch = trainer._buffered_inputs[0]
    assert ((batch["completion_mask"] * batch["tool_mask"]).sum(dim=1) < batch["completion_mask"].sum(dim=1)).all()


def trained_teacher(model_path, tokenizer, steps=40):
    """The tiny model fitted for a few steps on the language-modelling split: a peaked, non-random teacher."""
    torch.manual_seed(1)
    teacher = AutoModelForCausalLM.from_pretrained(model_path)
    texts = load_test_dataset("standard_language_modeling", split="train")["text"][:16]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        teacher(**batch, labels=labels).loss.backward()
        optimizer.step()
    return teacher.eval()


def test_student_moves_toward_a_trained_teacher(tmp_path, model_path, tokenizer, prompts):
    teacher = trained_teacher(model_path, tokenizer)
    held_out = load_test_dataset("standard_prompt_only", split="test")
    # Forward KL (beta 0): the student spreads over the teacher's modes; measured on its own held-out completions.
    args = make_args(
        tmp_path, max_steps=30, learning_rate=1e-2, lr_scheduler_type="constant", per_device_train_batch_size=8,
        max_completion_length=8, beta=0.0, logging_steps=10, per_device_eval_batch_size=6,
    )  # fmt: skip
    trainer = DistillationTrainer(
        model_path, teacher_model=teacher, args=args, train_dataset=prompts, eval_dataset=held_out
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < 0.5 * before, (before, after)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------
@uses_example_yaml_assets
def test_cli_runs_the_example_config_offline(tmp_path):
    """`trl distillation --config examples/cli_configs/distillation.yaml` end to end, on the tiny local assets."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = os.path.join(root, "examples", "cli_configs", "distillation.yaml")
    assets = os.path.dirname(os.path.dirname(get_model_path("tiny-Qwen2ForCausalLM")))
    get_model_path(TEACHER), get_dataset_path("standard_prompt_only")
    (tmp_path / ".trl-assets").mkdir()
    os.symlink(assets, tmp_path / ".trl-assets" / os.path.basename(assets))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": root}
    command = [sys.executable, "-m", "trl.cli.main", "distillation", "--config", config]
    command += ["--max_steps", "2", "--output_dir", "out", "--max_completion_length", "4"]
    with warnings.catch_warnings():
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()


def loss_entropy_and_grads(trainer, inputs) -> tuple:
    """One loss and backward on `inputs`: the loss, the logged entropy and the parameters' gradients."""
    trainer.model.zero_grad()
    trainer._metrics[trainer._mode].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), trainer._metrics[trainer._mode]["entropy"][-1], grads


@pytest.mark.parametrize("beta, temperature", [(0.5, 0.7), (0.0, 1.0), (1.0, 2.0)])
def test_hidden_state_path_equals_the_logits_path(
    tmp_path, model_path, teacher_path, prompts, monkeypatch, beta, temperature
):
    """With plain linear heads the loss runs from both models' hidden states (TRL's `_get_last_hidden_state`), the
    heads applied to them: the loss, the entropy and the gradients of the logits path."""
    trainer = build(tmp_path, model_path, teacher_path, prompts, beta=beta, temperature=temperature)
    assert trainer._hidden_state_path(trainer.model) is not None
    inputs = two_rollouts(trainer.pad_token_id)
    results = []
    for hidden_states in (True, False):
        if not hidden_states:
            monkeypatch.setattr(type(trainer), "_hidden_state_path", lambda self, model: None)
        results.append(loss_entropy_and_grads(trainer, inputs))
    (loss, entropy, grads), (plain_loss, plain_entropy, plain_grads) = results
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.as_tensor(entropy), torch.as_tensor(plain_entropy), rtol=1e-5, atol=1e-6)
    assert grads.keys() == plain_grads.keys() and "lm_head.weight" in grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("beta, temperature", [(0.5, 0.7), (1.0, 2.0)])
def test_frozen_head_path_equals_the_plain_path(
    tmp_path, model_path, teacher_path, prompts, monkeypatch, beta, temperature
):
    """A frozen student head (as under PEFT) takes `frozen_head_generalized_jsd`, whose gradient is computed in the
    forward: the loss, entropy and gradients of projecting the hidden states and back-propagating (the plain path)."""
    import trl.trainer.distillation_trainer as module

    trainer = build(tmp_path, model_path, teacher_path, prompts, beta=beta, temperature=temperature)
    trainer.model.get_output_embeddings().weight.requires_grad_(False)
    inputs = two_rollouts(trainer.pad_token_id)
    calls = []
    fast = module.frozen_head_generalized_jsd
    monkeypatch.setattr(module, "frozen_head_generalized_jsd", lambda *a, **k: calls.append(1) or fast(*a, **k))
    results = []
    for frozen_path in (True, False):
        if not frozen_path:
            monkeypatch.setattr(module, "head_is_frozen", lambda head: False)
        results.append(loss_entropy_and_grads(trainer, inputs))
    assert calls == [1]
    (loss, entropy, grads), (plain_loss, plain_entropy, plain_grads) = results
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(torch.as_tensor(entropy), torch.as_tensor(plain_entropy), rtol=1e-6, atol=1e-7)
    assert grads.keys() == plain_grads.keys() and "lm_head.weight" not in grads and grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_get_last_hidden_state_override_is_called(tmp_path, model_path, teacher_path, prompts):
    """A subclass's `_get_last_hidden_state` (TRL's hook) gives the hidden states of both the student and the
    teacher, as in TRL; it receives the whole sequences and the completion width."""
    calls = []

    class Recording(DistillationTrainer):
        def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, logits_to_keep, **kwargs):
            calls.append((unwrapped_model is self.teacher_model, tuple(input_ids.shape), logits_to_keep))
            return super()._get_last_hidden_state(unwrapped_model, input_ids, attention_mask, logits_to_keep, **kwargs)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Recording(
            model_path, teacher_model=teacher_path, args=make_args(tmp_path, max_steps=1), train_dataset=prompts
        )
    assert not [w for w in caught if "_get_last_hidden_state" in str(w.message)]  # no "override has no effect"
    trainer.train()
    assert [teacher for teacher, _, _ in calls] == [True, False]
    (_, shape, width), _ = calls
    assert 1 <= width <= 6 and shape[1] > width  # whole sequences; the completion's width


def test_get_last_hidden_state_override_unused_is_told(tmp_path, model_path, teacher_path, prompts):
    """When the loss must run from logits (here: a soft-capped student head), an overridden `_get_last_hidden_state`
    is not called, and the run says so once, with the reason."""
    calls = []

    class Recording(DistillationTrainer):
        def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, logits_to_keep, **kwargs):
            calls.append(unwrapped_model)
            return super()._get_last_hidden_state(unwrapped_model, input_ids, attention_mask, logits_to_keep, **kwargs)

    trainer = Recording(model_path, teacher_model=teacher_path, args=make_args(tmp_path), train_dataset=prompts)
    trainer.model.config.final_logit_softcapping = 30.0  # read by `fusable_lm_head`; Qwen2 itself ignores it
    with pytest.warns(UserWarning, match="student's LM head is not a plain linear layer"):
        trainer._compute_loss(trainer.model, two_rollouts(trainer.pad_token_id))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per run
        trainer._compute_loss(trainer.model, two_rollouts(trainer.pad_token_id))
    assert calls == []


def test_kept_layers_train_as_with_transformers_checkpoint(tmp_path, model_path, teacher_path, prompts, monkeypatch):
    """The student's logits cover the completion only, so gradient checkpointing keeps the last layers' activations
    within the gradient budget instead of recomputing them: the same losses and weights as transformers' checkpoint."""
    from trl.trainer.fast_paths import layer_checkpoints
    from trl.trainer.utils import logprobs

    kept = []
    plan = layer_checkpoints.LayerBudget.plan

    def recording_plan(budget, tokens):
        plan(budget, tokens)
        kept.append(len(budget.layers) - budget.keep_from)

    monkeypatch.setattr(layer_checkpoints.LayerBudget, "plan", recording_plan)
    # At this tiny width the logits (a 4 x 7 x vocabulary block) outweigh every layer's gradients: declared as nothing.
    declared = []
    monkeypatch.setattr(logprobs, "small_head_output", lambda nbytes: declared.append(nbytes) or small_head_output(0))
    results = []
    for lean in (True, False):
        if not lean:
            monkeypatch.setattr(layer_checkpoints, "layer_checkpoint_fallback_reason", lambda layer: "off")
        trainer = build(
            tmp_path / str(lean),
            model_path,
            teacher_path,
            prompts,
            generation_kwargs=GREEDY,
            gradient_checkpointing=True,
        )
        trainer.train()
        trained = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        results.append(([log["loss"] for log in train_logs(trainer)], trained))
    assert kept[0] == 1  # the first forward keeps (and measures) the last layer; later ones keep what fits
    assert declared[0] == 4 * 4 * 6 * trainer.model.config.vocab_size * 4  # rows x completion x vocab, float32, x4
    (losses, weights), (plain_losses, plain_weights) = results
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-7, msg=name)
