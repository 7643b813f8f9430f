"""Gradients and Adam moments in contiguous buffers (`trl.trainer.utils.contiguous_state`).

The buffers change where the memory lives, never a number: training with them gives bitwise the parameters and
optimizer state of training without them, parameters that receive no gradient stay untouched (no weight decay, no
state), `.grad` is `None` between steps, and nothing is left on the model or optimizer after `train()`."""

import copy

import pytest
import torch
import torch.nn as nn
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from trl import SFTConfig, SFTTrainer
from trl.trainer.utils import contiguous_state
from trl.trainer.utils.contiguous_state import ContiguousTrainingState, contiguous_state_fallback_reason


pytestmark = pytest.mark.usefixtures("single_thread")


class _TwoHeads(nn.Module):
    """A body and two heads, of which a batch may use one only (the other then receives no gradient)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 5)
        self.used = nn.Linear(5, 3)
        self.unused = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x, head="used"):
        return (getattr(self, head)(torch.tanh(self.body(x))) * self.scale.float()).pow(2).mean()


def _train(model, optimizer, contiguous: bool, steps: int = 3, accumulation: int = 2, heads=("used",)):
    state = ContiguousTrainingState(optimizer) if contiguous else None
    torch.manual_seed(1)
    grads_between_steps = []
    for step in range(steps):
        for micro in range(accumulation):
            if state is not None:
                state.before_micro_batch()
            loss = model(torch.randn(4, 6), head=heads[(step + micro) % len(heads)])
            loss.backward()
            if state is not None:
                state.after_micro_batch()
            # What gradient clipping and callbacks see: the same parameters with a gradient as without buffers.
            assert (model.unused.weight.grad is None) == ("unused" not in heads[: micro + 1])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        grads_between_steps.append([p.grad for p in model.parameters()])
    if state is not None:
        state.close()
    return grads_between_steps


def _optimizer(model, kind: str):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    fused = {"fused": True} if kind == "adamw_fused" else {"foreach": kind == "adamw_foreach"}
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, **fused)


def _assert_same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer):
    state_a, state_b = a.state_dict()["state"], b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        assert state_a[index].keys() == state_b[index].keys()
        for key, value in state_a[index].items():
            other = state_b[index][key]
            if torch.is_tensor(value):
                assert value.dtype == other.dtype and value.device == other.device and value.shape == other.shape
                assert torch.equal(value, other), (index, key)
            else:
                assert value == other


@pytest.mark.parametrize("kind", ["adamw_fused", "adamw_foreach", "adamw_loop", "sgd"])
def test_training_is_bitwise_unchanged(kind):
    results = {}
    for contiguous in (False, True):
        model = _TwoHeads()
        optimizer = _optimizer(model, kind)
        between = _train(model, optimizer, contiguous)
        results[contiguous] = (model, optimizer)
        assert all(grad is None for grads in between for grad in grads)
    (plain, plain_opt), (flat, flat_opt) = results[False], results[True]
    for (name, p), q in zip(plain.named_parameters(), flat.parameters()):
        assert torch.equal(p, q), name
    _assert_same_state(plain_opt, flat_opt)
    # The head no batch used never moved (no weight decay either) and has no optimizer state, as without buffers.
    assert torch.equal(flat.unused.weight, _TwoHeads().unused.weight)
    assert all(p not in flat_opt.state for p in flat.unused.parameters())


def test_moments_and_gradients_live_in_the_buffers():
    model = _TwoHeads()
    optimizer = _optimizer(model, "adamw_fused")
    state = ContiguousTrainingState(optimizer)
    state.before_micro_batch()
    model(torch.randn(4, 6)).backward()
    grad_storage = model.body.weight.grad.untyped_storage().data_ptr()
    assert model.used.weight.grad.untyped_storage().data_ptr() == grad_storage
    assert model.scale.grad.dtype == torch.float64  # a buffer per dtype
    optimizer.step()
    moments = optimizer.state[model.body.weight]["exp_avg"].untyped_storage().data_ptr()
    assert optimizer.state[model.used.bias]["exp_avg"].untyped_storage().data_ptr() == moments
    # A second micro-batch of the same step accumulates into the same slices.
    optimizer.zero_grad()
    state.before_micro_batch()
    model(torch.randn(4, 6)).backward()
    first = model.body.weight.grad.clone()
    state.before_micro_batch()  # gradients present: left alone
    model(torch.randn(4, 6)).backward()
    assert model.body.weight.grad.untyped_storage().data_ptr() == grad_storage
    assert not torch.equal(model.body.weight.grad, first)
    state.close()
    assert not model.body.weight._post_accumulate_grad_hooks
    assert not optimizer._optimizer_step_pre_hooks


def test_loaded_optimizer_state_is_kept():
    model = _TwoHeads()
    optimizer = _optimizer(model, "adamw_fused")
    _train(model, optimizer, contiguous=False, steps=1)
    saved = copy.deepcopy(optimizer.state_dict())
    resumed = _optimizer(model, "adamw_fused")
    resumed.load_state_dict(saved)
    loaded = resumed.state[model.body.weight]["exp_avg"]
    state = ContiguousTrainingState(resumed)
    state.before_micro_batch()
    model(torch.randn(4, 6)).backward()
    resumed.step()
    assert resumed.state[model.body.weight]["exp_avg"] is loaded
    state.close()


def test_fallback_reasons():
    class Args:
        world_size = 1
        deepspeed = None
        fsdp = ""
        fsdp_config = None

    model = _TwoHeads()
    assert contiguous_state_fallback_reason(Args(), _optimizer(model, "adamw_fused")) is None
    distributed = Args()
    distributed.world_size = 2
    assert "distributed" in contiguous_state_fallback_reason(distributed, _optimizer(model, "adamw_fused"))
    assert "not a torch.optim" in contiguous_state_fallback_reason(Args(), object())
    frozen = _TwoHeads().requires_grad_(False)
    assert "no trained" in contiguous_state_fallback_reason(Args(), _optimizer(frozen, "sgd"))
    sparse = _TwoHeads()
    sparse.embed = nn.Embedding(4, 6, sparse=True)
    assert "sparse" in contiguous_state_fallback_reason(Args(), _optimizer(sparse, "sgd"), sparse)
    meta = _TwoHeads().to("meta")
    assert "CPU" in contiguous_state_fallback_reason(Args(), torch.optim.SGD(meta.parameters(), lr=0.1))


def _sft_run(tmp_path, tiny_qwen_path, monkeypatch, contiguous: bool, name: str):
    if not contiguous:
        monkeypatch.setattr(contiguous_state, "contiguous_state_fallback_reason", lambda *a: "disabled by the test")
    seen = []

    with_grad = []

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            seen.append(all(p.grad is None for p in model.parameters()))

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            with_grad.append(sorted(name for name, p in model.named_parameters() if p.grad is not None))

        def on_step_end(self, args, state, control, **kwargs):
            seen.append(trainer._contiguous_state is not None)

    dataset = Dataset.from_dict({"text": [f"row {i} " + "word " * (3 + i % 5) for i in range(16)]})
    args = SFTConfig(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        report_to="none",
        save_strategy="no",
        seed=0,
        bf16=False,
        learning_rate=1e-3,
        weight_decay=0.1,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path)
    torch.manual_seed(0)
    model.model.unused_head = nn.Linear(4, 4)  # trained, never reached by the loss: its gradient stays None
    trainer = SFTTrainer(model, args=args, train_dataset=dataset, callbacks=[Watch()])
    trainer.train()
    monkeypatch.undo()
    return trainer, seen, with_grad


def test_sft_trainer_uses_it_without_changing_a_number(tmp_path, tiny_qwen_path, monkeypatch):
    plain, plain_seen, plain_with_grad = _sft_run(tmp_path, tiny_qwen_path, monkeypatch, False, name="plain")
    flat, flat_seen, flat_with_grad = _sft_run(tmp_path, tiny_qwen_path, monkeypatch, True, name="flat")
    assert flat_with_grad == plain_with_grad  # what a callback sees before the optimizer step
    assert not any("unused_head" in name for names in flat_with_grad for name in names)
    assert plain_seen == [True, False] * 2
    assert flat_seen == [True, True] * 2  # gradients are None when a step begins, the buffers in use during it
    for (name, p), q in zip(plain.model.named_parameters(), flat.model.parameters()):
        assert torch.equal(p, q), name
    _assert_same_state(plain.optimizer.optimizer, flat.optimizer.optimizer)
    assert flat._contiguous_state is None  # released after train()
    assert not any(p._post_accumulate_grad_hooks for p in flat.model.parameters())
    assert [log["loss"] for log in plain.state.log_history if "loss" in log] == [
        log["loss"] for log in flat.state.log_history if "loss" in log
    ]
