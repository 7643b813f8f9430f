"""GRPOTrainer behaviours TRL users rely on: streaming datasets, generation options, helpers, reward checks."""

import pytest
import torch
from datasets import Dataset
from trainer_utils import (
    GROUP_ARGS,
    args_builder,
    changed_params,
    low_id_reward,
    snapshot,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from trl import GRPOConfig, GRPOTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.trainer.online_base import (
    generate_with_shared_prompts,
    group_advantages,
)


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(GRPOConfig, **GROUP_ARGS)


# ---------------------------------------------------------------------------------------------------------------------
# Streaming datasets
# ---------------------------------------------------------------------------------------------------------------------
def test_streaming_train_and_eval_with_workers_and_epoch_reshuffle(tmp_path, model_path, prompts):
    """An IterableDataset trains through dataloader workers (read once, in order, groups intact), is reshuffled with
    `seed` every epoch like TRL's (`dataset.shuffle(seed=args.seed)` + `set_epoch`), and evaluates, alone or in a
    dict with a map-style dataset."""
    seen = []

    def recording_reward(prompts, completion_ids, **kwargs):
        seen.append(list(prompts))
        return low_id_reward(completion_ids)

    rows = prompts.select(range(6))
    stream = rows.to_iterable_dataset(num_shards=2)
    args = make_args(tmp_path, max_steps=6, per_device_train_batch_size=4, dataloader_num_workers=2)
    args.per_device_eval_batch_size, args.num_generations_eval = 2, 2
    trainer = GRPOTrainer(
        model_path, reward_funcs=recording_reward, args=args, train_dataset=stream, eval_dataset=stream
    )
    trainer.train()
    assert trainer.state.global_step == 6
    # two prompts per step, each twice in a row; two epochs of three steps each, each epoch a seeded reshuffle
    assert all(batch[0] == batch[1] and batch[2] == batch[3] for batch in seen)
    read = [batch[i] for batch in seen for i in (0, 2)]
    expected = []
    shuffled = stream.shuffle(seed=args.seed)
    for epoch in (0, 1):
        shuffled.set_epoch(epoch)
        expected += [row["prompt"] for row in shuffled]
    assert read == expected and read[:6] != read[6:]
    seen.clear()
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and len(seen) == 6
    seen.clear()
    metrics = trainer.evaluate(eval_dataset={"stream": stream, "map": rows})
    assert "eval_stream_loss" in metrics and "eval_map_loss" in metrics
    assert len(seen) == 12  # every prompt of each dataset, once per group


# ---------------------------------------------------------------------------------------------------------------------
# TRL behaviours users rely on
# ---------------------------------------------------------------------------------------------------------------------
def test_beam_search_generation_kwargs_fall_back_to_plain_generate(tmp_path, model_path, prompts):
    """`num_beams=2, do_sample=False` expands the batch inside `generate`, so the shared-prefix prefill steps aside:
    the result equals plain `generate` and training runs (deterministic: a group's completions are equal)."""
    seen = []

    def recording_reward(completion_ids, **kwargs):
        seen.extend(completion_ids)
        return low_id_reward(completion_ids)

    model = AutoModelForCausalLM.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = torch.tensor(tokenizer(["The sky is", "Two plus"], padding=True)["input_ids"])
    mask = torch.ones_like(ids)
    config = GenerationConfig(max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    rows = torch.tensor([0, 0, 1, 1])
    shared = generate_with_shared_prompts(model, ids, mask, rows, config)
    torch.testing.assert_close(
        shared, model.generate(input_ids=ids[rows], attention_mask=mask[rows], generation_config=config)
    )

    args = make_args(tmp_path, max_steps=1, generation_kwargs={"num_beams": 2, "do_sample": False})
    trainer = GRPOTrainer(model_path, reward_funcs=recording_reward, args=args, train_dataset=prompts)
    trainer.train()
    assert seen[0] == seen[1] and seen[2] == seen[3]


def test_num_generations_eval_one(tmp_path, model_path):
    """A group of one completion has no spread: advantage 0 (loss 0, not NaN) and a zero-std group, as in TRL."""
    advantages, group_std = group_advantages(torch.tensor([1.0, 3.0]), num_generations=1)
    assert advantages.tolist() == [0.0, 0.0] and group_std.tolist() == [0.0, 0.0]
    dataset = load_test_dataset("standard_prompt_only")
    args = make_args(tmp_path, num_generations_eval=1, per_device_eval_batch_size=2)
    trainer = GRPOTrainer(
        model_path,
        reward_funcs=low_id_reward,
        args=args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"].select(range(2)),
    )
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == 0.0 and metrics["eval_frac_reward_zero_std"] == 1.0


def test_reward_functions_receive_completions_without_padding(tmp_path, model_path, prompts):
    """Completions of different lengths reach the reward functions unpadded: ids end at their EOS (included), the
    texts hold no pad token."""
    received = {}

    def recording_reward(completions, completion_ids, **kwargs):
        received["texts"], received["ids"] = completions, completion_ids
        return low_id_reward(completion_ids)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos = tokenizer.eos_token_id
    # the EOS token made likely, so that lengths differ
    args = make_args(tmp_path, max_steps=1, generation_kwargs={"sequence_bias": [[[eos], 6.0]]})
    trainer = GRPOTrainer(model_path, reward_funcs=recording_reward, args=args, train_dataset=prompts)
    trainer.train()
    ids = received["ids"]
    assert len({len(row) for row in ids}) > 1
    for row in ids:
        assert tokenizer.pad_token_id not in row and (eos not in row or row.index(eos) == len(row) - 1)
    assert received["texts"] == tokenizer.batch_decode(ids, skip_special_tokens=True)


def test_one_reward_processing_class_for_several_reward_models_is_rejected(tmp_path, model_path, prompts):
    reward_model = get_model_path("tiny-Qwen2ForSequenceClassification")
    with pytest.raises(ValueError, match="must match the number of reward functions"):
        GRPOTrainer(
            model_path,
            reward_funcs=[reward_model, reward_model],
            reward_processing_classes=AutoTokenizer.from_pretrained(reward_model),
            args=make_args(tmp_path),
            train_dataset=prompts,
        )


def test_use_vllm_attribute(rollout_trainer):
    trainer, _ = rollout_trainer
    assert trainer.use_vllm is False


def test_get_high_entropy_mask_as_trl(rollout_trainer):
    """TRL's helper: tokens at or above the `threshold` quantile of the unmasked entropies (values observed with
    TRL 1.16 on these tensors)."""
    trainer, _ = rollout_trainer
    entropy = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 0.6, 0.7]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    expected = {
        0.0: [[1, 1, 1, 0], [1, 1, 1, 1]],
        0.2: [[0, 0, 1, 0], [1, 1, 1, 1]],
        0.5: [[0, 0, 0, 0], [1, 1, 1, 1]],
        0.8: [[0, 0, 0, 0], [0, 0, 1, 1]],
        1.0: [[0, 0, 0, 0], [0, 0, 0, 1]],
    }
    for threshold, rows in expected.items():
        selected = trainer.get_high_entropy_mask(entropy, mask, threshold)
        assert selected.dtype == torch.bool and selected.int().tolist() == rows, threshold
    assert not trainer.get_high_entropy_mask(entropy, torch.zeros_like(mask), 0.5).any()


def test_get_off_policy_mask_as_trl():
    """TRL's static helper: a sequence is dropped when its advantage is negative and its mean per-token
    `sampling_logp - logp` exceeds the threshold; `(B, 1)` in the mask's dtype (values observed with TRL 1.16)."""
    advantages = torch.tensor([[1.0], [-1.0], [-1.0], [0.0]])
    logps = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-3.0, -3.0], [-3.0, -3.0]])
    sampling = torch.tensor([[-1.5, -1.5], [-1.5, -0.5], [-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    keep = GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask, 0.6)
    assert keep.dtype == torch.int64 and keep.tolist() == [[1], [1], [0], [1]]
    assert GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask, 2.0).tolist() == [[1]] * 4
    assert GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask.bool(), 0.6).dtype == torch.bool
    assert (
        GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, torch.zeros_like(mask), 0.6).tolist() == [[1]] * 4
    )


def test_use_liger_kernel_without_liger_fails_before_training(tmp_path, model_path, prompts):
    """As TRL: the trainer builds, and `train()` stops before the first step with an ImportError saying how to
    install liger-kernel (never a silent fallback)."""
    from trl.import_utils import is_liger_kernel_available

    if is_liger_kernel_available():
        pytest.skip("liger-kernel is installed; this checks the error raised when it is missing")
    try:
        args = make_args(tmp_path, use_liger_kernel=True)
        trainer = GRPOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    except ImportError as error:  # transformers 4.x refuses it already (config or Trainer constructor)
        assert "pip install liger-kernel" in str(error)
        return
    before = snapshot(trainer.model)
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        trainer.train()
    assert trainer.state.global_step == 0 and not changed_params(before, trainer.model)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_liger_chunked_loss_equals_the_standard_loss(rollout_trainer, loss_type):
    """With liger-kernel installed, `use_liger_kernel=True` computes the loss with liger's chunked GRPO loss: same
    value and gradients as the standard path (off-policy batch, KL term on)."""
    pytest.importorskip(
        "liger_kernel.chunked_loss",
        reason="needs liger-kernel (`pip install --no-deps liger-kernel`: its triton dependency needs a GPU driver)",
    )
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    trainer, batch = rollout_trainer
    model = trainer.model
    args = trainer.args
    saved = (args.loss_type, args.beta, trainer.beta)
    args.loss_type, args.beta, trainer.beta = loss_type, 0.1, 0.1
    batch = {**batch, "advantages": torch.linspace(-1.0, 1.0, 8), "num_items_in_batch": batch["completion_mask"].sum()}
    with torch.no_grad():
        logps = trainer._completion_logps(model, batch)[0]
    batch["old_per_token_logps"] = logps + 0.1 * torch.randn_like(logps)  # off-policy: ratios away from 1
    batch["ref_per_token_logps"] = logps - 0.2

    def loss_and_grads():
        model.zero_grad()
        loss = trainer._compute_loss(model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    try:
        trainer.liger_grpo_loss = None
        expected_loss, expected = loss_and_grads()
        args.use_liger_kernel = True
        trainer.liger_grpo_loss = trainer._build_liger_loss(args)
        assert isinstance(trainer.liger_grpo_loss, LigerFusedLinearGRPOLoss)
        loss, grads = loss_and_grads()
    finally:
        args.use_liger_kernel, trainer.liger_grpo_loss = False, None
        args.loss_type, args.beta, trainer.beta = saved
    torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-6)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-3, atol=1e-5)


def test_evaluate_checks_the_prompt_column_of_a_raw_dataset(rollout_trainer):
    trainer, _ = rollout_trainer
    with pytest.raises(ValueError, match="'prompt' column"):
        trainer.evaluate(eval_dataset=Dataset.from_dict({"text": ["a", "b"]}))
