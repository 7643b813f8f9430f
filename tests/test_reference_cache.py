"""Reference values computed once per example when training revisits examples (DPO, KTO): digests that ignore
padding, exact values handed back, the conditions that turn it on, and training that equals recomputing every time."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from trainer_utils import PREFERENCE_ARGS, args_builder

from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.trainer.fast_paths.reference_cache import ReferenceCache, row_digests, training_revisits_examples
from trl.trainer.utils.forward_randomness import forward_is_deterministic


# ---------------------------------------------------------------------------------------------------------------------
# Digests and the cache
# ---------------------------------------------------------------------------------------------------------------------
def _rows(*sequences, width):
    """`(input_ids, attention_mask, completion_mask)` of right-padded rows given as `(tokens, completion_start)`."""
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    completion = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, (tokens, completion_start) in enumerate(sequences):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
        completion[row, completion_start : len(tokens)] = 1
    return ids, mask, completion


def test_digests_ignore_padding_and_tell_examples_apart():
    alone = row_digests([_rows(([5, 6, 7, 8], 2), width=4)], 1)
    padded = row_digests([_rows(([5, 6, 7, 8], 2), ([1, 2, 3, 4, 9, 9, 9], 3), width=9)], 2)
    assert padded[0] == alone[0]
    assert padded[1] != alone[0]
    # Same tokens, another prompt/completion split: another example.
    assert row_digests([_rows(([5, 6, 7, 8], 3), width=4)], 1) != alone


def test_digests_group_an_examples_rows():
    """DPO's batch holds the chosen rows, then the rejected rows: example i owns rows i and n + i."""
    chosen_a, chosen_b, rejected_a, rejected_b = ([1, 2, 3], 1), ([4, 5], 1), ([1, 2, 9], 1), ([4, 7], 1)
    batch = row_digests([_rows(chosen_a, chosen_b, rejected_a, rejected_b, width=3)], 2)
    swapped = row_digests([_rows(chosen_b, chosen_a, rejected_b, rejected_a, width=3)], 2)
    assert batch == swapped[::-1]
    other_rejection = row_digests([_rows(chosen_a, chosen_b, ([1, 2, 8], 1), rejected_b, width=3)], 2)
    assert other_rejection[0] != batch[0] and other_rejection[1] == batch[1]


def test_cache_hands_back_the_computed_values_exactly():
    cache = ReferenceCache()
    calls = []

    def compute(values):
        def run():
            calls.append(values)
            return {"ref_logps": torch.tensor(values, dtype=torch.float32)}

        return run

    first = cache.values_for([b"a", b"b"], torch.device("cpu"), compute([-1.2345678, -7.654321]))
    again = cache.values_for([b"b", b"a"], torch.device("cpu"), compute([0.0, 0.0]))
    assert len(calls) == 1 and (cache.hits, cache.misses) == (1, 1)
    assert again["ref_logps"].dtype == torch.float32
    assert torch.equal(again["ref_logps"], first["ref_logps"].flip(0))
    # One new example: the whole batch is scored again (and the new example remembered).
    cache.values_for([b"a", b"c"], torch.device("cpu"), compute([-1.0, -3.0]))
    assert len(calls) == 2 and len(cache) == 3


def test_training_revisits_examples():
    def args(**overrides):
        values = dict(max_steps=-1, num_train_epochs=1.0, per_device_train_batch_size=4, gradient_accumulation_steps=1)
        return SimpleNamespace(**{**values, **overrides})

    assert not training_revisits_examples(args(), 10, 1)
    assert training_revisits_examples(args(num_train_epochs=2.0), 10, 1)
    assert not training_revisits_examples(args(max_steps=3), 12, 1)  # 12 examples, seen once
    assert training_revisits_examples(args(max_steps=4), 12, 1)
    assert not training_revisits_examples(args(max_steps=3, gradient_accumulation_steps=2), 24, 1)
    assert training_revisits_examples(args(max_steps=2), 12, 2)  # 2 processes x 2 steps x 4 > 12
    assert not training_revisits_examples(args(num_train_epochs=3.0), None, 1)  # an iterable dataset


def test_forward_is_deterministic():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    assert forward_is_deterministic(model.eval())
    assert not forward_is_deterministic(model.train())
    assert forward_is_deterministic(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)).train())
    attention = nn.Linear(2, 2)
    attention.attention_dropout = 0.1
    assert not forward_is_deterministic(attention.train())
    assert forward_is_deterministic(attention.eval())


# ---------------------------------------------------------------------------------------------------------------------
# Trainers
# ---------------------------------------------------------------------------------------------------------------------
TRAINERS = {
    "dpo": (DPOTrainer, args_builder(DPOConfig, **PREFERENCE_ARGS), "standard_preference"),
    "kto": (KTOTrainer, args_builder(KTOConfig, **PREFERENCE_ARGS), "standard_unpaired_preference"),
}


def _train(name, tmp_path, cache: bool, monkeypatch, **overrides):
    trainer_class, make_args, dataset_name = TRAINERS[name]
    dataset = load_test_dataset(dataset_name)["train"].select(range(8))
    # Two epochs of two steps (8 examples, 4 a step), unless overridden.
    args = make_args(tmp_path, **{"max_steps": 4, "seed": 3, **overrides})
    trainer = trainer_class(get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=dataset)
    if not cache:
        monkeypatch.setattr(trainer, "_reference_cache_applies", lambda: False)
    calls = []
    original = trainer.compute_ref_log_probs
    monkeypatch.setattr(trainer, "compute_ref_log_probs", lambda *a, **k: calls.append(1) or original(*a, **k))
    trainer.train()
    return trainer, len(calls)


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_second_epoch_reuses_the_reference_values_and_trains_alike(tmp_path, monkeypatch, name):
    cached, cached_calls = _train(name, tmp_path / "cached", True, monkeypatch)
    plain, plain_calls = _train(name, tmp_path / "plain", False, monkeypatch)
    assert plain_calls == 4 and cached_calls == 2  # the second epoch's two batches are all known examples
    assert cached._reference_cache.hits == 2 and len(cached._reference_cache) == 8
    for (key, a), b in zip(cached.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")
    losses = [[log["loss"] for log in t.state.log_history if "loss" in log] for t in (cached, plain)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(sync_ref_model=True, ref_model_sync_steps=1),  # the reference changes while training
        dict(max_steps=2),  # one epoch: no example comes back
    ],
    ids=["sync_ref_model", "one_epoch"],
)
def test_reference_is_scored_every_time_when_values_may_not_be_reused(tmp_path, monkeypatch, overrides):
    trainer, calls = _train("dpo", tmp_path, True, monkeypatch, **overrides)
    assert trainer._reference_cache is None
    assert calls == trainer.state.global_step


def test_a_reference_with_dropout_is_scored_every_time(tmp_path, monkeypatch):
    trainer_class, make_args, dataset_name = TRAINERS["dpo"]
    dataset = load_test_dataset(dataset_name)["train"].select(range(8))
    trainer = trainer_class(
        get_model_path("tiny-Qwen2ForCausalLM"), args=make_args(tmp_path, max_steps=4), train_dataset=dataset
    )
    trainer.ref_model.append_dropout = nn.Dropout(0.1)  # a dropout that draws random numbers in train mode
    trainer.ref_model.train()
    calls = []
    original = trainer.compute_ref_log_probs
    monkeypatch.setattr(trainer, "compute_ref_log_probs", lambda *a, **k: calls.append(1) or original(*a, **k))
    trainer.train()
    assert trainer._reference_cache is not None and len(trainer._reference_cache) == 0
    assert len(calls) == 4
