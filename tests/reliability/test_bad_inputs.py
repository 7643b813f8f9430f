"""Bad input is refused before training with a clear error, and nothing is written to `output_dir` first.

Each case builds what a user would (a config, a trainer, one training step for reward functions, which are only
checked when called) and names the exception type and phrases the message must contain: what was expected, what was
found. A second table lists inputs that look odd but that TRL 1.16 accepts and trains with: they must keep working.
"""

import math
import os
import re

import pytest
from datasets import Dataset

from trl.assets import get_model_path, load_test_dataset


pytestmark = pytest.mark.reliability

LM = "tiny-Qwen2ForCausalLM"
QUIET = dict(report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=1, max_steps=1)


def _config(name, output_dir, **kwargs):
    import trl

    if name in ("XPOConfig", "OnlineDPOConfig", "NashMDConfig"):
        import trl.experimental.nash_md as nash_md
        import trl.experimental.online_dpo as online_dpo
        import trl.experimental.xpo as xpo

        module = {"XPOConfig": xpo, "OnlineDPOConfig": online_dpo, "NashMDConfig": nash_md}[name]
        return getattr(module, name)(output_dir, **{**QUIET, **kwargs})
    return getattr(trl, name)(output_dir, **{**QUIET, **kwargs})


def _lm_rows(n=4):
    return load_test_dataset("standard_language_modeling", "train").to_list()[:n]


def _messages_rows(n=4):
    return load_test_dataset("conversational_language_modeling", "train").to_list()[:n]


# ---------------------------------------------------------------------------------------------------------------------
# Cases: each is a function of the output directory that must raise
# ---------------------------------------------------------------------------------------------------------------------
def images_given_to_text_only_model(output_dir):
    from PIL import Image

    from trl import SFTTrainer

    rows = [{"messages": row["messages"], "images": [Image.new("RGB", (8, 8))]} for row in _messages_rows()]
    SFTTrainer(get_model_path(LM), args=_config("SFTConfig", output_dir), train_dataset=Dataset.from_list(rows))


def images_given_to_reward_trainer(output_dir):
    from PIL import Image

    from trl import RewardTrainer

    rows = load_test_dataset("standard_preference", "train").to_list()[:4]
    rows = [{**row, "images": [Image.new("RGB", (8, 8))]} for row in rows]
    RewardTrainer(get_model_path(LM), args=_config("RewardConfig", output_dir), train_dataset=Dataset.from_list(rows))


def kto_batch_of_one_needs_kl_pairs(output_dir):
    from trl import KTOTrainer

    data = load_test_dataset("standard_unpaired_preference", "train")
    KTOTrainer(
        get_model_path(LM), args=_config("KTOConfig", output_dir, per_device_train_batch_size=1), train_dataset=data
    )


def _grpo_with_reward(output_dir, reward):
    from trl import GRPOTrainer

    args = _config("GRPOConfig", output_dir, per_device_train_batch_size=2, num_generations=2, max_completion_length=4)
    prompts = load_test_dataset("standard_prompt_only", "train")
    GRPOTrainer(get_model_path(LM), reward_funcs=reward, args=args, train_dataset=prompts).train()


def nan_reward(completions, **kwargs):
    return [float("nan")] * len(completions)


def inf_reward(completions, **kwargs):
    return [float("inf")] * len(completions)


def reward_function_returns_inf(output_dir):
    _grpo_with_reward(output_dir, inf_reward)


def zero_gradient_accumulation_steps(output_dir):
    from trl import SFTTrainer

    data = Dataset.from_list(_lm_rows())
    SFTTrainer(
        get_model_path(LM), args=_config("SFTConfig", output_dir, gradient_accumulation_steps=0), train_dataset=data
    )


def mixed_text_and_conversational_rows(output_dir):
    from trl import SFTTrainer

    texts, conversations = [row["text"] for row in _lm_rows()], [row["messages"] for row in _messages_rows()]
    data = Dataset.from_dict({"text": texts + [None] * 4, "messages": [None] * 4 + conversations})
    SFTTrainer(get_model_path(LM), args=_config("SFTConfig", output_dir), train_dataset=data)


def nonexistent_local_model_path(output_dir):
    from trl import SFTTrainer

    data = Dataset.from_list(_lm_rows())
    SFTTrainer("/nonexistent/models/my-model", args=_config("SFTConfig", output_dir), train_dataset=data)


def reward_weights_do_not_match_reward_functions(output_dir):
    from trl import GRPOTrainer

    args = _config(
        "GRPOConfig", output_dir, per_device_train_batch_size=2, num_generations=2, reward_weights=[1.0, 2.0]
    )
    prompts = load_test_dataset("standard_prompt_only", "train")
    GRPOTrainer(get_model_path(LM), reward_funcs=inf_reward, args=args, train_dataset=prompts)


def _experimental(module_name, class_name, output_dir, **kwargs):
    import importlib

    module = importlib.import_module(f"trl.experimental.{module_name}")
    return getattr(module, class_name)(output_dir, **{**QUIET, **kwargs})


def gfpo_filter_count_without_filter_function(output_dir):
    from trl.experimental.gfpo import GFPOTrainer

    args = _experimental(
        "gfpo", "GFPOConfig", output_dir, num_generations=4, per_device_train_batch_size=4, num_remains_in_group=2
    )
    prompts = load_test_dataset("standard_prompt_only", "train")
    GFPOTrainer(get_model_path(LM), reward_funcs=inf_reward, args=args, train_dataset=prompts)


def _ppo(output_dir, config_options=None, **models):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from trl.experimental.ppo import PPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(get_model_path(LM), padding_side="left")
    prompts = load_test_dataset("standard_prompt_only", "train").select(range(8))
    prompts = prompts.map(lambda row: tokenizer(row["prompt"]), remove_columns=["prompt"])
    scorer = get_model_path("tiny-Qwen2ForSequenceClassification")
    kwargs = dict(
        model=AutoModelForCausalLM.from_pretrained(get_model_path(LM)),
        ref_model=None,
        reward_model=AutoModelForSequenceClassification.from_pretrained(scorer, num_labels=1),
        value_model=AutoModelForSequenceClassification.from_pretrained(scorer, num_labels=1),
    )
    args = _experimental("ppo", "PPOConfig", output_dir, **{"total_episodes": 8, **(config_options or {})})
    PPOTrainer(args=args, processing_class=tokenizer, train_dataset=prompts, **{**kwargs, **models})


def ppo_without_reward_model(output_dir):
    _ppo(output_dir, reward_model=None)


def ppo_rollout_batch_not_divisible_into_mini_batches(output_dir):
    _ppo(output_dir, dict(per_device_train_batch_size=3, num_mini_batches=2))


def distillation_without_teacher(output_dir):
    from trl import DistillationConfig, DistillationTrainer

    args = DistillationConfig(output_dir, **QUIET)
    prompts = load_test_dataset("standard_prompt_only", "train")
    DistillationTrainer(get_model_path(LM), args=args, train_dataset=prompts).train()


def gkd_without_teacher(output_dir):
    from trl.experimental.gkd import GKDTrainer

    data = load_test_dataset("conversational_language_modeling", "train")
    GKDTrainer(model=get_model_path(LM), args=_experimental("gkd", "GKDConfig", output_dir), train_dataset=data)


def bema_update_every_zero_steps(output_dir):
    from trl import BEMACallback

    BEMACallback(update_freq=0)


CASES = [
    # (case, exception type, phrases of the message)
    (images_given_to_text_only_model, ValueError, ["'images' keys", "text-only tokenizer", "processor"]),
    (images_given_to_reward_trainer, ValueError, ["'images' column", "text-only", "remove_columns"]),
    (kto_batch_of_one_needs_kl_pairs, ValueError, ["per_device_train_batch_size=1", ">= 2"]),
    (reward_function_returns_inf, ValueError, ["'inf_reward'", "inf", "prompt"]),
    (zero_gradient_accumulation_steps, ValueError, ["gradient_accumulation_steps must be >= 1", "got 0"]),
    (mixed_text_and_conversational_rows, ValueError, ["mixes two formats", "plain-text rows", "conversational rows", "row 4"]),
    (nonexistent_local_model_path, FileNotFoundError, ["/nonexistent/models/my-model", "does not exist"]),
    (reward_weights_do_not_match_reward_functions, ValueError, ["reward_weights", "2"]),
    (lambda d: _config("SFTConfig", d, per_device_train_batch_size=0), ValueError, ["per_device_train_batch_size", ">= 1"]),
    (lambda d: _config("SFTConfig", d, learning_rate=-1e-5), ValueError, ["learning_rate must be >= 0"]),
    (lambda d: _config("SFTConfig", d, dataset_num_proc=0), ValueError, ["dataset_num_proc must be >= 1"]),
    (lambda d: _config("XPOConfig", d, alpha=-1e-5), ValueError, ["alpha", ">= 0"]),
    (lambda d: _config("DPOConfig", d, loss_type=["sigmoid", "sft"], loss_weights=[1.0]), ValueError, ["loss_weights"]),
    (lambda d: _config("DPOConfig", d, sync_ref_model=True, ref_model_sync_steps=0), ValueError, ["ref_model_sync_steps"]),
    (lambda d: _config("GRPOConfig", d, per_device_train_batch_size=3, num_generations=2), ValueError, ["divisible by num_generations"]),
    (lambda d: _config("GRPOConfig", d, num_generations=1), ValueError, ["num_generations", "at least 2"]),
    (lambda d: _config("GRPOConfig", d, min_p=1.5), ValueError, ["`min_p` has to be a float in the [0, 1] interval", "1.5"]),
    (lambda d: _config("GRPOConfig", d, temperature=0.0), ValueError, ["temperature must be > 0"]),
    (lambda d: _config("GRPOConfig", d, repetition_penalty=0.0), ValueError, ["repetition_penalty must be > 0"]),
    (lambda d: _config("GRPOConfig", d, top_p=0.0), ValueError, ["top_p must be in (0, 1]"]),
    # Trainers added after the first pass: GFPO, GRPO with replay buffer, PPO, GKD / GOLD / Distillation, BEMA
    (lambda d: _experimental("gfpo", "GFPOConfig", d, num_generations=2, per_device_train_batch_size=2, num_remains_in_group=2), ValueError, ["num_remains_in_group", "less than num_generations", "2"]),
    (lambda d: _experimental("gfpo", "GFPOConfig", d, num_generations=4, per_device_train_batch_size=4, num_remains_in_group=1), ValueError, ["num_remains_in_group must be at least 2", "got 1"]),
    (gfpo_filter_count_without_filter_function, ValueError, ["group_filter_func", "num_remains_in_group (2)"]),
    (lambda d: _experimental("grpo_with_replay_buffer", "GRPOWithReplayBufferConfig", d, replay_buffer_size=-1), ValueError, ["replay_buffer_size must be >= 0", "got -1"]),
    (ppo_without_reward_model, ValueError, ["needs a reward_model", "got None", "AutoModelForSequenceClassification"]),
    (ppo_rollout_batch_not_divisible_into_mini_batches, ValueError, ["rollout batch of 3", "num_mini_batches=2"]),
    (lambda d: _experimental("ppo", "PPOConfig", d, num_ppo_epochs=0), ValueError, ["num_ppo_epochs", "got 0"]),
    (gkd_without_teacher, ValueError, ["needs a teacher", "teacher_model"]),
    (distillation_without_teacher, ValueError, ["no teacher", "teacher_model"]),
    (lambda d: _experimental("gkd", "GKDConfig", d, lmbda=1.5), ValueError, ["lmbda", "[0.0, 1.0]", "1.5"]),
    (lambda d: _experimental("gkd", "GKDConfig", d, beta=-0.5), ValueError, ["beta", "[0.0, 1.0]", "-0.5"]),
    (lambda d: _experimental("gold", "GOLDConfig", d, lmbda=-0.1), ValueError, ["lmbda", "[0.0, 1.0]", "-0.1"]),
    (lambda d: _config("DistillationConfig", d, beta=2.0), ValueError, ["beta must be in [0.0, 1.0]", "2.0"]),
    (lambda d: _config("DistillationConfig", d, temperature=0.0), ValueError, ["temperature must be > 0"]),
    (bema_update_every_zero_steps, ValueError, ["update_freq", "positive", "got 0"]),
]  # fmt: skip


def _case_id(case):
    function = case[0]
    if function.__name__ != "<lambda>":
        return function.__name__
    return "-".join(case[2][0].split()[:3])


@pytest.mark.parametrize("case,error,phrases", CASES, ids=[_case_id(case) for case in CASES])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, case, error, phrases):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    with pytest.raises(error) as raised:
        case(str(output_dir))
    message = str(raised.value)
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in: {message}"
    assert os.listdir(output_dir) == []


# ---------------------------------------------------------------------------------------------------------------------
# Legal inputs (TRL 1.16 accepts them and trains): they must not be refused
# ---------------------------------------------------------------------------------------------------------------------
LEGAL_CONFIGS = [
    ("DPOConfig", dict(beta=0.0)),
    ("DPOConfig", dict(label_smoothing=0.5)),
    ("DPOConfig", dict(ref_model_sync_steps=0)),  # unused without sync_ref_model
    ("KTOConfig", dict(desirable_weight=0.0)),
    ("SFTConfig", dict(max_grad_norm=-1.0)),  # transformers: no clipping
    ("SFTConfig", dict(learning_rate=0.0)),
    ("GRPOConfig", dict(beta=0.0, epsilon_high=0.1)),
    ("GRPOConfig", dict(min_p=0.0)),
]


@pytest.mark.parametrize("name,kwargs", LEGAL_CONFIGS, ids=[f"{n}-{next(iter(k))}" for n, k in LEGAL_CONFIGS])
def test_legal_config_values_are_accepted(tmp_path, name, kwargs):
    _config(name, str(tmp_path), **kwargs)


# Values TRL 1.16 trains with although they turn a loss term around: accepted with a warning, never refused.
UNUSUAL_CONFIGS = [
    ("DPOConfig", dict(beta=-0.1), "beta=-0.1 is below 0.0"),
    ("KTOConfig", dict(beta=-1.0), "beta=-1.0 is below 0.0"),
    ("GRPOConfig", dict(beta=-0.04, num_generations=2), "beta=-0.04 is below 0.0"),
    ("RLOOConfig", dict(beta=-0.04, num_generations=2), "beta=-0.04 is below 0.0"),
    ("OnlineDPOConfig", dict(beta=[0.1, -0.1]), "beta=[0.1, -0.1] is below 0.0"),
    ("KTOConfig", dict(desirable_weight=-1.0), "a negative weight turns that part of the loss around"),
    ("RewardConfig", dict(center_rewards_coefficient=-0.1), "center_rewards_coefficient=-0.1 is negative"),
    ("KTOConfig", dict(sync_ref_model=True, ref_model_mixup_alpha=1.5), "ref_model_mixup_alpha=1.5 is outside [0, 1]"),
    ("DPOConfig", dict(ld_alpha=2.0), "ld_alpha=2.0 is outside [0, 1]"),
    ("GRPOConfig", dict(top_p=1.5, num_generations=2), "top_p=1.5 is above 1"),
    ("GRPOConfig", dict(delta=0.5, num_generations=2), "delta=0.5 caps the importance ratio"),
    ("GRPOConfig", dict(epsilon=-0.1, num_generations=2), "a negative clipping range"),
    ("GRPOConfig", dict(num_completions_to_print=-1, num_generations=2), "num_completions_to_print=-1 is negative"),
    ("RLOOConfig", dict(reward_clip_range=(1.0, -1.0), num_generations=2), "has min > max"),
    ("GRPOConfig", dict(top_entropy_quantile=0.0, num_generations=2), "top_entropy_quantile=0.0 keeps only"),
    ("GRPOConfig", dict(entropy_coef_min=0.5, entropy_coef_max=0.1, num_generations=2), "exceeds entropy_coef_max"),
    (
        "GRPOConfig",
        dict(entropy_coef_min=0.5, entropy_coef_max=0.1, use_adaptive_entropy=True, num_generations=2),
        "moves outside the range they mean",
    ),  # fmt: skip
    ("GRPOConfig", dict(num_generations_eval=0, num_generations=2), "num_generations_eval=0 is read as unset"),
]


@pytest.mark.parametrize(
    "name,kwargs,phrase", UNUSUAL_CONFIGS, ids=[f"{n}-{next(iter(k))}" for n, k, _ in UNUSUAL_CONFIGS]
)
def test_values_trl_trains_with_warn_instead_of_failing(tmp_path, name, kwargs, phrase):
    with pytest.warns(UserWarning, match=re.escape(phrase)):
        config = _config(name, str(tmp_path), **kwargs)
    for key, value in kwargs.items():
        assert getattr(config, key) == value


def test_kto_batch_of_one_is_legal_without_kl_term(tmp_path):
    from trl import KTOTrainer

    data = load_test_dataset("standard_unpaired_preference", "train")
    args = _config("KTOConfig", str(tmp_path), per_device_train_batch_size=1, loss_type="apo_zero_unpaired")
    trainer = KTOTrainer(get_model_path(LM), args=args, train_dataset=data)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(math.isfinite(loss) for loss in losses)


def test_reward_function_may_return_none_for_completions_it_does_not_score(tmp_path):
    # TRL's convention: None means "does not apply"; another function scores those completions.
    def every_other(completions, **kwargs):
        return [1.0 if i % 2 else None for i in range(len(completions))]

    def constant(completions, **kwargs):
        return [0.5] * len(completions)

    from trl import GRPOTrainer

    args = _config(
        "GRPOConfig", str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=4
    )
    prompts = load_test_dataset("standard_prompt_only", "train")
    trainer = GRPOTrainer(get_model_path(LM), reward_funcs=[every_other, constant], args=args, train_dataset=prompts)
    trainer.train()
    assert trainer.state.global_step == 1


def test_nan_reward_counts_like_none_as_in_trl(tmp_path):
    """TRL reads a NaN reward as "no reward" (NaN-aware means; all-NaN rows get advantage 0): the run trains, and
    says once that the function returned NaN."""
    import trl.trainer.online_rewards as online_rewards
    from trl import GRPOTrainer

    online_rewards._WARNED_NAN_REWARDS.discard("nan_reward")

    def constant(completions, **kwargs):
        return [0.5] * len(completions)

    args = _config(
        "GRPOConfig", str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=4
    )
    prompts = load_test_dataset("standard_prompt_only", "train")
    trainer = GRPOTrainer(get_model_path(LM), reward_funcs=[nan_reward, constant], args=args, train_dataset=prompts)
    with pytest.warns(UserWarning, match="returned NaN"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_hub_ids_and_existing_paths_are_not_taken_for_missing_paths(tmp_path):
    from trl.models.loading import check_local_path

    for model_id in ("gpt2", "Qwen/Qwen2.5-0.5B", str(tmp_path), get_model_path(LM)):
        check_local_path(model_id)
    for missing in (str(tmp_path / "missing"), "./missing-model", "~/no/such/model", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            check_local_path(missing)
