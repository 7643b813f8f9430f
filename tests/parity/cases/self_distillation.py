"""Parity cases: TRL 1.16's self-distillation methods (SDFT, SDPO): the shared `loss_utils` on fixed tensors, the
configs' fields, and short training runs on prompts with privileged context (SDFT) or scored by a reward (SDPO)."""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, case, expect_error, register, run_trainer, to_jsonable
from .dataclass_fields import _fields


def _logits():
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 7, generator=gen), torch.randn(2, 3, 7, generator=gen), torch.randint(0, 7, (2, 3))


@case("sdft/loss_utils")
def _sdft_loss_utils(ctx):
    import torch

    from trl.experimental.sdft import loss_utils as lu

    student, teacher, ids = _logits()
    out = {}
    for alpha in (0.0, 0.3, 1.0):
        out[f"divergence/{alpha}"] = lu.compute_divergence(student.log_softmax(-1), teacher.log_softmax(-1), alpha)
        out[f"full/{alpha}"] = lu.compute_full_logit_self_distillation_loss(student, teacher, distillation_alpha=alpha)
        for k in (2, 7):
            for tail in (False, True):
                out[f"topk/{alpha}/{k}/{tail}"] = lu.compute_topk_self_distillation_loss(
                    student, teacher, distillation_topk=k, distillation_alpha=alpha, distillation_add_tail=tail
                )
    out["sampled"] = lu.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)
    out["tail"] = lu.add_tail_bucket(student.log_softmax(-1)[..., :3])
    old = torch.linspace(-2.0, 0.0, 6).view(2, 3)
    out["is_clip"] = lu.apply_importance_sampling_clipping(torch.ones(2, 3), old + 0.5, old, 1.3)
    out["sampled_alpha_error"] = expect_error(
        lambda: lu.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=0.5)
    )
    return to_jsonable({k: v.tolist() if hasattr(v, "tolist") else v for k, v in out.items()})


@case("dataclasses/SDFTConfig")
def _sdft_fields(ctx):
    from trl.experimental.sdft import SDFTConfig

    return _fields(SDFTConfig)


SDFT_ARGS = dict(
    COMMON_ARGS,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=6,
    learning_rate=1e-2,
    gradient_checkpointing=False,
)


def _with_context(ctx, dataset: str, n: int):
    data = ctx.dataset(dataset, "train", n)
    return data.add_column("privileged_context", [f"Hint number {i}: be brief." for i in range(len(data))])


def sdft_case(ctx, *, dataset: str = "standard_prompt_only", peft: bool = False, **config) -> dict:
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    args = SDFTConfig(output_dir=ctx.tmpdir(), **{**SDFT_ARGS, "max_steps": 2, **config})
    kwargs = {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
    trainer = SDFTTrainer(model=ctx.model(QWEN), args=args, train_dataset=_with_context(ctx, dataset, 8), **kwargs)
    return run_trainer(trainer, evaluate=False)


for _name, _kwargs in {
    "topk_logits": {},
    "full_logits/alpha=0": dict(distillation_mode="full_logits", distillation_alpha=0.0),
    "sampled_token": dict(distillation_mode="sampled_token", distillation_alpha=1.0),
    "topk=5/add_tail": dict(distillation_topk=5, distillation_add_tail=True, distillation_alpha=1.0),
    "teacher=live": dict(teacher_model_kind="live"),
    "teacher=ema": dict(teacher_model_kind="ema", teacher_update_rate=0.5, max_steps=3),
    "num_loss_tokens_to_skip=2": dict(num_loss_tokens_to_skip=2),
    "generate_from_teacher": dict(generate_from_teacher=True),
    "steps_per_generation=2": dict(steps_per_generation=2, max_steps=3),
    "gradient_accumulation_steps=2": dict(gradient_accumulation_steps=2, per_device_train_batch_size=2),
    "conversational": dict(dataset="conversational_prompt_only"),
    "template": dict(teacher_prompt_template="Context: {privileged_context}\nQuestion: {prompt}"),
    "peft_lora": dict(peft=True),
    "neftune_noise_alpha=5": dict(neftune_noise_alpha=5.0),
}.items():
    register(f"sdft/{_name}", partial(sdft_case, **_kwargs))


@case("sdft/bad_template", phrases=("teacher_prompt_template",))
def _sdft_bad_template(ctx):
    from trl.experimental.sdft import SDFTConfig

    return expect_error(
        lambda: SDFTConfig(output_dir=ctx.tmpdir(), **{**SDFT_ARGS, "teacher_prompt_template": "{prompt}"})
    )


@case("sdft/sampled_token_alpha", phrases=("distillation_alpha",))
def _sdft_sampled_alpha(ctx):
    from trl.experimental.sdft import SDFTConfig

    return expect_error(
        lambda: SDFTConfig(output_dir=ctx.tmpdir(), **{**SDFT_ARGS, "distillation_mode": "sampled_token"})
    )


# ---------------------------------------------------------------------------------------------------------------------
# SDPO: GRPO-style rollouts scored by a binary reward; successful siblings teach the others
# ---------------------------------------------------------------------------------------------------------------------
def hit_reward(completions, completion_ids, **kwargs) -> list[float]:
    """1 when at least a quarter of the completion's token ids are multiples of 4 (about half the random rollouts)."""
    return [1.0 if sum(1 for t in row if int(t) % 4 == 0) >= len(row) / 4 else 0.0 for row in completion_ids]


@case("dataclasses/SDPOConfig")
def _sdpo_fields(ctx):
    from trl.experimental.sdpo import SDPOConfig

    return _fields(SDPOConfig)


def sdpo_case(ctx, *, dataset: str = "standard_prompt_only", feedback: bool = False, **config) -> dict:
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    args = SDPOConfig(output_dir=ctx.tmpdir(), **{**SDFT_ARGS, "max_steps": 2, **config})
    data = _with_context(ctx, dataset, 8) if feedback else ctx.dataset(dataset, "train", 8)
    trainer = SDPOTrainer(model=ctx.model(QWEN), reward_funcs=hit_reward, args=args, train_dataset=data)
    return run_trainer(trainer, evaluate=False)


for _name, _kwargs in {
    "sampled_token": {},
    "success_reward_threshold=0": dict(success_reward_threshold=0.0),
    "reprompt_on_self_success": dict(dont_reprompt_on_self_success=False),
    "distillation_weight=0.5/live": dict(distillation_weight=0.5, teacher_model_kind="live"),
    "distillation_weight=0/loss_type=grpo": dict(distillation_weight=0.0, loss_type="grpo", num_iterations=2),
    "distillation_weight=0.5/dr_grpo/sequence": dict(
        distillation_weight=0.5, loss_type="dr_grpo", importance_sampling_level="sequence", num_iterations=2
    ),
    "num_iterations=2": dict(num_iterations=2, max_steps=3),
    "topk_logits": dict(distillation_mode="topk_logits", distillation_topk=5, distillation_alpha=0.5),
    "full_logits/base": dict(distillation_mode="full_logits", distillation_alpha=0.0, teacher_model_kind="base"),
    "feedback": dict(feedback=True, include_environment_feedback=True),
    "feedback/only_without_solution": dict(
        feedback=True, include_environment_feedback=True, environment_feedback_only_without_solution=True
    ),
    "feedback_ignored": dict(feedback=True),
    "conversational": dict(dataset="conversational_prompt_only"),
    "scale_rewards=batch": dict(scale_rewards="batch", distillation_weight=0.5),
}.items():
    register(f"sdpo/{_name}", partial(sdpo_case, **_kwargs))


@case("sdpo/distillation_weight_range", phrases=("distillation_weight",))
def _sdpo_weight_range(ctx):
    from trl.experimental.sdpo import SDPOConfig

    return expect_error(lambda: SDPOConfig(output_dir=ctx.tmpdir(), **{**SDFT_ARGS, "distillation_weight": 1.5}))


@case("sdpo/sampled_token_alpha", phrases=("distillation_alpha",))
def _sdpo_sampled_alpha(ctx):
    from trl.experimental.sdpo import SDPOConfig

    return expect_error(lambda: SDPOConfig(output_dir=ctx.tmpdir(), **{**SDFT_ARGS, "distillation_alpha": 0.5}))


@case("sdpo/defaults")
def _sdpo_defaults(ctx):
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    args = SDPOConfig(output_dir=ctx.tmpdir(), use_cpu=True, bf16=False, scale_rewards=False)
    return to_jsonable(
        {
            "tags": list(SDPOTrainer._tag_names),
            "name": SDPOTrainer._name,
            "scale_rewards": args.scale_rewards,
            "epsilon_high": args.epsilon_high,
            "loss_is_scaled_for_ga": SDPOTrainer.loss_is_scaled_for_ga,
        }
    )


# ---------------------------------------------------------------------------------------------------------------------
# Both: TRL's self-distillation callback events, and the settings the generation-server teacher refuses
# ---------------------------------------------------------------------------------------------------------------------
def _event_recorder():
    import torch
    from transformers import TrainerCallback

    def describe(value):
        if torch.is_tensor(value):
            return {"shape": list(value.shape), "sum": float(value.double().sum())}
        return value

    class Recorder(TrainerCallback):
        def __init__(self):
            self.events = []

        def __getattr__(self, name):
            if not name.startswith("on_"):
                raise AttributeError(name)

            def hook(**kwargs):
                skip = ("args", "state", "control", "model", "processing_class")
                payload = {key: describe(value) for key, value in kwargs.items() if key not in skip}
                self.events.append({"event": name, "step": kwargs["state"].global_step, **payload})

            return hook

    return Recorder()


def self_distillation_events_case(ctx, *, method: str, **config) -> dict:
    recorder = _event_recorder()
    if method == "sdft":
        from trl.experimental.sdft import SDFTConfig, SDFTTrainer

        args = SDFTConfig(output_dir=ctx.tmpdir(), **{**SDFT_ARGS, "max_steps": 2, **config})
        trainer = SDFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=_with_context(ctx, "standard_prompt_only", 8)
        )
    else:
        from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

        args = SDPOConfig(output_dir=ctx.tmpdir(), **{**SDFT_ARGS, "max_steps": 2, **config})
        data = ctx.dataset("standard_prompt_only", "train", 8)
        trainer = SDPOTrainer(model=ctx.model(QWEN), reward_funcs=hit_reward, args=args, train_dataset=data)
    trainer.add_callback(recorder)
    trainer.train()
    return to_jsonable({"events": recorder.events})


for _name, _kwargs in {
    "sdft/callback_events": dict(method="sdft"),
    "sdft/callback_events/generate_from_teacher": dict(
        method="sdft", generate_from_teacher=True, steps_per_generation=2
    ),
    "sdpo/callback_events": dict(method="sdpo"),
}.items():
    register(_name, partial(self_distillation_events_case, **_kwargs))


def teacher_server_error_case(ctx, *, method: str, **config) -> dict:
    if method == "sdft":
        from trl.experimental.sdft import SDFTConfig as config_class
        from trl.experimental.sdft import SDFTTrainer as trainer_class

        data, extra = _with_context(ctx, "standard_prompt_only", 8), {}
    else:
        from trl.experimental.sdpo import SDPOConfig as config_class
        from trl.experimental.sdpo import SDPOTrainer as trainer_class

        data, extra = ctx.dataset("standard_prompt_only", "train", 8), {"reward_funcs": hit_reward}
    args = config_class(output_dir=ctx.tmpdir(), **{**SDFT_ARGS, "max_steps": 1, "use_teacher_server": True, **config})
    return expect_error(lambda: trainer_class(model=ctx.model(QWEN), args=args, train_dataset=data, **extra))


_SERVER = dict(use_vllm=True, vllm_mode="server", teacher_model_kind="live")
for _name, _kwargs, _phrases in (
    ("sdft/teacher_server/needs_vllm_server", dict(method="sdft"), ("use_vllm=True", "vllm_mode='server'")),
    (
        "sdft/teacher_server/needs_live",
        dict(method="sdft", use_vllm=True, vllm_mode="server"),
        ("teacher_model_kind",),
    ),
    (
        "sdft/teacher_server/full_logits",
        dict(method="sdft", **_SERVER, distillation_mode="full_logits"),
        ("full_logits", "top-k"),
    ),
    ("sdpo/teacher_server/needs_vllm_server", dict(method="sdpo"), ("use_vllm=True", "vllm_mode='server'")),
    (
        "sdpo/teacher_server/distillation_weight",
        dict(method="sdpo", **_SERVER, distillation_weight=0.5),
        ("distillation_weight=1.0",),
    ),
):
    register(_name, partial(teacher_server_error_case, **_kwargs), phrases=_phrases)


# Fields that no other case sets.
for _name, _kwargs in {
    # Two steps: the second runs off-policy (importance weights) and with the teacher the first step left. A third
    # step's fingerprints carry the float rounding of the shared prompts (see `sdft/steps_per_generation=2`).
    "distillation_is_clip=None": dict(distillation_is_clip=None, num_iterations=2),
    "distillation_is_clip=1.1": dict(distillation_is_clip=1.1, num_iterations=2),
    "teacher=ema/teacher_sync_steps=2": dict(teacher_model_kind="ema", teacher_update_rate=0.5, teacher_sync_steps=2),
}.items():
    register(f"sdft/{_name}", partial(sdft_case, **_kwargs))
    register(f"sdpo/{_name}", partial(sdpo_case, **_kwargs))
for _name, _kwargs in {
    "max_reprompt_len=12": dict(max_reprompt_len=12),
    "use_successful_as_teacher=False": dict(
        use_successful_as_teacher=False, feedback=True, include_environment_feedback=True, max_steps=1
    ),  # fmt: skip
    "templates": dict(
        reprompt_template="Q: {prompt}{solution}{feedback} Try again.",
        solution_template=" S: {successful_previous_attempt}.",
        feedback_template=" F: {feedback_raw}.",
        feedback=True,
        include_environment_feedback=True,
    ),  # fmt: skip
    "remove_thinking_from_demonstration": dict(remove_thinking_from_demonstration=True),
}.items():
    register(f"sdpo/{_name}", partial(sdpo_case, **_kwargs))
