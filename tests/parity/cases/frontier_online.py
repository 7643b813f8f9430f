"""Parity cases: TRL 1.16's newer online methods built on this project's online trainers (GMPO; A2PO)."""

from __future__ import annotations

from functools import partial

from . import QWEN, case, register, run_trainer, to_jsonable
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
