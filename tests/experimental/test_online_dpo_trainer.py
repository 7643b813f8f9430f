"""OnlineDPOTrainer: the loss, pair ranking (reward models, reward functions, judges), missing-EOS penalty, beta
schedules, PEFT, saving, resuming and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from trainer_utils import (
    ONLINE_PAIR_ARGS,
    ShorterJudge,
    args_builder,
    batch_rows,
    changed_params,
    resume_from_first_checkpoint,
    row_logp,
    snapshot,
    token_sum_reward,
    train_logs,
    train_peft_adapters_only,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl.assets import get_model_path, load_test_dataset
from trl.experimental.judges import BasePairwiseJudge
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from trl.experimental.online_dpo.online_dpo_trainer import online_dpo_loss


MODEL = "tiny-Qwen2ForCausalLM"
REWARD_MODEL = "tiny-Qwen2ForSequenceClassification"

ONLINE_DPO_METRICS = [
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/scores",
    "objective/scores_margin",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "val/contain_eos_token",
    "beta",
]
# A judge gives verdicts, not scores: the score-based objectives are not logged.
JUDGE_METRICS = [m for m in ONLINE_DPO_METRICS if m not in ("objective/rlhf_reward", "objective/scores")]
JUDGE_METRICS.remove("objective/scores_margin")


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(OnlineDPOConfig, **ONLINE_PAIR_ARGS)


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def even_token_reward(completion_ids, **kwargs):
    return [float(sum(token % 2 == 0 for token in ids)) for ids in completion_ids]


class FirstHalfJudge(BasePairwiseJudge):
    """Deterministic judge: verdicts follow a fixed pattern over the prompt positions (0, -1, 1, 0, -1, 1, ...)."""

    pattern = (0, -1, 1)

    def judge(self, prompts, completions, shuffle_order=True):
        return [self.pattern[i % len(self.pattern)] for i in range(len(prompts))]


# ---------------------------------------------------------------------------------------------------------------------
# Loss formulas on fixed tensors
# ---------------------------------------------------------------------------------------------------------------------
CHOSEN = [-3.0, -10.0, -2.5]
REJECTED = [-4.0, -9.0, -2.0]
REF_CHOSEN = [-3.5, -9.5, -2.5]
REF_REJECTED = [-3.0, -9.5, -2.25]


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_sigmoid_loss_matches_formula(beta):
    losses = online_dpo_loss(
        torch.tensor(CHOSEN), torch.tensor(REJECTED), torch.tensor(REF_CHOSEN), torch.tensor(REF_REJECTED), beta
    )
    expected = []
    for c, r, rc, rr in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED):
        h = (c - rc) - (r - rr)
        expected.append(math.log(1 + math.exp(-beta * h)))
    torch.testing.assert_close(losses, torch.tensor(expected))


def test_ipo_loss_uses_summed_logps():
    beta = 0.25
    losses = online_dpo_loss(
        torch.tensor(CHOSEN),
        torch.tensor(REJECTED),
        torch.tensor(REF_CHOSEN),
        torch.tensor(REF_REJECTED),
        beta,
        loss_type="ipo",
    )
    expected = [
        ((c - rc) - (r - rr) - 1 / (2 * beta)) ** 2 for c, r, rc, rr in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)
    ]
    torch.testing.assert_close(losses, torch.tensor(expected))


def test_loss_rejects_unknown_type():
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="sigmoid' or 'ipo'"):
        online_dpo_loss(x, x, x, x, 0.1, loss_type="hinge")


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
def test_config_defaults(tmp_path):
    args = OnlineDPOConfig(output_dir=str(tmp_path))
    assert args.learning_rate == 5e-7
    assert args.remove_unused_columns is False
    assert (args.max_new_tokens, args.max_length, args.temperature) == (64, 512, 0.9)
    assert (args.top_p, args.top_k, args.min_p, args.repetition_penalty) == (1.0, 0, None, 1.0)
    assert args.beta == 0.1  # the default [0.1] is a constant schedule
    assert args.loss_type == "sigmoid" and args.missing_eos_penalty is None and args.disable_dropout is True
    assert (args.use_vllm, args.vllm_mode, args.vllm_gpu_memory_utilization) == (False, "colocate", 0.55)
    assert args.reward_model_path is None and args.reward_weights is None
    assert OnlineDPOConfig(output_dir=str(tmp_path), beta=[0.1, 0.2]).beta == [0.1, 0.2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": []}, "beta is an empty list"),
        ({"beta": ["a"]}, "numbers only"),
        ({"loss_type": "hinge"}, "loss_type must be one of"),
        ({"loss_type": "ipo", "beta": [0.1, 0.0]}, "every beta must be > 0"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_config_rejects_bad_values(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        OnlineDPOConfig(output_dir=str(tmp_path), **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------
def test_train_with_reward_model_logs_metrics_evaluates_and_saves(tmp_path, model_path, prompts):
    eval_prompts = load_test_dataset("standard_prompt_only", split="test")
    trainer = OnlineDPOTrainer(
        model=model_path,
        reward_funcs=get_model_path(REWARD_MODEL),
        args=make_args(tmp_path),
        train_dataset=prompts,
        eval_dataset=eval_prompts,
    )
    assert trainer.ref_model is not None and trainer.reward_func_names == [REWARD_MODEL]
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    logs = train_logs(trainer)
    assert len(logs) == 2
    for log in logs:
        missing = [m for m in ONLINE_DPO_METRICS if m not in log]
        assert not missing, missing
        assert math.isfinite(log["loss"]) and log["beta"] == pytest.approx(0.1)
        assert 0.0 <= log["rewards/accuracies"] <= 1.0 and 0.0 <= log["val/contain_eos_token"] <= 1.0
        # objective/rlhf_reward = scores + non_score_reward (the KL penalty -beta * KL; both averaged over the same completions)
        assert log["objective/rlhf_reward"] == pytest.approx(
            log["objective/scores"] + log["objective/non_score_reward"], abs=1e-4
        )
    # First step: policy == reference, so the implicit rewards vanish and the sigmoid loss is log 2.
    assert logs[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)

    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    eval_log = trainer.state.log_history[-1]  # the metrics are logged; evaluate() returns the loss
    assert all(f"eval_{m}" in eval_log for m in ONLINE_DPO_METRICS)

    # A raw dataset, a stream (never dispatched: batches are rows of strings) and a dict of them, passed to evaluate()
    raw = eval_prompts.select(range(2))
    assert "eval_rewards/accuracies" in trainer.evaluate(eval_dataset=raw.to_iterable_dataset())
    metrics = trainer.evaluate(eval_dataset={"stream": raw.to_iterable_dataset(), "map": raw})
    assert math.isfinite(metrics["eval_stream_loss"]) and math.isfinite(metrics["eval_map_loss"])

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(p.detach().cpu(), q), name
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "online-dpo" in card and "2402.04792" in card


def test_reward_functions_weighted_scores_and_conversational_data(tmp_path, model_path):
    dataset = load_test_dataset("conversational_prompt_only", split="train")
    trainer = OnlineDPOTrainer(
        model=model_path,
        reward_funcs=[length_reward, even_token_reward],
        args=make_args(tmp_path, reward_weights=[1.0, -0.5]),
        train_dataset=dataset,
    )
    rows = [dataset[i] for i in range(3)]
    batch = trainer._prepare_inputs(rows)
    assert batch["prompt_ids"].shape[0] == 6
    completions = [c for _, c in batch_rows(batch)]
    expected = torch.tensor([len(c) - 0.5 * int((c % 2 == 0).sum()) for c in completions], dtype=torch.float32)
    torch.testing.assert_close(batch["scores"], expected)
    torch.testing.assert_close(batch["first_win_prob"], (expected[:3] >= expected[3:]).float())
    # both members of a pair share the prompt
    assert torch.equal(batch["prompt_ids"][:3], batch["prompt_ids"][3:])

    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    assert "objective/scores_margin" in train_logs(trainer)[-1]


def test_judge_verdicts_invalid_pairs_and_loss_against_plain_forward(tmp_path, model_path, prompts):
    # A distinct reference (perturbed copy) makes the implicit rewards non-zero.
    ref_model = AutoModelForCausalLM.from_pretrained(model_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in ref_model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    trainer = OnlineDPOTrainer(
        model=model_path,
        ref_model=ref_model,
        judge=FirstHalfJudge(),
        args=make_args(tmp_path, beta=0.5),
        train_dataset=prompts,
    )
    assert trainer.reward_funcs == []
    batch = trainer._prepare_inputs([prompts[i] for i in range(6)])
    expected_prob = torch.tensor([1.0, float("nan"), 0.0, 1.0, float("nan"), 0.0])
    torch.testing.assert_close(batch["first_win_prob"], expected_prob, equal_nan=True)
    assert "scores" not in batch

    rows = batch_rows(batch)
    policy = [row_logp(trainer.model, p, c) for p, c in rows]
    reference = [row_logp(ref_model, p, c) for p, c in rows]
    losses = []
    for i, verdict in enumerate(FirstHalfJudge.pattern * 2):
        if verdict == -1:
            continue  # no verdict: the pair is left out
        c, r = (i, i + 6) if verdict == 0 else (i + 6, i)
        h = (policy[c] - reference[c]) - (policy[r] - reference[r])
        losses.append(-F.logsigmoid(0.5 * h))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    torch.testing.assert_close(loss, torch.stack(losses).mean(), atol=1e-4, rtol=1e-4)

    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    for log in train_logs(trainer):
        assert all(m in log for m in JUDGE_METRICS)
        assert "objective/scores" not in log


def test_missing_eos_penalty_applied_exactly_when_eos_missing(tmp_path, model_path, prompts):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    # About one token in ten ends a completion, so some completions stop early and others hit max_new_tokens.
    model.generation_config.eos_token_id = [model.generation_config.eos_token_id, *range(0, 4096, 10)]
    trainer = OnlineDPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=make_args(tmp_path, missing_eos_penalty=2.5),
        train_dataset=prompts,
        processing_class=AutoTokenizer.from_pretrained(model_path, padding_side="left"),
    )
    eos_ids = set(trainer.eos_token_ids)
    batch = trainer._prepare_inputs([prompts[i] for i in range(8)])
    ends_with_eos = torch.tensor([len(c) > 0 and int(c[-1]) in eos_ids for _, c in batch_rows(batch)])
    assert ends_with_eos.any() and not ends_with_eos.all()
    assert torch.equal(batch["contains_eos"].cpu(), ends_with_eos)
    expected = torch.where(ends_with_eos, 0.0, -2.5)
    torch.testing.assert_close(batch["scores"].cpu(), expected)
    # the completion without EOS loses against one with EOS
    for i in range(8):
        if ends_with_eos[i] != ends_with_eos[i + 8]:
            assert batch["first_win_prob"][i].item() == float(ends_with_eos[i])


def test_beta_schedule_per_epoch(tmp_path, model_path, prompts):
    trainer = OnlineDPOTrainer(
        model=model_path,
        reward_funcs=length_reward,
        args=make_args(tmp_path, max_steps=-1, num_train_epochs=3, beta=[0.1, 0.3]),
        train_dataset=prompts.select(range(4)),
    )
    assert trainer.beta == 0.1
    trainer.train()
    assert [log["beta"] for log in train_logs(trainer)] == pytest.approx([0.1, 0.1, 0.3, 0.3, 0.3, 0.3])


def test_peft_trains_adapters_only_and_uses_disabled_adapters_as_reference(tmp_path, model_path, prompts):
    trainer, before = train_peft_adapters_only(
        OnlineDPOTrainer, model=model_path, reward_funcs=length_reward, args=make_args(tmp_path), train_dataset=prompts
    )
    frozen = [n for n, p in trainer.model.named_parameters() if "lora" not in n]
    assert all(torch.equal(before[n], dict(trainer.model.named_parameters())[n].detach()) for n in frozen)
    assert all(m in train_logs(trainer)[-1] for m in ONLINE_DPO_METRICS)


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1)
    # the resumed step reproduces the uninterrupted run's step (same data order, weights and sampling)
    _, resumed = resume_from_first_checkpoint(
        OnlineDPOTrainer, args, tmp_path, model=model_path, reward_funcs=length_reward, train_dataset=prompts
    )
    assert train_logs(resumed)[-1]["step"] == 2


def test_reward_model_path_from_config_and_default_output_dir(tmp_path, monkeypatch, model_path, prompts):
    monkeypatch.chdir(tmp_path)
    trainer = OnlineDPOTrainer(model=model_path, train_dataset=prompts, args=None, reward_funcs=length_reward)
    assert trainer.args.output_dir.endswith(f"{MODEL}-OnlineDPO")
    args = make_args(tmp_path, reward_model_path=get_model_path(REWARD_MODEL))
    trainer = OnlineDPOTrainer(model=model_path, args=args, train_dataset=prompts)
    assert trainer.reward_func_names == [REWARD_MODEL]


def test_max_length_drops_leftmost_prompt_tokens(tmp_path, model_path, prompts):
    trainer = OnlineDPOTrainer(
        model=model_path, reward_funcs=length_reward, args=make_args(tmp_path, max_length=10), train_dataset=prompts
    )
    rows = [prompts[i] for i in range(2)]
    batch = trainer._prepare_inputs(rows)
    width = batch["completion_ids"].shape[1]
    assert batch["prompt_ids"].shape[1] == 10 - width
    tokenizer = trainer.processing_class
    for i, row in enumerate(rows + rows):
        full = tokenizer(row["prompt"])["input_ids"]
        kept = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        assert kept == full[-len(kept) :] and len(kept) == min(len(full), 10 - width)


def test_tokenize_row(model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    row = OnlineDPOTrainer.tokenize_row({"prompt": "The sky is"}, False, tokenizer)
    assert row["prompt_input_ids"] == tokenizer("The sky is")["input_ids"]
    assert row["prompt_attention_mask"] == [1] * len(row["prompt_input_ids"])


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------
def test_judge_and_reward_funcs_together_are_rejected(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="either a judge or reward models"):
        OnlineDPOTrainer(
            model=model_path,
            reward_funcs=length_reward,
            judge=ShorterJudge(),
            args=make_args(tmp_path),
            train_dataset=prompts,
        )
    args = make_args(tmp_path, reward_model_path=get_model_path(REWARD_MODEL))
    with pytest.raises(ValueError, match="reward_model_path"):
        OnlineDPOTrainer(model=model_path, judge=ShorterJudge(), args=args, train_dataset=prompts)


def test_no_ranking_source_is_rejected(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="needs a way to rank"):
        OnlineDPOTrainer(model=model_path, args=make_args(tmp_path), train_dataset=prompts)


def test_prompt_less_dataset_is_rejected(tmp_path, model_path):
    dataset = Dataset.from_dict({"text": ["a", "b"]})
    with pytest.raises(ValueError, match="'prompt' column"):
        OnlineDPOTrainer(model=model_path, reward_funcs=length_reward, args=make_args(tmp_path), train_dataset=dataset)


@pytest.mark.parametrize(
    ("verdicts", "match"),
    [
        (lambda n: [0] * (n - 1), "one verdict per prompt"),
        (lambda n: [2] * n, "returned 2"),
        (lambda n: ["a"] * n, "non-numeric"),
    ],
    ids=["wrong-count", "out-of-range", "non-numeric"],
)
def test_bad_judge_output_is_rejected(tmp_path, model_path, prompts, verdicts, match):
    class BadJudge(BasePairwiseJudge):
        def judge(self, prompts, completions, shuffle_order=True):
            return verdicts(len(prompts))

    trainer = OnlineDPOTrainer(model=model_path, judge=BadJudge(), args=make_args(tmp_path), train_dataset=prompts)
    with pytest.raises(ValueError, match=match):
        trainer.train()


def test_other_bad_arguments(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="data_collator"):
        OnlineDPOTrainer(
            model=model_path,
            reward_funcs=length_reward,
            args=make_args(tmp_path),
            data_collator=lambda x: x,
            train_dataset=prompts,
        )
    with pytest.raises(ValueError, match="pairwise judge"):
        OnlineDPOTrainer(model=model_path, judge=object(), args=make_args(tmp_path), train_dataset=prompts)
    with pytest.raises(ValueError, match="reward_weights has 2 values"):
        OnlineDPOTrainer(
            model=model_path,
            reward_funcs=length_reward,
            args=make_args(tmp_path, reward_weights=[1.0, 2.0]),
            train_dataset=prompts,
        )
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="OnlineDPOConfig"):
        OnlineDPOTrainer(
            model=model_path,
            reward_funcs=length_reward,
            args=GRPOConfig(output_dir=str(tmp_path)),
            train_dataset=prompts,
        )


# ---------------------------------------------------------------------------------------------------------------------
# vLLM (colocate), in the vLLM environment: `make test-vllm`
# ---------------------------------------------------------------------------------------------------------------------
def _vllm_available():
    from trl.import_utils import is_vllm_available

    return is_vllm_available()


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)")
@pytest.mark.parametrize("trainer_name", ["OnlineDPO", "XPO", "NashMD"])
def test_vllm_colocate_generates_the_policy_completions(tmp_path, model_path, prompts, trainer_name):
    if trainer_name == "OnlineDPO":
        trainer_class, config_class = OnlineDPOTrainer, OnlineDPOConfig
    elif trainer_name == "XPO":
        from trl.experimental.xpo import XPOConfig as config_class
        from trl.experimental.xpo import XPOTrainer as trainer_class
    else:
        from trl.experimental.nash_md import NashMDConfig as config_class
        from trl.experimental.nash_md import NashMDTrainer as trainer_class
    args = make_args(tmp_path, config_class, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1)
    trainer = trainer_class(model=model_path, reward_funcs=token_sum_reward, args=args, train_dataset=prompts)
    assert trainer.vllm_generation is not None
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    logs = train_logs(trainer)
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) and "beta" in log for log in logs)
    trainer.end()
