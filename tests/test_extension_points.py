"""TRL's extension points: protected hooks a plugin overrides exist with TRL 1.16's signatures, are called where TRL
calls them, with TRL's data, and their effect shows in the run (see docs/architecture.md, "Writing a plugin").

The hook lists and signatures below are those of `../shared/api/extension_points.md`; a subclass that overrides a
hook must change the run exactly as under TRL, so each test here is written the way a plugin would be.
"""

import inspect
from collections import Counter

import pytest
import torch
from trainer_utils import GROUP_ARGS, args_builder, train_logs

from trl import (
    DistillationConfig,
    DistillationTrainer,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOTrainer,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTTrainer,
)
from trl.assets import get_model_path


def _params(method) -> list[str]:
    return [name for name in inspect.signature(method).parameters if name != "self"]


# ---------------------------------------------------------------------------------------------------------------------
# Signatures: parameter names and order, as TRL 1.16 declares them
# ---------------------------------------------------------------------------------------------------------------------
LOGPS_PARAMS = [
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
]
SIGNATURES = {
    GRPOTrainer: {
        "training_step": ["model", "inputs", "num_items_in_batch"],
        "_prepare_inputs": ["generation_batch"],
        "_generate_and_score_completions": ["inputs"],
        "_generate": ["prompts"],
        "_tokenize_prompts": ["prompts"],
        "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"],
        "_get_per_token_logps_and_entropies": LOGPS_PARAMS,
        "_calculate_rewards": ["inputs", "prompts", "completions", "completion_ids_list"],
        "_log_completion_extra": ["column", "values"],
        "_log_metric": ["name", "value"],
        "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
        "_compute_loss": ["model", "inputs"],
        "get_high_entropy_mask": ["entropies", "mask", "threshold"],
        "get_off_policy_mask": [
            "advantages",
            "per_token_logps",
            "sampling_per_token_logps",
            "mask",
            "off_policy_threshold",
        ],
        "prediction_step": ["model", "inputs", "prediction_loss_only", "ignore_keys"],
        "log": ["logs", "start_time"],
        "_save_checkpoint": ["model", "trial"],
        "_load_optimizer_and_scheduler": ["checkpoint"],
    },
    RLOOTrainer: {
        "_generate_and_score_completions": ["inputs"],
        "_generate": ["prompts"],
        "_tokenize_prompts": ["prompts"],
        "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields"],
        "_get_per_token_logps_and_entropies": LOGPS_PARAMS,
        "_calculate_rewards": ["inputs", "prompts", "completions", "completion_ids_list"],
        "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
        "_compute_loss": ["model", "inputs"],
    },
    DistillationTrainer: {
        "_generate_and_score_completions": ["inputs"],
        "_generate": ["prompts"],
        "_tokenize_prompts": ["prompts"],
        "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields", "has_tool_images"],
        "_prepare_inputs": ["generation_batch"],
        "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
        "_get_last_hidden_state": [
            "unwrapped_model",
            "input_ids",
            "attention_mask",
            "logits_to_keep",
            "pixel_values",
            "image_grid_thw",
            "pixel_attention_mask",
            "spatial_shapes",
            "image_sizes",
            "token_type_ids",
            "mm_token_type_ids",
            "image_position_ids",
        ],
    },
    DPOTrainer: {
        "_prepare_dataset": ["dataset", "processing_class", "args", "dataset_name"],
        "compute_ref_log_probs": ["model", "inputs"],
        "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
        "_compute_loss": ["model", "inputs", "return_outputs"],
        "prediction_step": ["model", "inputs", "prediction_loss_only", "ignore_keys"],
    },
    KTOTrainer: {
        "_prepare_dataset": ["dataset", "processing_class", "args", "dataset_name"],
        "compute_ref_log_probs": ["model", "inputs"],
        "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
        "_compute_loss": ["model", "inputs", "return_outputs"],
    },
    SFTTrainer: {
        "_prepare_dataset": ["dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"],
        "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
        "prediction_step": ["model", "inputs", "prediction_loss_only", "ignore_keys"],
    },
    RewardTrainer: {
        "_prepare_dataset": ["dataset", "processing_class", "args", "dataset_name"],
        "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
    },
}


@pytest.mark.parametrize(
    "trainer_class, method",
    [(cls, name) for cls, methods in SIGNATURES.items() for name in methods],
    ids=lambda value: value if isinstance(value, str) else value.__name__,
)
def test_hook_signature_matches_trl(trainer_class, method):
    assert _params(getattr(trainer_class, method)) == SIGNATURES[trainer_class][method]


def test_class_attributes_match_trl():
    assert GRPOTrainer.loss_is_scaled_for_ga is True
    assert DistillationTrainer.loss_is_scaled_for_ga is True
    assert RLOOTrainer.loss_is_scaled_for_ga is False
    assert GRPOTrainer._tag_names == ["trl", "grpo"] and RLOOTrainer._tag_names == ["trl", "rloo"]
    # Static as in TRL (plugins call them on the class).
    assert isinstance(inspect.getattr_static(GRPOTrainer, "get_off_policy_mask"), staticmethod)


# ---------------------------------------------------------------------------------------------------------------------
# A recording subclass: every listed hook counts its calls and defers to the base
# ---------------------------------------------------------------------------------------------------------------------
def recording_subclass(base, methods):
    calls = Counter()

    def wrap(name):
        def method(self, *args, **kwargs):
            calls[name] += 1
            return getattr(super(subclass, self), name)(*args, **kwargs)

        method.__name__ = name
        return method

    subclass = type(f"Recording{base.__name__}", (base,), {name: wrap(name) for name in methods})
    return subclass, calls


def constant_length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


GRPO_STEP_HOOKS = [
    "training_step",
    "_prepare_inputs",
    "_generate_and_score_completions",
    "_generate",
    "_tokenize_prompts",
    "_generate_single_turn",
    "_get_per_token_logps_and_entropies",
    "_calculate_rewards",
    "compute_loss",
    "_compute_loss",
    "log",
    "get_train_dataloader",
    "_get_train_sampler",
]


def _grpo(tmp_path, prompts, trainer_class=GRPOTrainer, reward=constant_length_reward, **overrides):
    settings = {**GROUP_ARGS, **overrides}
    args = args_builder(GRPOConfig)(tmp_path, **settings)
    return trainer_class(
        get_model_path("tiny-Qwen2ForCausalLM"), reward_funcs=reward, args=args, train_dataset=prompts
    )


@pytest.mark.parametrize(
    "settings, expected",
    [
        # One round per optimizer step, on-policy: no old log-prob pass; one loss pass per micro-step.
        (
            dict(max_steps=2),
            {"_generate_and_score_completions": 2, "_get_per_token_logps_and_entropies": 2, "compute_loss": 2},
        ),
        # TRL's traced run: s=2, g=1, 2 steps: step 1 generates (old log-probs too, the round spans two optimizer
        # steps), step 2 reads the buffer.
        (
            dict(max_steps=2, per_device_train_batch_size=2, steps_per_generation=2),
            {"_generate_and_score_completions": 1, "_get_per_token_logps_and_entropies": 3, "compute_loss": 2},
        ),
        # beta != 0: one reference pass per round.
        (
            dict(max_steps=2, beta=0.1),
            {"_generate_and_score_completions": 2, "_get_per_token_logps_and_entropies": 4, "compute_loss": 2},
        ),
    ],
    ids=["on_policy", "two_steps_per_generation", "with_reference"],
)
def test_grpo_overridden_hooks_are_called_as_in_trl(tmp_path, prompts, settings, expected):
    trainer_class, calls = recording_subclass(GRPOTrainer, GRPO_STEP_HOOKS)
    trainer = _grpo(tmp_path, prompts, trainer_class, **settings)
    trainer.train()
    rounds = expected["_generate_and_score_completions"]
    assert calls["training_step"] == calls["_prepare_inputs"] == calls["_compute_loss"] == 2
    for name, count in expected.items():
        assert calls[name] == count, name
    for name in ("_generate", "_tokenize_prompts", "_generate_single_turn", "_calculate_rewards"):
        assert calls[name] == rounds, name
    assert calls["log"] >= 2 and calls["get_train_dataloader"] == 1 and calls["_get_train_sampler"] == 1


def test_grpo_configuration_dependent_hooks(tmp_path, prompts):
    """Hooks TRL calls only in some configurations are called in them: the entropy mask, the off-policy mask, the
    reward-function callbacks, evaluation, checkpoint save and resume."""
    hooks = [
        "get_high_entropy_mask",
        "get_off_policy_mask",
        "_log_completion_extra",
        "_log_metric",
        "prediction_step",
        "get_eval_dataloader",
        "_get_eval_sampler",
        "_save_checkpoint",
        "_load_optimizer_and_scheduler",
    ]
    trainer_class, calls = recording_subclass(GRPOTrainer, hooks)
    trainer_class.get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)  # static in TRL

    def reward(completion_ids, log_extra, log_metric, **kwargs):
        log_extra("length", [len(ids) for ids in completion_ids])
        log_metric("plugin/seen", float(len(completion_ids)))
        return [float(len(ids)) for ids in completion_ids]

    args = args_builder(GRPOConfig)(
        tmp_path,
        **{**GROUP_ARGS, "max_steps": 2},
        top_entropy_quantile=0.5,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=1,
    )
    model = get_model_path("tiny-Qwen2ForCausalLM")
    trainer = trainer_class(model, reward_funcs=reward, args=args, train_dataset=prompts, eval_dataset=prompts)
    trainer.train()
    for name in (
        "get_high_entropy_mask",
        "_log_completion_extra",
        "_log_metric",
        "prediction_step",
        "_save_checkpoint",
    ):
        assert calls[name] >= 1, name
    assert calls["get_eval_dataloader"] >= 1 and calls["_get_eval_sampler"] >= 1
    assert "plugin/seen" in train_logs(trainer)[0]

    resumed = trainer_class(model, reward_funcs=reward, args=args, train_dataset=prompts, eval_dataset=prompts)
    resumed.args.max_steps = 3
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert calls["_load_optimizer_and_scheduler"] >= 1


# ---------------------------------------------------------------------------------------------------------------------
# Plugin-shaped subclasses, written from the contract
# ---------------------------------------------------------------------------------------------------------------------
class BonusRewards(GRPOTrainer):
    """Reweights the rewards after the base computed them (reads `reward_weights`, as a plugin does)."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        weights = self.reward_weights.to(rewards.device)
        return rewards * weights + 100.0


def test_calculate_rewards_override_changes_logged_reward(tmp_path, prompts):
    plain = _grpo(tmp_path / "plain", prompts)
    plain.train()
    bonus = _grpo(tmp_path / "bonus", prompts, BonusRewards)
    bonus.train()
    plain_log, bonus_log = train_logs(plain)[0], train_logs(bonus)[0]
    assert bonus_log["reward"] == pytest.approx(plain_log["reward"] + 100.0)
    assert bonus_log["rewards/constant_length_reward/mean"] == pytest.approx(plain_log["reward"] + 100.0)


class HintCarrier(GRPOTrainer):
    """Adds a per-row key to the batch and reads it in `compute_loss` (a teacher-input plugin's pattern)."""

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        batch["row_hint"] = batch["completion_ids"][:, 0].clone()
        batch["row_weight"] = torch.ones(batch["completion_ids"].shape[0])
        return batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The key travelled with its rows through the shuffle and split.
        assert torch.equal(inputs["row_hint"], inputs["completion_ids"][:, 0])
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["plugin/rows"].append(float(inputs["row_weight"].sum()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_added_batch_key_travels_to_compute_loss(tmp_path, prompts):
    trainer = _grpo(tmp_path, prompts, HintCarrier, per_device_train_batch_size=2, steps_per_generation=2)
    trainer.train()
    logs = train_logs(trainer)
    assert [log["plugin/rows"] for log in logs] == [2.0, 2.0]


class FixedCompletions(GRPOTrainer):
    """Replaces generation: every row gets the same three tokens, ending with the end-of-sequence token."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        assert len(prompt_ids) % num_generations == 0
        eos = self._tokenizer.eos_token_id
        return [[5, 6, eos] for _ in prompt_ids], None


def test_generate_single_turn_override_replaces_generation(tmp_path, prompts):
    trainer = _grpo(tmp_path, prompts, FixedCompletions)
    trainer.train()
    for log in train_logs(trainer):
        assert log["completions/mean_length"] == 3.0 and log["completions/clipped_ratio"] == 0.0


class MaskedRows(GRPOTrainer):
    """Drops rows from the loss after scoring by zeroing their mask and their tokens in `num_items_in_batch`
    (an adaptive-budget plugin's pattern); records what `_compute_loss` receives."""

    seen = []

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        dropped = batch["completion_mask"][1::2]
        batch["num_items_in_batch"] = batch["num_items_in_batch"] - dropped.sum()
        batch["completion_mask"][1::2] = 0
        batch["advantages"] = torch.full_like(batch["advantages"], 0.5)  # a plugin's own advantages
        return batch

    def _compute_loss(self, model, inputs):
        MaskedRows.seen.append((inputs["completion_mask"].sum().item(), inputs["num_items_in_batch"].item()))
        assert torch.all(inputs["advantages"] == 0.5)
        return super()._compute_loss(model, inputs)


def test_edited_mask_and_advantages_reach_the_loss(tmp_path, prompts):
    MaskedRows.seen = []
    trainer = _grpo(tmp_path, prompts, MaskedRows, max_steps=1)
    trainer.train()
    ((mask_tokens, items),) = MaskedRows.seen
    assert mask_tokens == items


def test_per_token_logps_hook_returns_three_values(tmp_path, prompts):
    """Three values, as TRL 1.16: a caller unpacking two fails the same way under TRL."""
    trainer = _grpo(tmp_path, prompts)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([prompts[i] for i in (0, 0, 1, 1)])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].shape[1]
    logps, entropies, aux_loss = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, mask, logits_to_keep=width, compute_entropy=True
    )
    assert logps.shape == entropies.shape == (4, width) and aux_loss is None
    assert torch.all(logps[batch["completion_mask"] == 0] == 0)
    chunked = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width, batch_size=1)
    torch.testing.assert_close(chunked[0], logps, rtol=1e-5, atol=1e-6)
    assert chunked[1] is None
    with pytest.raises(ValueError):
        logps, entropies = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, logits_to_keep=width)


class OwnReference(GRPOTrainer):
    """Turns the KL off and keeps its own reference model (a self-distillation plugin's pattern)."""

    def __init__(self, *args, **kwargs):
        kwargs["args"].beta = 0.0
        super().__init__(*args, **kwargs)
        self.ref_model = self.model


def test_reference_passes_follow_beta_not_ref_model(tmp_path, prompts):
    trainer = _grpo(tmp_path, prompts, OwnReference, beta=0.1, max_steps=1)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([prompts[i] for i in (0, 0, 1, 1)])
    assert "ref_per_token_logps" not in batch and trainer.ref_model is trainer.model


def test_reward_funcs_are_read_at_call_time(tmp_path, prompts):
    """A plugin may replace reward functions after construction; the names stay those computed at init."""
    trainer = _grpo(tmp_path, prompts, max_steps=1)
    trainer.reward_funcs[0] = lambda completions, **kwargs: [7.0] * len(completions)
    trainer.train()
    log = train_logs(trainer)[0]
    assert log["reward"] == 7.0 and "rewards/constant_length_reward/mean" in log


def test_grpo_instance_attributes(tmp_path, prompts):
    trainer = _grpo(tmp_path, prompts, beta=0.0)
    assert set(trainer._metrics) == {"train", "eval"}
    assert trainer.reward_weights.dtype == torch.float32 and trainer.reward_weights.device.type == "cpu"
    assert trainer.reward_processing_classes == [None] and trainer.reward_func_names == ["constant_length_reward"]
    assert trainer.num_generations == 2 and trainer.num_generations_eval == 2
    assert trainer._is_vlm is False and trainer._tokenizer is trainer.processing_class
    assert trainer.ref_model is None and trainer.use_vllm is False
    assert trainer.max_completion_length == 6 and trainer.generation_config.max_new_tokens == 6
    assert not hasattr(trainer, "max_prompt_length")  # plugins probe it with getattr: absent in TRL 1.16
    assert not hasattr(trainer, "_last_loaded_step") and trainer.vllm_generation is None  # vLLM-only, as in TRL
    assert trainer.epsilon_low == trainer.args.epsilon and trainer.epsilon_high == trainer.args.epsilon  # resolved
    for name in ("beta", "loss_type", "scale_rewards", "importance_sampling_level"):
        assert getattr(trainer, name) == getattr(trainer.args, name), name
    for name in ("num_iterations", "temperature", "top_p", "top_k", "mask_truncated_completions"):
        assert getattr(trainer, name) == getattr(trainer.args, name), name


# ---------------------------------------------------------------------------------------------------------------------
# RLOO and distillation: the same seams
# ---------------------------------------------------------------------------------------------------------------------
def test_rloo_overridden_hooks_are_called(tmp_path, prompts):
    hooks = ["_generate_and_score_completions", "_generate", "_tokenize_prompts", "_generate_single_turn"]
    hooks += ["_calculate_rewards", "_get_per_token_logps_and_entropies", "compute_loss", "_compute_loss"]
    trainer_class, calls = recording_subclass(RLOOTrainer, hooks)
    args = args_builder(RLOOConfig)(tmp_path, **GROUP_ARGS)
    model = get_model_path("tiny-Qwen2ForCausalLM")
    trainer_class(model, reward_funcs=constant_length_reward, args=args, train_dataset=prompts).train()
    for name in hooks:
        assert calls[name] >= 2, name


def test_distillation_overridden_hooks_are_called(tmp_path, prompts):
    hooks = ["_generate_and_score_completions", "_generate", "_tokenize_prompts", "_generate_single_turn"]
    hooks += ["_prepare_inputs", "compute_loss", "_compute_loss", "_get_last_hidden_state"]
    trainer_class, calls = recording_subclass(DistillationTrainer, hooks)
    args = args_builder(DistillationConfig)(
        tmp_path, max_steps=2, per_device_train_batch_size=2, max_completion_length=6, learning_rate=1e-2
    )
    model = get_model_path("tiny-Qwen2ForCausalLM")
    teacher = get_model_path("small-Qwen2ForCausalLM")  # a separate model of the same vocabulary
    trainer = trainer_class(model=model, teacher_model=teacher, args=args, train_dataset=prompts)
    trainer.train()
    for name in hooks:
        assert calls[name] >= 2, name


class EarlyStopBonus(GRPOTrainer):
    """The worked plugin of docs/grpo_trainer.md ("Writing a plugin")."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        eos = self._tokenizer.eos_token_id
        local = torch.tensor(
            [
                float(bool(ids) and ids[-1] == eos and len(ids) < self.max_completion_length)
                for ids in completion_ids_list
            ]
        )
        stopped = self.accelerator.gather(local.to(rewards.device))
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["early_stop/frac"].append(stopped.mean().item())
        return rewards + 0.5 * stopped.unsqueeze(1)


def test_documented_plugin_logs_its_metric(tmp_path, prompts):
    trainer = _grpo(tmp_path, prompts, EarlyStopBonus, eval_strategy="no")
    trainer.train()
    assert all("early_stop/frac" in log for log in train_logs(trainer))
    metrics = trainer.evaluate(eval_dataset=prompts.select(range(2)))
    assert "eval_early_stop/frac" in metrics


@pytest.mark.parametrize("trainer_name", ["DPO", "KTO"])
def test_offline_compute_loss_hook_is_called(tmp_path, trainer_name, unpaired):
    """DPO and KTO route `compute_loss` through TRL's `_compute_loss(model, inputs, return_outputs)`."""
    from trainer_utils import PREFERENCE_ARGS

    import trl
    from trl.assets import load_test_dataset

    base = getattr(trl, f"{trainer_name}Trainer")
    trainer_class, calls = recording_subclass(base, ["compute_loss", "_compute_loss"])
    args = args_builder(getattr(trl, f"{trainer_name}Config"))(tmp_path, **PREFERENCE_ARGS)
    data = load_test_dataset("standard_preference", split="train") if trainer_name == "DPO" else unpaired["train"]
    trainer = trainer_class(get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=data)
    trainer.train()
    assert calls["compute_loss"] == calls["_compute_loss"] == 2


def test_rloo_subclass_overriding_a_loss_hook_gets_trl_rollout_logps(tmp_path, prompts):
    """On-policy without KL the rollout scoring pass is skipped (same values), unless a subclass overrides a hook that
    could see it: then the batch carries TRL's `old_logps`, as under TRL."""
    seen = []

    class ReadsOldLogps(RLOOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append("old_logps" in inputs)
            return super()._compute_loss(model, inputs)

    args = args_builder(RLOOConfig)(tmp_path, **{**GROUP_ARGS, "beta": 0.0, "max_steps": 1})
    model = get_model_path("tiny-Qwen2ForCausalLM")
    ReadsOldLogps(model, reward_funcs=constant_length_reward, args=args, train_dataset=prompts).train()
    assert seen == [True]
    plain = RLOOTrainer(model, reward_funcs=constant_length_reward, args=args, train_dataset=prompts)
    assert not plain._needs_rollout_logps()


OFFLINE_HOOKS = {
    "SFT": ["training_step", "compute_loss", "prediction_step", "evaluate", "log", "_save_checkpoint"],
    "DPO": ["training_step", "compute_loss", "_compute_loss", "compute_ref_log_probs", "prediction_step", "log"],
    "KTO": ["training_step", "compute_loss", "_compute_loss", "compute_ref_log_probs", "prediction_step", "log"],
    "Reward": ["training_step", "compute_loss", "evaluate", "log", "_save_checkpoint"],
}
# Hooks TRL calls outside the step, at construction: `_prepare_dataset` (before `Trainer.__init__`) and
# `_set_signature_columns_if_needed` (when the dataloader is built).
OFFLINE_CONSTRUCTION_HOOKS = ["_prepare_dataset", "_set_signature_columns_if_needed"]


@pytest.mark.parametrize("trainer_name", sorted(OFFLINE_HOOKS))
def test_offline_overridden_hooks_are_called(tmp_path, trainer_name, unpaired):
    import trl
    from trl.assets import load_test_dataset

    hooks = OFFLINE_HOOKS[trainer_name] + OFFLINE_CONSTRUCTION_HOOKS
    base = getattr(trl, f"{trainer_name}Trainer")
    trainer_class, calls = recording_subclass(base, hooks)
    data = {
        "SFT": load_test_dataset("standard_language_modeling", split="train"),
        "DPO": load_test_dataset("standard_preference", split="train"),
        "KTO": unpaired["train"],
        "Reward": load_test_dataset("standard_preference", split="train"),
    }[trainer_name]
    args = args_builder(getattr(trl, f"{trainer_name}Config"))(
        tmp_path,
        max_steps=2,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
    )
    model = get_model_path(
        "tiny-Qwen2ForSequenceClassification" if trainer_name == "Reward" else "tiny-Qwen2ForCausalLM"
    )
    trainer = trainer_class(model, args=args, train_dataset=data, eval_dataset=data.select(range(4)))
    assert calls["_prepare_dataset"] >= 2  # train and eval, at construction
    trainer.train()
    for name in hooks:
        assert calls[name] >= 1, name
    assert calls["training_step"] == 2


def test_override_of_a_trl_hook_this_trainer_never_calls_is_reported(tmp_path, prompts):
    """A TRL hook this implementation has no call site for: overriding it warns at construction (never silent)."""

    class ToolLoopPlugin(GRPOTrainer):
        def _tool_call_loop(self, *args, **kwargs):
            raise AssertionError("never called")

    with pytest.warns(UserWarning, match="_tool_call_loop.*no effect"):
        _grpo(tmp_path, prompts, ToolLoopPlugin)
