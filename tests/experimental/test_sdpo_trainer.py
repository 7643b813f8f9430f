"""SDPOTrainer: the policy and distillation losses against hand-written formulas, teacher contexts from successful
siblings and feedback, training with TRL's metric keys, save/reload/resume, bad input."""

import math

import pytest
import torch
from datasets import Dataset
from trainer_utils import args_builder, assert_saved_model_reloads, resume_from_first_checkpoint, train_logs

from trl.experimental.sdpo import SDPOConfig, SDPOTrainer, loss_utils
from trl.experimental.sdpo.sdpo_trainer import DistillationLogits, SuccessfulRolloutTeacherContextBuilder


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(
    SDPOConfig,
    max_steps=2,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=6,
    learning_rate=1e-2,
    gradient_checkpointing=False,
)
SDPO_METRICS = [
    "completions/mean_length",
    "self_distillation/reward_mean",
    "self_distillation/reward_std",
    "self_distillation/group_reward_std_mean",
    "self_distillation/flat_group_fraction",
    "self_distillation/rewards/hit_reward",
    "self_distillation/success_group_fraction",
    "self_distillation/success_sample_fraction",
    "self_distillation/feedback_available_fraction",
    "self_distillation/feedback_used_fraction",
    "self_distillation/reprompt_sample_fraction",
]


def hit_reward(completion_ids, **kwargs):
    return [1.0 if sum(1 for t in row if t % 4 == 0) >= len(row) / 4 else 0.0 for row in completion_ids]


def always_one(completions, **kwargs):
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def prompts():
    return Dataset.from_dict(
        {
            "prompt": ["The sky is", "Hello my", "One two", "Cats are"],
            "privileged_context": ["blue", "", "three", None],
        }
    )


@pytest.fixture
def trainer(tmp_path, model_path, prompts):
    return SDPOTrainer(
        model=model_path,
        reward_funcs=hit_reward,
        args=make_args(tmp_path, teacher_model_kind="live"),
        train_dataset=prompts,
    )


def test_config_defaults_and_errors(tmp_path):
    args = SDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, scale_rewards=False)
    assert (args.distillation_mode, args.distillation_alpha, args.distillation_weight) == ("sampled_token", 1.0, 1.0)
    assert (args.teacher_model_kind, args.loss_type, args.scale_rewards, args.epsilon_high) == (
        "ema",
        "dapo",
        "none",
        0.2,
    )
    assert args.max_reprompt_len == 10240 and args.success_reward_threshold == 1.0
    assert not hasattr(args, "teacher_prompt_template") and not hasattr(args, "generate_from_teacher")
    with pytest.raises(ValueError, match="distillation_weight"):
        make_args(tmp_path, distillation_weight=1.5)
    with pytest.raises(ValueError, match="distillation_alpha=1.0"):
        make_args(tmp_path, distillation_alpha=0.5)


def test_policy_loss_matches_hand_formula(trainer):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3), generator=gen)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logps = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = logps - torch.tensor([[0.3, -0.4, 0.1], [0.0, 0.5, 0.2]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    inputs = {"completion_ids": ids, "completion_mask": mask, "old_per_token_logps": old, "advantages": advantages}

    def expected(loss_type, level):
        log_ratio = logps - old
        if level == "sequence":
            log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1)).unsqueeze(1).expand_as(logps)
        m = mask.tolist()
        per_token = []
        for i in range(2):
            row = []
            for t in range(3):
                r = math.exp(log_ratio[i, t].item())
                a = advantages[i].item()
                row.append(-min(r * a, min(max(r, 0.8), 1.2) * a))
            per_token.append(row)
        if loss_type == "grpo":
            return sum(sum(v * k for v, k in zip(row, mi)) / sum(mi) for row, mi in zip(per_token, m)) / 2
        total = sum(v * k for row, mi in zip(per_token, m) for v, k in zip(row, mi))
        return total / (2 * 6) if loss_type == "dr_grpo" else total / 5

    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        for level in ("token", "sequence"):
            trainer.args.loss_type, trainer.args.importance_sampling_level = loss_type, level
            value = trainer._compute_policy_loss(inputs, logits)
            assert value.item() == pytest.approx(expected(loss_type, level), rel=1e-9), (loss_type, level)
    trainer.args.loss_type = "bogus"
    with pytest.raises(ValueError, match="loss_type"):
        trainer._compute_policy_loss(inputs, logits)


def test_distillation_loss_is_a_sequence_mean_over_all_completions(trainer):
    gen = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(3, 4, 9, generator=gen), torch.randn(3, 4, 9, generator=gen)
    ids = torch.randint(0, 9, (3, 4), generator=gen)
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    sd_mask = torch.tensor([1, 0, 1])
    loss_mask = completion_mask * sd_mask.unsqueeze(1)
    logits = DistillationLogits(ids, completion_mask, loss_mask, student, teacher)
    loss = trainer._compute_self_distillation_loss(trainer.model, {"completion_ids": ids}, logits)
    per_token = loss_utils.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)
    per_row = (per_token * loss_mask).sum(1) / loss_mask.sum(1).clamp(min=1)
    assert loss.item() == pytest.approx(per_row.mean().item(), rel=1e-6)
    logged = trainer._metrics[trainer._mode]["self_distillation/distillation_loss"][-1]
    assert logged == pytest.approx(per_row[sd_mask.bool()].mean().item(), rel=1e-6)


def test_teacher_context_from_successes_and_feedback(trainer):
    builder = SuccessfulRolloutTeacherContextBuilder(trainer)
    tokenizer = trainer.processing_class
    completions = [tokenizer.encode(text) for text in (" red", " green", " blue", " pink")]
    width = max(map(len, completions))
    pad = trainer.pad_token_id
    output = {"completion_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids in completions])}
    prompts = ["Q1", "Q1", "Q2", "Q2"]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    trainer.args.include_environment_feedback = True
    context = builder.build(output, prompts, rewards, feedbacks=[None, "fb1", "fb2", "  "])
    assert context["self_distillation_mask"].tolist() == [0.0, 1.0, 1.0, 0.0]
    texts = [
        tokenizer.decode(row[mask.bool()])
        for row, mask in zip(context["teacher_prompt_ids"], context["teacher_prompt_mask"])
    ]
    args = trainer.args
    solution = args.solution_template.format(successful_previous_attempt=" red")
    assert texts[1] == args.reprompt_template.format(
        prompt="Q1", solution=solution, feedback=args.feedback_template.format(feedback_raw="fb1")
    )
    assert texts[2] == args.reprompt_template.format(
        prompt="Q2", solution="", feedback=args.feedback_template.format(feedback_raw="fb2")
    )
    assert texts[0] == "Q1" and texts[3] == "Q2"
    assert builder.last_metrics == {
        "self_distillation/success_group_fraction": 0.5,
        "self_distillation/success_sample_fraction": 0.25,
        "self_distillation/feedback_available_fraction": 0.5,
        "self_distillation/feedback_used_fraction": 0.5,
        "self_distillation/reprompt_sample_fraction": 0.5,
    }
    # A success may be its own demonstration; conversational prompts end with a new user message.
    args.dont_reprompt_on_self_success, args.include_environment_feedback = False, False
    messages = [[{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]] * 2
    context = builder.build(
        {"completion_ids": output["completion_ids"][:2]}, messages, torch.tensor([1.0, 0.0]), feedbacks=None
    )
    assert context["self_distillation_mask"].tolist() == [1.0, 1.0]
    # Without demonstrations, no completion counts as having a successful sibling to learn from (TRL's metric).
    args.use_successful_as_teacher = False
    builder.build({"completion_ids": output["completion_ids"][:2]}, messages, torch.tensor([1.0, 0.0]))
    assert builder.last_metrics["self_distillation/success_sample_fraction"] == 0.0


def test_demonstration_without_thinking_is_stripped(trainer):
    builder = SuccessfulRolloutTeacherContextBuilder(trainer)
    ids = trainer.processing_class.encode(" <think>plan</think> red \n")
    assert builder._demonstration_text(ids) == " <think>plan</think> red \n"
    trainer.args.remove_thinking_from_demonstration = True
    # The reasoning block goes, and the surrounding whitespace with it (TRL strips the demonstration).
    assert builder._demonstration_text(ids) == "red"
    assert builder._demonstration_text(trainer.processing_class.encode(" blue ")) == "blue"


@pytest.mark.parametrize("weight, kind", [(1.0, "ema"), (0.5, "base")])
def test_trains_logs_and_saves(tmp_path, model_path, prompts, weight, kind):
    trainer = SDPOTrainer(
        model=model_path,
        reward_funcs=hit_reward,
        args=make_args(tmp_path, distillation_weight=weight, teacher_model_kind=kind, success_reward_threshold=0.0),
        train_dataset=prompts,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    last = train_logs(trainer)[-1]
    for key in [*SDPO_METRICS, "self_distillation/distillation_loss", "sdpo/distillation_loss"]:
        assert key in last and math.isfinite(last[key]), key
    assert ("self_distillation/policy_loss" in last) == (weight < 1.0)
    assert "num_tokens" not in last and "reward" not in last
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1, teacher_model_kind="live")
    resume_from_first_checkpoint(
        SDPOTrainer, args, tmp_path, model=model_path, reward_funcs=always_one, train_dataset=prompts
    )


def test_bad_input_refused_before_training(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="reward_funcs"):
        SDPOTrainer(model=model_path, args=make_args(tmp_path), train_dataset=prompts)
    with pytest.raises(ValueError, match="loss_type"):
        SDPOTrainer(
            model=model_path, reward_funcs=always_one, args=make_args(tmp_path, loss_type="x"), train_dataset=prompts
        )
    with pytest.raises(NotImplementedError, match="IterableDataset"):
        SDPOTrainer(
            model=model_path,
            reward_funcs=always_one,
            args=make_args(tmp_path),
            train_dataset=prompts.to_iterable_dataset(),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_log_probs_backward_is_autograds(dtype):
    """`token_log_probs` with gradients (one buffer in the backward) gives the plain expression's values and
    gradients bit for bit, and the plain expression without gradients."""
    torch.manual_seed(7)
    logits = (torch.randn(2, 4, 300) * 3).to(dtype).requires_grad_(True)
    ids = torch.randint(0, 300, (2, 4))
    upstream = torch.randn(2, 4).to(dtype)
    logps = loss_utils.token_log_probs(logits, ids)
    (grad,) = torch.autograd.grad(logps, logits, upstream)
    plain = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    (plain_grad,) = torch.autograd.grad(plain, logits, upstream)
    assert torch.equal(logps, plain) and torch.equal(grad, plain_grad)
    with torch.no_grad():
        assert torch.equal(loss_utils.token_log_probs(logits, ids), plain)
