"""WinRateCallback with a tiny causal LM, a plain transformers Trainer and deterministic pairwise judges."""

import copy
import glob
import json
import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    GenerationConfig,
    Trainer,
    TrainingArguments,
)

import trl
from trl.assets import get_model_path, load_test_dataset
from trl.experimental.judges import BasePairwiseJudge
from trl.experimental.winrate_callback import WinRateCallback


GREEDY = GenerationConfig(max_new_tokens=4, do_sample=False)
NUM_PROMPTS = 4


class PrefersChangeJudge(BasePairwiseJudge):
    """Deterministic judge: identical completions get no verdict (-1); otherwise the shorter one wins, the policy
    (index 1) on ties. Records every call."""

    def __init__(self):
        self.calls = []

    def judge(self, prompts, completions, shuffle_order=True):
        self.calls.append((list(prompts), [list(pair) for pair in completions], shuffle_order))
        verdicts = []
        for reference, policy in completions:
            if reference == policy:
                verdicts.append(-1)
            else:
                verdicts.append(0 if len(reference) < len(policy) else 1)
        return verdicts


class ScriptedJudge(BasePairwiseJudge):
    """Returns a fixed list of verdicts (or probabilities with `return_scores=True`)."""

    def __init__(self, verdicts, scores=None):
        self.verdicts = verdicts
        self.scores = scores
        self.calls = []

    def judge(self, prompts, completions, shuffle_order=True, return_scores=False):
        self.calls.append((list(prompts), return_scores))
        return list(self.scores if return_scores else self.verdicts)


class NoScoresJudge(BasePairwiseJudge):
    def judge(self, prompts, completions, shuffle_order=True):
        return [1] * len(prompts)


@pytest.fixture(scope="module")
def lm_path():
    return get_model_path("tiny-Qwen2ForCausalLM")


def eval_prompts(tokenizer, config_name="standard_prompt_only"):
    """Evaluation prompts, with token ids of their text so that the Trainer's evaluation loss runs on them."""
    dataset = load_test_dataset(config_name, "test").select(range(NUM_PROMPTS))

    def tokenize(row):
        prompt = row["prompt"]
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        return tokenizer(text)

    return dataset.map(tokenize)


def make_trainer(lm_path, tmp_path, eval_dataset="standard_prompt_only", max_steps=2, **arg_kwargs):
    tokenizer = AutoTokenizer.from_pretrained(lm_path)
    model = AutoModelForCausalLM.from_pretrained(lm_path)
    train = load_test_dataset("standard_language_modeling", "train").select(range(8))
    train = train.map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    arg_kwargs.setdefault("report_to", "none")
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=2,
        learning_rate=5e-2,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **arg_kwargs,
    )
    return Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=None if eval_dataset is None else eval_prompts(tokenizer, eval_dataset),
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )


def greedy_completions(model, tokenizer, prompts):
    model.eval()
    completions = []
    for prompt in prompts:
        inputs = tokenizer([prompt], return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, generation_config=GREEDY)
        completions.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    return completions


def win_rate_logs(trainer):
    return [(entry["step"], entry["eval_win_rate"]) for entry in trainer.state.log_history if "eval_win_rate" in entry]


def test_import_paths():
    assert trl.WinRateCallback is WinRateCallback


def test_win_rate_logged_during_training(lm_path, tmp_path):
    trainer = make_trainer(lm_path, tmp_path, eval_strategy="steps", eval_steps=2)
    initial_model = copy.deepcopy(trainer.model)
    judge = PrefersChangeJudge()
    callback = WinRateCallback(judge, trainer, generation_config=GREEDY, shuffle_order=False)
    trainer.add_callback(callback)
    trainer.train()

    prompts = trainer.eval_dataset["prompt"]
    # Without a ref_model the reference completions come from the model as it was when training started.
    assert callback.ref_completions == greedy_completions(initial_model, trainer.processing_class, prompts)
    policy = greedy_completions(trainer.model, trainer.processing_class, prompts)

    (baseline_prompts, baseline_pairs, _), (eval_prompts_seen, eval_pairs, shuffle_order) = judge.calls
    assert baseline_prompts == eval_prompts_seen == prompts
    assert baseline_pairs == [[ref, ref] for ref in callback.ref_completions]
    assert eval_pairs == [[ref, pol] for ref, pol in zip(callback.ref_completions, policy)]
    assert shuffle_order is False

    expected = sum(ref != pol and len(pol) <= len(ref) for ref, pol in eval_pairs) / NUM_PROMPTS
    # Baseline: identical pairs are all -1 verdicts, which count as not won.
    assert win_rate_logs(trainer) == [(0, 0.0), (2, expected)]
    assert 0.0 < expected <= 1.0  # training changed the completions, and the judge saw it


def test_invalid_verdicts_count_as_losses_and_evaluate_returns_the_rate(lm_path, tmp_path):
    trainer = make_trainer(lm_path, tmp_path)
    judge = ScriptedJudge([1, -1, 0, 1])
    trainer.add_callback(WinRateCallback(judge, trainer, generation_config=GREEDY, num_prompts=NUM_PROMPTS))
    metrics = trainer.evaluate()  # no training: the reference completions are generated on the fly
    assert metrics["eval_win_rate"] == 0.5
    assert win_rate_logs(trainer) == [(0, 0.5)]
    assert judge.calls == [(trainer.eval_dataset["prompt"], False)]


def test_num_prompts_limits_the_prompts(lm_path, tmp_path):
    trainer = make_trainer(lm_path, tmp_path)
    judge = ScriptedJudge([0, 1])
    callback = WinRateCallback(judge, trainer, generation_config=GREEDY, num_prompts=2)
    trainer.add_callback(callback)
    assert trainer.evaluate()["eval_win_rate"] == 0.5
    assert judge.calls[0][0] == trainer.eval_dataset["prompt"][:2]
    assert len(callback.ref_completions) == 2


def test_soft_judge_logs_average_win_probability(lm_path, tmp_path):
    trainer = make_trainer(lm_path, tmp_path)
    judge = ScriptedJudge(verdicts=None, scores=[0.8, 0.3, 0.5, 0.1])
    trainer.add_callback(WinRateCallback(judge, trainer, generation_config=GREEDY, use_soft_judge=True))
    metrics = trainer.evaluate()
    # The reference wins only where P(reference better) > 0.5.
    assert metrics["eval_win_rate"] == 0.75
    assert metrics["eval_avg_win_prob"] == pytest.approx(1 - (0.8 + 0.3 + 0.5 + 0.1) / 4)
    assert judge.calls[0][1] is True


def test_reference_completions_come_from_ref_model(lm_path, tmp_path):
    trainer = make_trainer(lm_path, tmp_path)
    torch.manual_seed(1)
    ref_model = AutoModelForCausalLM.from_config(trainer.model.config).eval()
    trainer.ref_model = ref_model  # what preference trainers expose
    callback = WinRateCallback(PrefersChangeJudge(), trainer, generation_config=GREEDY)
    trainer.add_callback(callback)
    trainer.evaluate()

    prompts = trainer.eval_dataset["prompt"]
    tokenizer = trainer.processing_class
    ref_completions = greedy_completions(ref_model, tokenizer, prompts)
    assert ref_completions != greedy_completions(trainer.model, tokenizer, prompts)  # the test can tell them apart
    assert callback.ref_completions == ref_completions


def test_conversational_prompts_reach_the_judge_as_text(lm_path, tmp_path):
    trainer = make_trainer(lm_path, tmp_path, eval_dataset="conversational_prompt_only")
    judge = PrefersChangeJudge()
    callback = WinRateCallback(judge, trainer, generation_config=GREEDY, num_prompts=2)
    trainer.add_callback(callback)
    assert 0.0 <= trainer.evaluate()["eval_win_rate"] <= 1.0
    first = trainer.eval_dataset[0]["prompt"]
    assert judge.calls[0][0][0] == f"User: {first[0]['content']}"
    # Generation used the chat template.
    tokenizer = trainer.processing_class
    text = tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    trainer.model.eval()
    with torch.no_grad():
        output = trainer.model.generate(**inputs, generation_config=GREEDY)
    expected = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert callback.ref_completions[0] == expected


@pytest.mark.xdist_group("wandb")
def test_completions_table_to_wandb_offline(lm_path, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "trl-winrate-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    if wandb.run is not None:  # a run an earlier test left open (transformers 4.x reports to wandb by default)
        wandb.finish()
    trainer = make_trainer(lm_path, tmp_path / "out", report_to=["wandb"], eval_strategy="steps", eval_steps=2)
    callback = WinRateCallback(ScriptedJudge([1, 0, -1, 1]), trainer, generation_config=GREEDY)
    trainer.add_callback(callback)
    files_dir = None
    try:
        trainer.train()
    finally:
        # The run's own directory: an earlier wandb session in this process keeps its settings (WANDB_DIR included),
        # so the run may live outside tmp_path.
        files_dir = wandb.run.dir if wandb.run is not None else None
        wandb.finish()
        wandb.teardown()  # wandb caches its settings (WANDB_DIR) per process; the next run must read them anew

    assert files_dir is not None
    paths = glob.glob(os.path.join(files_dir, "media", "table", "win_rate_completions_*.table.json"))
    assert len(paths) == 1  # one evaluation, one table
    with open(paths[0]) as f:
        table = json.load(f)
    assert table["columns"] == ["step", "prompt", "reference_model", "policy", "winner_index"]
    prompts = trainer.eval_dataset["prompt"]
    assert [row[:3] for row in table["data"]] == [[2, p, r] for p, r in zip(prompts, callback.ref_completions)]
    assert [row[4] for row in table["data"]] == [1, 0, -1, 1]
    assert all(isinstance(row[3], str) for row in table["data"])


def test_bad_input(lm_path, tmp_path):
    trainer = make_trainer(lm_path, tmp_path, eval_dataset=None)
    with pytest.raises(ValueError, match="eval_dataset"):
        WinRateCallback(PrefersChangeJudge(), trainer)

    trainer = make_trainer(lm_path, tmp_path)
    with pytest.raises(ValueError, match="return_scores"):
        WinRateCallback(NoScoresJudge(), trainer, use_soft_judge=True)
    with pytest.raises(ValueError, match="pairwise judge"):
        WinRateCallback(object(), trainer)

    trainer.add_callback(WinRateCallback(ScriptedJudge([1, 0]), trainer, generation_config=GREEDY))
    with pytest.raises(ValueError, match="returned 2 results for 4 prompts"):
        trainer.evaluate()


_DISTRIBUTED_SCRIPT = r"""
import json, os, sys
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, GenerationConfig
from transformers import Trainer, TrainingArguments
from trl.assets import get_model_path, load_test_dataset
from trl.experimental.judges import BasePairwiseJudge
from trl.experimental.winrate_callback import WinRateCallback
from trl.scripts._training import release_process_group


class CountingJudge(BasePairwiseJudge):
    def __init__(self):
        self.calls = 0

    def judge(self, prompts, completions, shuffle_order=True):
        self.calls += 1
        return [1, 0, -1, 1, 1][: len(prompts)]


out = sys.argv[1]
path = get_model_path("tiny-Qwen2ForCausalLM")
tokenizer = AutoTokenizer.from_pretrained(path)
train = load_test_dataset("standard_language_modeling", "train").select(range(8))
train = train.map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
evaluation = load_test_dataset("standard_prompt_only", "test").select(range(5))
evaluation = evaluation.map(lambda row: tokenizer(row["prompt"]))
args = TrainingArguments(
    output_dir=out, max_steps=2, per_device_train_batch_size=2, per_device_eval_batch_size=2, learning_rate=1e-2,
    eval_strategy="steps", eval_steps=2, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
)
trainer = Trainer(
    model=AutoModelForCausalLM.from_pretrained(path), args=args, train_dataset=train, eval_dataset=evaluation,
    processing_class=tokenizer, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
judge = CountingJudge()
callback = WinRateCallback(judge, trainer, generation_config=GenerationConfig(max_new_tokens=3, do_sample=False))
trainer.add_callback(callback)
trainer.train()
rates = [(e["step"], e["eval_win_rate"]) for e in trainer.state.log_history if "eval_win_rate" in e]
with open(os.path.join(out, f"rank{args.process_index}.json"), "w") as f:
    json.dump({"world": args.world_size, "judge_calls": judge.calls, "rates": rates, "refs": callback.ref_completions}, f)
release_process_group()
"""


@pytest.mark.distributed
def test_win_rate_with_two_processes(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_DISTRIBUTED_SCRIPT)
    code = (
        "from trl.cli.accelerate_config import resolve_accelerate_config_argument\n"
        "from trl.cli.accelerate_launcher import launch_training_script\n"
        f"launch_training_script({str(script)!r}, resolve_accelerate_config_argument(['--num_processes', '2']), "
        f"[{str(tmp_path)!r}])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    # The judge runs on the main process only (baseline + one evaluation); the rate reaches every process.
    assert [r["judge_calls"] for r in ranks] == [2, 0]
    assert ranks[0]["rates"] == ranks[1]["rates"] == [[0, 0.6], [2, 0.6]]
    # Five prompts split 3 + 2 over the processes and gathered back in order on both.
    assert len(ranks[0]["refs"]) == 5
    assert ranks[0]["refs"] == ranks[1]["refs"]
