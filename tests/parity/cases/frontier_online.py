"""Parity cases: TRL 1.16's newer online methods built on this project's online trainers (GMPO; A2PO)."""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, case, register, run_trainer, to_jsonable
from .online import ONLINE_ARGS, RECORDED_COMPLETION_IDS, toy_reward


# ---------------------------------------------------------------------------------------------------------------------
# GMPO: GRPO's rollouts on the toy reward, the geometric-mean loss
# ---------------------------------------------------------------------------------------------------------------------
def gmpo_case(ctx, *, max_steps: int = 2, config_class: str = "GMPOConfig", evaluate: bool = False, **config) -> dict:
    import trl
    from trl.experimental import gmpo

    config_cls = getattr(gmpo, config_class, None) or getattr(trl, config_class)
    args = config_cls(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": max_steps, **config})
    RECORDED_COMPLETION_IDS.clear()
    trainer = gmpo.GMPOTrainer(
        model=ctx.model(QWEN),
        reward_funcs=toy_reward,
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 16),
        eval_dataset=ctx.dataset("standard_prompt_only", "test", 2) if evaluate else None,
    )
    out = run_trainer(trainer, evaluate=evaluate)
    out["completion_ids"] = list(RECORDED_COMPLETION_IDS)
    out["epsilon"] = [trainer.epsilon_low, trainer.epsilon_high]
    return out


for _name, _kwargs in {
    "toy_reward": {},
    "beta=0.04": dict(beta=0.04),
    "num_iterations=2": dict(num_iterations=2, max_steps=3),
    "num_iterations=2/epsilon=0.05/epsilon_high=0.1": dict(
        num_iterations=2, max_steps=3, epsilon=0.05, epsilon_high=0.1
    ),
    "num_iterations=2/beta=0.04": dict(num_iterations=2, beta=0.04, max_steps=3),
    "top_entropy_quantile=0.5": dict(top_entropy_quantile=0.5, num_iterations=2, epsilon=0.05),
    "gradient_accumulation_steps=2": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
    "loss_type=grpo_ignored": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "grpo_config": dict(config_class="GRPOConfig", num_iterations=2, max_steps=3),
    "evaluate": dict(evaluate=True, max_steps=1),
}.items():
    register(f"gmpo/{_name}", partial(gmpo_case, **_kwargs))


@case("gmpo/defaults")
def _gmpo_defaults(ctx):
    import dataclasses

    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    fields = {f.name: f.default for f in dataclasses.fields(GMPOConfig) if f.name in ("epsilon", "epsilon_high")}
    return to_jsonable({"fields": fields, "tags": list(GMPOTrainer._tag_names), "name": GMPOTrainer._name})


# ---------------------------------------------------------------------------------------------------------------------
# A2PO: reference samples give V*(x), then one policy sample per prompt regresses the optimal advantage
# ---------------------------------------------------------------------------------------------------------------------
A2PO_ARGS = dict(
    COMMON_ARGS,
    per_device_train_batch_size=2,
    per_device_eval_batch_size=2,
    max_completion_length=8,
    num_value_samples=4,
    max_steps=2,
)
RECORDED_A2PO: list[dict] = []


def a2po_parity_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 for a completion text of odd length (about half of them), recording what the function received."""
    RECORDED_A2PO.append({"prompts": prompts, "completions": completions, "columns": sorted(kwargs)})
    return [float(len(text) % 2) for text in completions]


def a2po_case(ctx, *, rows: int = 4, evaluate: bool = False, dataset: str = "standard_prompt_only", **config) -> dict:
    import torch

    from trl.experimental.a2po import A2POConfig, A2POTrainer

    args = A2POConfig(output_dir=ctx.tmpdir(), **{**A2PO_ARGS, **config})
    RECORDED_A2PO.clear()
    torch.manual_seed(0)
    trainer = A2POTrainer(
        model=ctx.model(QWEN),
        reward_funcs=a2po_parity_reward,
        args=args,
        train_dataset=ctx.dataset(dataset, "train", rows),
        eval_dataset=ctx.dataset(dataset, "test", 2) if evaluate else None,
    )
    out = run_trainer(trainer, evaluate=evaluate)
    out["rewards_seen"] = list(RECORDED_A2PO)
    out["padding_side"] = trainer.processing_class.padding_side
    return to_jsonable(out)


for _name, _kwargs in {
    "defaults": {},
    "evaluate": dict(evaluate=True),
    "filter_all_incorrect=False": dict(filter_all_incorrect=False, rows=6, max_steps=3),
    "beta1=2.0/beta2=0.1": dict(beta1=2.0, beta2=0.1),
    "temperature=0.7/top_k=5": dict(temperature=0.7, top_k=5, beta2=0.5),
    "gradient_accumulation_steps=2": dict(gradient_accumulation_steps=2, per_device_train_batch_size=1, rows=6),
    "conversational": dict(dataset="conversational_prompt_only", evaluate=True, per_device_eval_batch_size=1),
    "reward_weights=0.5/max_prompt_length=4": dict(reward_weights=[0.5], max_prompt_length=4),
}.items():
    register(f"a2po/{_name}", partial(a2po_case, **_kwargs))


@case("a2po/defaults_config")
def _a2po_defaults(ctx):
    import dataclasses

    from trl.experimental.a2po import A2POConfig, A2POTrainer

    names = (
        "remove_unused_columns",
        "model_init_kwargs",
        "trust_remote_code",
        "max_prompt_length",
        "max_completion_length",
        "temperature",
        "top_p",
        "top_k",
        "num_value_samples",
        "beta1",
        "filter_all_incorrect",
        "beta2",
        "reward_weights",
        "learning_rate",
    )
    fields = {f.name: f.default for f in dataclasses.fields(A2POConfig) if f.name in names}
    return to_jsonable(
        {
            "fields": fields,
            "tags": list(A2POTrainer._tag_names),
            "name": A2POTrainer._name,
            "paper": A2POTrainer._paper,
        }
    )


# ---------------------------------------------------------------------------------------------------------------------
# SSD (TRL 1.12): one sample per prompt, cross-entropy on the model's own completions
# ---------------------------------------------------------------------------------------------------------------------
SSD_ARGS = dict(COMMON_ARGS, per_device_train_batch_size=2, per_device_eval_batch_size=2, max_completion_length=8)


def ssd_case(ctx, *, rows: int = 8, evaluate: bool = False, dataset: str = "standard_prompt_only", **config) -> dict:
    import torch

    from trl.experimental.ssd import SSDConfig, SSDTrainer

    args = SSDConfig(output_dir=ctx.tmpdir(), **{**SSD_ARGS, "max_steps": 2, **config})
    torch.manual_seed(0)
    trainer = SSDTrainer(
        model=ctx.model(QWEN),
        args=args,
        train_dataset=ctx.dataset(dataset, "train", rows),
        eval_dataset=ctx.dataset(dataset, "test", 2) if evaluate else None,
    )
    return run_trainer(trainer, evaluate=evaluate)


for _name, _kwargs in {
    "defaults": {},
    "evaluate": dict(evaluate=True),
    "temperature=0.7/top_k=5": dict(temperature=0.7, top_k=5),
    "gradient_accumulation_steps=2": dict(gradient_accumulation_steps=2, max_steps=2),
    "steps_per_generation=2/num_iterations=2": dict(steps_per_generation=2, num_iterations=2, max_steps=3),
    "max_completion_length=2": dict(max_completion_length=2),
    "filter_empty=False/max_prompt_length=4": dict(filter_empty=False, max_prompt_length=4, max_completion_length=3),
    "conversational": dict(dataset="conversational_prompt_only", evaluate=True),
}.items():
    register(f"ssd/{_name}", partial(ssd_case, **_kwargs), oracle="1.12")


@case("ssd/defaults_config", oracle="1.12")
def _ssd_defaults(ctx):
    import dataclasses

    from trl.experimental.ssd import SSDConfig, SSDTrainer

    fields = {
        f.name: f.default
        for f in dataclasses.fields(SSDConfig)
        if f.default is not dataclasses.MISSING and not f.name.startswith("_")
    }
    fields.pop("save_run_report", None)  # this project's own run report (not a TRL field)
    return to_jsonable(
        {"fields": fields, "tags": list(SSDTrainer._tag_names), "name": SSDTrainer._name, "paper": SSDTrainer._paper}
    )


# ---------------------------------------------------------------------------------------------------------------------
# MiniLLM (TRL 1.12): GRPO rollouts, reverse-KL advantages from a teacher and the single-step KL
# ---------------------------------------------------------------------------------------------------------------------
def minillm_case(ctx, *, max_steps: int = 2, with_reward: bool = False, **config) -> dict:
    from trl.experimental.minillm import MiniLLMConfig, MiniLLMTrainer

    args = MiniLLMConfig(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": max_steps, **config})
    RECORDED_COMPLETION_IDS.clear()
    trainer = MiniLLMTrainer(
        model=ctx.model(QWEN),
        teacher_model=ctx.model("small-Qwen2ForCausalLM"),
        reward_funcs=toy_reward if with_reward else None,
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 16),
    )
    out = run_trainer(trainer, evaluate=False)
    out["completion_ids"] = list(RECORDED_COMPLETION_IDS)
    return out


for _name, _kwargs in {
    "defaults": {},
    "toy_reward": dict(with_reward=True),
    "gamma=0.5": dict(gamma=0.5),
    "gamma=0.5/length_normalization=False": dict(gamma=0.5, length_normalization=False),
    "rkl_advantage=False": dict(rkl_advantage=False, with_reward=True),
    "single_step_decomposition=False": dict(single_step_decomposition=False),
    "gradient_accumulation_steps=2": dict(gradient_accumulation_steps=2, per_device_train_batch_size=4),
    "temperature=0.7": dict(temperature=0.7),
    "kd_temperature=2.0": dict(kd_temperature=2.0),
}.items():
    register(f"minillm/{_name}", partial(minillm_case, **_kwargs), oracle="1.12")


@case("minillm/defaults_config", oracle="1.12")
def _minillm_defaults(ctx):
    import dataclasses

    from trl.experimental.minillm import MiniLLMConfig, MiniLLMTrainer

    names = (
        "disable_dropout",
        "teacher_model_init_kwargs",
        "rkl_advantage",
        "single_step_decomposition",
        "kd_temperature",
        "gamma",
        "length_normalization",
        "learning_rate",
    )
    fields = {f.name: f.default for f in dataclasses.fields(MiniLLMConfig) if f.name in names}
    return to_jsonable({"fields": fields, "tags": list(MiniLLMTrainer._tag_names), "name": MiniLLMTrainer._name})
