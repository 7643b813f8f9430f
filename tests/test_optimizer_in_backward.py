"""Optimizer steps in the backward pass (`trl/trainer/fast_paths/optimizer_in_backward.py`) against the step after it:
the same parameters, losses and logged gradient norms, gradients freed during the backward, and the predicate that
keeps the plain path wherever clipping, a callback or a subclass needs every gradient at once."""

import pytest
import torch
from datasets import Dataset
from trainer_utils import COMMON_ARGS, DECODER_SIZES, train_logs
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Trainer, TrainerCallback

from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from trl._compat import trainer_clips_in_a_method
from trl.assets import get_model_path
from trl.trainer.fast_paths import optimizer_in_backward
from trl.trainer.fast_paths.optimizer_in_backward import (
    StepsInBackward,
    optimizer_in_backward_fallback_reason,
)


pytestmark = pytest.mark.usefixtures("single_thread")
# transformers 4.x clips inline, where no trainer can take the clipping over: one backward pass there.
two_passes = pytest.mark.skipif(not trainer_clips_in_a_method(), reason="transformers 4.x clips inline")


def _model(tied: bool = True):
    torch.manual_seed(0)
    config = Qwen2Config(**{**DECODER_SIZES, "vocab_size": 4096, "pad_token_id": 4089, "tie_word_embeddings": tied})
    return Qwen2ForCausalLM(config)


def _tokenizer():
    return AutoTokenizer.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))


def _text():
    return Dataset.from_dict({"text": ["a b c d e f g h", "the cat sat on the mat", "one two three four"] * 4})


def _count_steps(monkeypatch):
    calls = []
    original = StepsInBackward.step

    def counting(self, parameter):
        calls.append(parameter.shape)
        return original(self, parameter)

    monkeypatch.setattr(StepsInBackward, "step", counting)
    return calls


def _train_sft(tmp_path, monkeypatch, in_backward: bool, tied: bool = True, **overrides):
    if not in_backward:
        monkeypatch.setattr(optimizer_in_backward, "optimizer_in_backward_fallback_reason", lambda trainer: "off")
    settings = dict(max_steps=3, per_device_train_batch_size=3, learning_rate=1e-2, seed=0, max_grad_norm=0.0)
    args = SFTConfig(str(tmp_path / str(in_backward)), **{**COMMON_ARGS, **settings, **overrides})
    trainer = SFTTrainer(_model(tied), args=args, train_dataset=_text(), processing_class=_tokenizer())
    trainer.train()
    monkeypatch.undo()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return train_logs(trainer), params, trainer


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"optim": "adamw_torch"},
        {"optim": "sgd", "lr_scheduler_type": "constant"},
        {"gradient_accumulation_steps": 2},
        {"gradient_checkpointing": True},
        {"tied": False},
    ],
    ids=["adamw_fused", "adamw", "sgd", "accumulation", "checkpointing", "untied"],
)
def test_sft_trains_to_the_numbers_of_the_step_after_the_backward(tmp_path, monkeypatch, overrides):
    overrides = dict(overrides)
    tied = overrides.pop("tied", True)
    calls = _count_steps(monkeypatch)
    fast_logs, fast_params, trainer = _train_sft(tmp_path, monkeypatch, True, tied, **overrides)
    trainable = sum(1 for p in trainer.model.parameters() if p.requires_grad)
    # every parameter but the input embeddings' steps in the backward pass, once a step
    assert len(calls) == 3 * (trainable - 1)
    plain_logs, plain_params, _ = _train_sft(tmp_path, monkeypatch, False, tied, **overrides)
    # transformers 5 logs the norm without clipping too; 4.x only when it clips
    assert all("grad_norm" in log for log in plain_logs) == hasattr(Trainer, "_get_grad_norm")
    for fast, plain in zip(fast_logs, plain_logs, strict=True):
        assert fast["loss"] == plain["loss"]
        assert fast.get("grad_norm") == plain.get("grad_norm")
        assert fast["learning_rate"] == plain["learning_rate"]
    for name, value in plain_params.items():
        assert torch.equal(fast_params[name], value), name


def test_gradients_are_freed_in_the_backward_pass():
    """After the backward pass only the input embeddings' gradient is left, and the parameters hold what one
    optimizer step after the backward gives."""
    model, reference = _model(), _model()
    ids = torch.randint(10, 4000, (2, 12), generator=torch.Generator().manual_seed(0))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    parameters = list(model.parameters())
    steps = StepsInBackward(optimizers[0], parameters)
    embedding = model.get_input_embeddings().weight
    handles = [p.register_post_accumulate_grad_hook(steps.step) for p in parameters if p is not embedding]
    model(input_ids=ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    assert [name for name, p in model.named_parameters() if p.grad is not None] == ["model.embed_tokens.weight"]
    reference(input_ids=ids, labels=ids).loss.backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    assert torch.equal(steps.total_norm(), expected_norm)
    optimizers[0].step()
    optimizers[1].step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def _train_dpo(tmp_path, monkeypatch, in_backward: bool, **overrides):
    dataset = Dataset.from_dict(
        {"prompt": ["a b", "the cat", "one two"] * 3, "chosen": [" c d", " sat", " three"] * 3,
         "rejected": [" x", " ran away", " four five"] * 3}
    )  # fmt: skip
    if not in_backward:
        monkeypatch.setattr(optimizer_in_backward, "optimizer_in_backward_fallback_reason", lambda trainer: "off")
    settings = dict(max_steps=2, per_device_train_batch_size=3, learning_rate=1e-2, seed=0, max_grad_norm=0.0)
    args = DPOConfig(str(tmp_path / str(in_backward)), **{**COMMON_ARGS, **settings, **overrides})
    trainer = DPOTrainer(_model(), ref_model=_model(), args=args, train_dataset=dataset, processing_class=_tokenizer())
    trainer.train()
    monkeypatch.undo()
    return train_logs(trainer), [p.detach().clone() for p in trainer.model.parameters()]


def test_dpo_with_a_reference_model_trains_to_the_same_numbers(tmp_path, monkeypatch):
    def train(in_backward: bool):
        return _train_dpo(tmp_path, monkeypatch, in_backward)

    calls = _count_steps(monkeypatch)
    fast_logs, fast_params = train(True)
    assert calls
    plain_logs, plain_params = train(False)
    assert [log["loss"] for log in fast_logs] == [log["loss"] for log in plain_logs]
    assert all(torch.equal(p, q) for p, q in zip(fast_params, plain_params, strict=True))


def _count_two_passes(monkeypatch, trainer_class=SFTTrainer, enable=True):
    """Counts the steps clipped in two backward passes; with `enable`, lets `trainer_class` take them (as the online
    trainers do)."""
    if enable:
        monkeypatch.setattr(trainer_class, "_clips_in_two_backward_passes", True)
    passes = []
    original = StepsInBackward.clip_after_first_pass

    def counting(self, max_norm):
        passes.append(max_norm)
        return original(self, max_norm)

    monkeypatch.setattr(StepsInBackward, "clip_after_first_pass", counting)
    return passes


@two_passes
@pytest.mark.parametrize(
    "overrides",
    [
        {"max_grad_norm": 0.05},
        {"max_grad_norm": 1e9},
        {"max_grad_norm": 0.05, "gradient_checkpointing": True},
        {"max_grad_norm": 0.05, "tied": False, "optim": "adamw_torch"},
        {"max_grad_norm": 0.05, "packing": True, "gradient_checkpointing": True},
    ],
    ids=["clipping", "not_clipping", "checkpointing", "untied", "packed"],
)
def test_two_backward_passes_clip_to_the_numbers_of_the_step_after_the_backward(tmp_path, monkeypatch, overrides):
    """With clipping, the first pass takes the global norm and the second steps each parameter clipped: the losses,
    logged norms and parameters are those of clipping after one backward pass."""
    overrides = {"max_steps": 4, **overrides}
    tied = overrides.pop("tied", True)
    passes = _count_two_passes(monkeypatch)
    calls = _count_steps(monkeypatch)
    fast_logs, fast_params, trainer = _train_sft(tmp_path, monkeypatch, True, tied, **overrides)
    assert len(passes) == 4
    trainable = sum(1 for p in trainer.model.parameters() if p.requires_grad)
    assert len(calls) == 4 * (trainable - 1)  # the input embeddings step after the backward
    plain_logs, plain_params, _ = _train_sft(tmp_path, monkeypatch, False, tied, **overrides)
    for fast, plain in zip(fast_logs, plain_logs, strict=True):
        assert (fast["loss"], fast["grad_norm"]) == (plain["loss"], plain["grad_norm"])
    for name, value in plain_params.items():
        assert torch.equal(fast_params[name], value), name


@two_passes
def test_dpo_clipped_in_two_backward_passes_trains_to_the_same_numbers(tmp_path, monkeypatch):
    def train(in_backward: bool):
        clipped = dict(max_steps=4, max_grad_norm=0.05, gradient_checkpointing=True)
        return _train_dpo(tmp_path, monkeypatch, in_backward, **clipped)

    passes = _count_two_passes(monkeypatch, DPOTrainer)
    fast_logs, fast_params = train(True)
    assert len(passes) == 4
    plain_logs, plain_params = train(False)
    for fast, plain in zip(fast_logs, plain_logs, strict=True):
        assert (fast["loss"], fast["grad_norm"]) == (plain["loss"], plain["grad_norm"])
    assert all(torch.equal(p, q) for p, q in zip(fast_params, plain_params, strict=True))


@two_passes
def test_grpo_clips_in_two_backward_passes_to_the_numbers_of_one(tmp_path, monkeypatch, model_path, prompts):
    """The online trainers clip in two backward passes by default (generation dominates their steps), with the
    rollouts, losses, logged norms and parameters of one pass."""
    from trainer_utils import GROUP_ARGS, low_id_reward

    from trl import GRPOConfig, GRPOTrainer

    def train(two_passes: bool):
        monkeypatch.setattr(GRPOTrainer, "_clips_in_two_backward_passes", two_passes)
        args = GRPOConfig(
            str(tmp_path / str(two_passes)), **{**COMMON_ARGS, **GROUP_ARGS, "max_steps": 3, "max_grad_norm": 0.05}
        )
        trainer = GRPOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
        trainer.train()
        monkeypatch.undo()
        return train_logs(trainer), [p.detach().clone() for p in trainer.model.parameters()]

    passes = _count_two_passes(monkeypatch, enable=False)
    fast_logs, fast_params = train(True)
    assert len(passes) == 3
    plain_logs, plain_params = train(False)
    for fast, plain in zip(fast_logs, plain_logs, strict=True):
        assert (fast["loss"], fast["grad_norm"], fast["reward"]) == (
            plain["loss"],
            plain["grad_norm"],
            plain["reward"],
        )
    assert all(torch.equal(p, q) for p, q in zip(fast_params, plain_params, strict=True))


@pytest.mark.parametrize(
    "change, reason",
    [
        pytest.param({"offline": True}, "SFTTrainer's backward pass is too large a part", marks=two_passes),
        ({"gradient_accumulation_steps": 2}, "accumulates several micro-batches"),
        pytest.param({"hook": True}, "backward hooks", marks=two_passes),
        pytest.param({"lora": True}, "less than a tenth of the weights", marks=two_passes),
        pytest.param(
            {},
            "the clipping is not transformers' `_clip_grad_norm`",
            marks=pytest.mark.skipif(trainer_clips_in_a_method(), reason="transformers 5 clips in a method"),
        ),
    ],
    ids=["offline", "accumulation", "hooks", "adapters", "transformers_4"],
)
def test_clipping_keeps_one_backward_pass(tmp_path, monkeypatch, change, reason):
    """Two passes only in trainers whose steps are mostly generation (not SFT's), with one micro-batch a step, no
    backward hooks to run twice and more than adapters trained."""
    change = dict(change)
    passes = _count_two_passes(monkeypatch, enable=not change.pop("offline", False))
    model = _model()
    if change.pop("hook", False):
        model.model.norm.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    peft_config = None
    if change.pop("lora", False):
        from peft import LoraConfig

        peft_config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = SFTConfig(
        str(tmp_path), max_steps=5, per_device_train_batch_size=3, **{**COMMON_ARGS, "max_grad_norm": 1.0, **change}
    )
    trainer = SFTTrainer(
        model, args=args, train_dataset=_text(), processing_class=_tokenizer(), peft_config=peft_config
    )
    trainer.train()
    assert reason in optimizer_in_backward_fallback_reason(trainer)
    assert not passes


@two_passes
@pytest.mark.parametrize("option", ["use_liger_kernel", "torch_compile"])
def test_liger_and_compile_keep_one_backward_pass(tmp_path, monkeypatch, option):
    """Their backward functions are made for one pass over the graph."""
    monkeypatch.setattr(SFTTrainer, "_clips_in_two_backward_passes", True)
    args = SFTConfig(str(tmp_path), max_steps=1, **{**COMMON_ARGS, "max_grad_norm": 1.0})
    trainer = SFTTrainer(_model(), args=args, train_dataset=_text(), processing_class=_tokenizer())
    trainer.create_optimizer()
    assert optimizer_in_backward_fallback_reason(trainer) is None
    setattr(trainer.args, option, True)
    assert "liger's kernels or torch.compile" in optimizer_in_backward_fallback_reason(trainer)


class _OptimizerSpy(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        pass


class _SubclassedSFT(SFTTrainer):
    def training_step(self, *args, **kwargs):
        return super().training_step(*args, **kwargs)


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(args={"max_grad_norm": 1.0}), "clipped"),
        (dict(args={"optim": "adafactor"}), "Adafactor is not one of"),
        (dict(callbacks=[_OptimizerSpy()]), "_OptimizerSpy overrides on_pre_optimizer_step"),
        (dict(trainer_class=_SubclassedSFT), "overrides training_step"),
    ],
    ids=["clipping", "optimizer", "callback", "subclass"],
)
def test_fallback_reasons(tmp_path, monkeypatch, change, reason):
    calls = _count_steps(monkeypatch)
    args = SFTConfig(
        str(tmp_path), max_steps=1, per_device_train_batch_size=3,
        **{**COMMON_ARGS, "max_grad_norm": 0.0, **change.get("args", {})},
    )  # fmt: skip
    trainer_class = change.get("trainer_class", SFTTrainer)
    trainer = trainer_class(
        _model(), args=args, train_dataset=_text(), processing_class=_tokenizer(), callbacks=change.get("callbacks")
    )
    trainer.train()
    assert reason in optimizer_in_backward_fallback_reason(trainer)
    assert not calls
    assert all(p.grad is None for p in trainer.model.parameters())  # zeroed after the step as usual


def test_layer_budget_leaves_no_room_for_gradients_stepped_in_the_backward(monkeypatch):
    """Kept layers fit under the gradients still to come; gradients stepped and freed in the backward never come."""
    from trl.trainer.fast_paths import layer_checkpoints

    model = _model()
    layers = list(model.model.layers)
    budget = layer_checkpoints.LayerBudget(layers, model)
    budget.bytes_per_token = 1.0
    monkeypatch.setattr(layer_checkpoints, "head_output_bytes", lambda model: 0)
    budget.plan(tokens=1)
    assert budget.keep_from == 0  # every layer fits
    monkeypatch.setattr(optimizer_in_backward, "_STEPPED", {id(p) for p in model.parameters()})
    budget.plan(tokens=1)
    assert budget.keep_from == len(layers)


def test_optimizer_step_hooks_keep_the_step_after_the_backward(tmp_path):
    args = SFTConfig(
        str(tmp_path), max_steps=1, per_device_train_batch_size=3, **{**COMMON_ARGS, "max_grad_norm": 0.0}
    )
    trainer = SFTTrainer(_model(), args=args, train_dataset=_text(), processing_class=_tokenizer())
    trainer.create_optimizer()
    steps = []
    trainer.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
    trainer.train()
    assert "step hooks" in optimizer_in_backward_fallback_reason(trainer)
    assert steps == [1]  # one step over all parameters, as the hook expects


def test_a_second_accumulation_after_the_step_is_refused_clearly():
    weight = torch.nn.Parameter(torch.ones(3))
    steps = StepsInBackward(torch.optim.SGD([weight], lr=0.1), [weight])
    weight.register_post_accumulate_grad_hook(steps.step)
    with pytest.raises(RuntimeError, match=r"shape \(3,\) was accumulated again"):
        # two backward calls into one pass's record: the second accumulation finds the parameter already stepped
        (weight * 2).sum().backward()
        (weight * 3).sum().backward()
