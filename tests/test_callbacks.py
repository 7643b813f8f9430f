"""Tests for the shared trainer callbacks (trl/trainer/callbacks.py) and the BEMA ref-model variant.

The callbacks are driven by a plain `transformers.Trainer`: a three-weight regressor for the weight-averaging
callbacks (so that the expected weights can be computed by hand from recorded snapshots), and the tiny offline
Qwen2 causal LM from `trl.assets` for the generation callbacks.
"""

import copy
import glob
import importlib.machinery
import io
import json
import logging
import os
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch
from datasets import Dataset
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_callback import ProgressCallback

from trl import BEMACallback, LogCompletionsCallback, RichProgressCallback, SyncRefModelCallback, WeaveCallback
from trl.assets import get_model_path, load_test_dataset
from trl.experimental.bema_for_ref_model import BEMACallback as RefBEMACallback
from trl.experimental.bema_for_ref_model.callback import CallbackHandlerWithRefModel


# ---------------------------------------------------------------------------------------------------------------------
# A model with a few parameters, and helpers to drive a Trainer with it
# ---------------------------------------------------------------------------------------------------------------------


class TinyRegressorConfig(PretrainedConfig):
    model_type = "trl-test-tiny-regressor"

    def __init__(self, in_features: int = 2, **kwargs):
        self.in_features = in_features
        super().__init__(**kwargs)


class TinyRegressor(PreTrainedModel):
    """y ≈ w·x + b, plus a frozen parameter that no callback should average."""

    config_class = TinyRegressorConfig

    def __init__(self, config: TinyRegressorConfig):
        super().__init__(config)
        self.linear = nn.Linear(config.in_features, 1)
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.copy_(torch.tensor([[0.5, -0.25]]))
                module.bias.fill_(0.125)

    def forward(self, x, y=None, **kwargs):
        prediction = self.linear(x).squeeze(-1) + self.frozen.sum()
        loss = ((prediction - y) ** 2).mean() if y is not None else None
        return {"loss": loss, "logits": prediction}


def regression_dataset(n: int = 16) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=generator)
    y = 3.0 * x[:, 0] - 2.0 * x[:, 1] + 1.0
    return Dataset.from_dict({"x": x.tolist(), "y": y.tolist()})


def tiny_regressor() -> TinyRegressor:
    model = TinyRegressor(TinyRegressorConfig())
    with torch.no_grad():
        model.frozen.copy_(torch.tensor([0.01, 0.02]))
    return model


def regressor_args(output_dir, max_steps: int, args_class=TrainingArguments, **kwargs) -> TrainingArguments:
    defaults = dict(
        per_device_train_batch_size=4,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return args_class(output_dir=str(output_dir), max_steps=max_steps, **{**defaults, **kwargs})


class WeightRecorder(TrainerCallback):
    """Snapshots the trainable weights at train begin and at every step end (what callbacks see as θ_t)."""

    def __init__(self):
        self.initial = None
        self.steps = {}

    @staticmethod
    def _snapshot(model):
        return {name: p.detach().clone().double() for name, p in model.named_parameters() if p.requires_grad}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.initial = self._snapshot(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps[state.global_step] = self._snapshot(model)


def expected_bema(recorder: WeightRecorder, max_steps: int, cfg: dict) -> dict:
    """The BEMA weights after `max_steps` steps, written out from the paper's formulas (t = global step)."""
    theta0 = dict(recorder.initial)
    ema = dict(recorder.initial)
    bema = dict(recorder.initial)
    for t in range(1, max_steps + 1):
        theta = recorder.steps[t]
        if t < cfg["update_after"]:
            continue
        if t == cfg["update_after"]:
            theta0, ema = dict(theta), dict(theta)
            continue
        if (t - cfg["update_after"]) % cfg["update_freq"] != 0:
            continue
        base = cfg["lag"] + cfg["multiplier"] * t
        beta = max(base ** (-cfg["ema_power"]), cfg["min_ema_multiplier"])
        alpha = base ** (-cfg["bias_power"])
        ema = {k: (1 - beta) * ema[k] + beta * theta[k] for k in ema}
        bema = {k: alpha * (theta[k] - theta0[k]) + ema[k] for k in ema}
    return bema


def train_with(callbacks, tmp_path, max_steps, model=None, **arg_kwargs):
    model = model if model is not None else tiny_regressor()
    recorder = WeightRecorder()
    trainer = Trainer(
        model=model,
        args=regressor_args(tmp_path, max_steps, **arg_kwargs),
        train_dataset=regression_dataset(),
        callbacks=[recorder, *callbacks],
    )
    trainer.train()
    return trainer, recorder


def running_weights(callback) -> dict:
    return {name: p.detach().double() for name, p in callback.running_model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------------------------------------------------------
# BEMACallback
# ---------------------------------------------------------------------------------------------------------------------


BEMA_CONFIGS = {
    "burn-in": dict(
        update_freq=2, ema_power=0.7, bias_power=0.3, lag=3, update_after=1, multiplier=0.5, min_ema_multiplier=0.0
    ),
    "ema-floor": dict(
        update_freq=1, ema_power=0.5, bias_power=0.2, lag=10, update_after=0, multiplier=1.0, min_ema_multiplier=0.4
    ),
    "late-start": dict(
        update_freq=3, ema_power=0.5, bias_power=0.5, lag=1, update_after=2, multiplier=2.0, min_ema_multiplier=0.0
    ),
}


def test_bema_defaults_and_attributes():
    callback = BEMACallback()
    assert (callback.update_freq, callback.ema_power, callback.bias_power, callback.lag) == (400, 0.5, 0.2, 10)
    assert (callback.update_after, callback.multiplier, callback.min_ema_multiplier) == (0, 1.0, 0.0)
    assert callback.device == "cpu"
    assert callback.param_names == [] and callback.thetat_params == [] and callback.running_model is None
    assert callback.theta0_params == [] and callback.ema_params == []
    with pytest.raises(ValueError, match="update_freq"):
        BEMACallback(update_freq=0)


@pytest.mark.parametrize("name", list(BEMA_CONFIGS))
def test_bema_matches_hand_computation(tmp_path, name):
    cfg = BEMA_CONFIGS[name]
    max_steps = 7
    callback = BEMACallback(**cfg)
    trainer, recorder = train_with([callback], tmp_path, max_steps)

    # Only trainable parameters are tracked; the frozen one keeps its value in the shadow model.
    assert callback.param_names == ["linear.weight", "linear.bias"]
    assert torch.equal(callback.running_model.frozen, torch.tensor([0.01, 0.02]))

    expected = expected_bema(recorder, max_steps, cfg)
    actual = running_weights(callback)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-6)
    # Training moved the weights, and BEMA differs from them: the test is not comparing trivial copies.
    final = recorder.steps[max_steps]
    assert not torch.allclose(final["linear.weight"], recorder.initial["linear.weight"], atol=1e-3)
    assert not torch.allclose(actual["linear.weight"], final["linear.weight"], atol=1e-4)


def test_bema_ema_power_zero_makes_ema_follow_current_weights(tmp_path):
    # beta_t = 1 for every t: the "EMA" is just the latest weights, so BEMA = θ_t + α_t (θ_t − θ_0).
    callback = BEMACallback(update_freq=1, ema_power=0.0, bias_power=0.5, lag=2)
    _, recorder = train_with([callback], tmp_path, max_steps=4)
    final, initial = recorder.steps[4], recorder.initial
    alpha = (2 + 4) ** -0.5
    for name, ema in zip(callback.param_names, callback.ema_params):
        torch.testing.assert_close(ema.double(), final[name], rtol=0, atol=1e-7)
    for name, value in running_weights(callback).items():
        torch.testing.assert_close(value, final[name] + alpha * (final[name] - initial[name]), rtol=0, atol=1e-6)


def test_bema_bias_power_zero_keeps_full_correction(tmp_path):
    # alpha_t = 1 for every t; with ema_power=0 as well, BEMA = 2·θ_t − θ_0 exactly.
    callback = BEMACallback(update_freq=1, ema_power=0.0, bias_power=0.0)
    _, recorder = train_with([callback], tmp_path, max_steps=3)
    final, initial = recorder.steps[3], recorder.initial
    for name, value in running_weights(callback).items():
        torch.testing.assert_close(value, 2 * final[name] - initial[name], rtol=0, atol=1e-6)


def test_bema_large_bias_power_is_plain_ema(tmp_path):
    # alpha_t = (lag + t)^-60 ≈ 0: the shadow model is the EMA itself.
    callback = BEMACallback(update_freq=1, ema_power=0.5, bias_power=60.0)
    train_with([callback], tmp_path, max_steps=3)
    for running, ema in zip(callback._running_params, callback.ema_params):
        torch.testing.assert_close(running, ema, rtol=0, atol=1e-12)


def test_bema_saved_folder_reloads(tmp_path):
    callback = BEMACallback(update_freq=2, lag=1)
    train_with([callback], tmp_path, max_steps=4)
    bema_dir = tmp_path / "bema"
    assert (bema_dir / "config.json").is_file()
    reloaded = TinyRegressor.from_pretrained(str(bema_dir))
    for (name, saved), (_, live) in zip(reloaded.named_parameters(), callback.running_model.named_parameters()):
        assert torch.equal(saved, live), name


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_bema_buffers_live_on_configured_device(tmp_path, device):
    callback = BEMACallback(update_freq=1, device=device)
    trainer, recorder = train_with([callback], tmp_path, max_steps=2)
    expected = torch.device(device).type
    assert {t.device.type for t in callback.theta0_params + callback.ema_params} == {expected}
    assert {p.device.type for p in callback.running_model.parameters()} == {expected}
    # The buffers are copies, never views of the live parameters.
    live = {p.data_ptr() for p in trainer.model.parameters()}
    assert not live & {t.data_ptr() for t in callback.theta0_params + callback.ema_params}


# ---------------------------------------------------------------------------------------------------------------------
# BEMACallback, reference-model variant
# ---------------------------------------------------------------------------------------------------------------------


def ref_trainer(tmp_path, callback, ref_model, max_steps):
    recorder = WeightRecorder()
    trainer = Trainer(
        model=tiny_regressor(),
        args=regressor_args(tmp_path, max_steps),
        train_dataset=regression_dataset(),
        callbacks=[recorder, callback],
    )
    handler = trainer.callback_handler
    trainer.callback_handler = CallbackHandlerWithRefModel(
        handler.callbacks, trainer.model, ref_model, trainer.processing_class, trainer.optimizer, trainer.lr_scheduler
    )
    return trainer, recorder


def test_ref_bema_defaults():
    callback = RefBEMACallback()
    assert isinstance(callback, BEMACallback)
    assert (callback.update_ref_model, callback.ref_model_update_freq, callback.ref_model_update_after) == (
        False,
        400,
        0,
    )


def test_ref_bema_updates_reference_model(tmp_path):
    ref_model = tiny_regressor()
    cfg = dict(update_freq=2, ema_power=0.5, bias_power=0.2, lag=10, update_after=0, multiplier=1.0)
    callback = RefBEMACallback(**cfg, update_ref_model=True, ref_model_update_freq=3, ref_model_update_after=1)
    trainer, recorder = ref_trainer(tmp_path, callback, ref_model, max_steps=5)
    snapshots = []

    class RefRecorder(TrainerCallback):
        def on_step_end(self, args, state, control, ref_model=None, **kwargs):
            snapshots.append((state.global_step, ref_model.linear.weight.detach().clone().double()))

    trainer.add_callback(RefRecorder())
    trainer.train()

    # Reference refreshed at steps 1 and 4 (t >= 1 and (t - 1) % 3 == 0), with the BEMA weights of that moment.
    initial = recorder.initial["linear.weight"]
    by_step = dict(snapshots)
    full_cfg = {**cfg, "min_ema_multiplier": 0.0}
    torch.testing.assert_close(by_step[1], initial)  # no BEMA update yet at step 1: initial weights
    torch.testing.assert_close(by_step[2], initial)
    bema_at_4 = expected_bema(recorder, 4, full_cfg)["linear.weight"]
    torch.testing.assert_close(by_step[4], bema_at_4, rtol=0, atol=1e-6)
    torch.testing.assert_close(by_step[5], bema_at_4, rtol=0, atol=1e-6)
    assert not torch.allclose(bema_at_4, initial)


def test_ref_bema_requires_ref_model_kwarg(tmp_path):
    with pytest.raises(ValueError, match="'ref_model' not found in kwargs."):
        train_with([RefBEMACallback(update_ref_model=True, ref_model_update_freq=1)], tmp_path, max_steps=1)
    # Without `update_ref_model`, a plain handler is fine.
    train_with([RefBEMACallback(update_freq=1)], tmp_path, max_steps=1)


def test_callback_handler_with_ref_model_passes_ref_model():
    seen = {}

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.update(kwargs)

    model, ref_model = tiny_regressor(), tiny_regressor()
    handler = CallbackHandlerWithRefModel([Probe()], model, ref_model, None, None, None)
    handler.on_step_end(TrainingArguments(output_dir="unused", report_to="none"), TrainerState(), TrainerControl())
    assert seen["ref_model"] is ref_model and seen["model"] is model
    assert {"processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"} <= set(seen)


# ---------------------------------------------------------------------------------------------------------------------
# SyncRefModelCallback
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class SyncArgs(TrainingArguments):
    ref_model_sync_steps: int = field(default=2)
    ref_model_mixup_alpha: float = field(default=0.25)


def test_sync_target_model_exact_arithmetic():
    model, target = nn.Linear(2, 1), nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.fill_(4.0)
        target.weight.copy_(torch.tensor([[-1.0, 0.5]]))
        target.bias.fill_(0.0)
    SyncRefModelCallback.sync_target_model(model, target, 0.25)
    # (1 - 0.25) * target + 0.25 * model, exactly representable
    assert torch.equal(target.weight, torch.tensor([[-0.5, 0.875]]))
    assert torch.equal(target.bias, torch.tensor([1.0]))
    assert torch.equal(model.weight, torch.tensor([[1.0, 2.0]]))  # the source is untouched


def test_sync_target_model_rejects_mismatched_models():
    with pytest.raises(ValueError, match="parameter tensors"):
        SyncRefModelCallback.sync_target_model(nn.Linear(2, 1), nn.Sequential(nn.Linear(2, 1), nn.Linear(1, 1)), 0.5)


def test_sync_ref_model_during_training(tmp_path):
    ref_model = tiny_regressor()
    with torch.no_grad():
        ref_model.linear.weight.fill_(-1.0)
        ref_model.linear.bias.fill_(2.0)
    ref_initial = {n: p.detach().clone().double() for n, p in ref_model.named_parameters() if p.requires_grad}

    recorder = WeightRecorder()
    trainer = Trainer(
        model=tiny_regressor(),
        args=regressor_args(tmp_path, 5, args_class=SyncArgs, ref_model_sync_steps=2, ref_model_mixup_alpha=0.25),
        train_dataset=regression_dataset(),
        callbacks=[recorder],
    )
    trainer.add_callback(SyncRefModelCallback(ref_model=ref_model, accelerator=trainer.accelerator))
    trainer.train()

    expected = ref_initial
    for t in range(1, 6):
        if t % 2 == 0:
            expected = {k: 0.75 * expected[k] + 0.25 * recorder.steps[t][k] for k in expected}
    for name, param in ref_model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.detach().double(), expected[name], rtol=0, atol=1e-6)


def test_sync_ref_model_reads_alpha_and_frequency_from_args_at_run_time():
    model, ref_model = tiny_regressor(), tiny_regressor()
    with torch.no_grad():
        model.linear.weight.copy_(torch.tensor([[1.0, 1.0]]))
        ref_model.linear.weight.copy_(torch.tensor([[0.0, 0.0]]))
    callback = SyncRefModelCallback(ref_model=ref_model, accelerator=None)
    args = SyncArgs(output_dir="unused", report_to="none", ref_model_sync_steps=3, ref_model_mixup_alpha=0.5)
    state = TrainerState()

    state.global_step = 2  # not a multiple of 3: untouched
    callback.on_step_end(args, state, TrainerControl(), model=model)
    assert torch.equal(ref_model.linear.weight, torch.tensor([[0.0, 0.0]]))

    state.global_step = 3
    callback.on_step_end(args, state, TrainerControl(), model=model)
    assert torch.equal(ref_model.linear.weight, torch.tensor([[0.5, 0.5]]))

    args.ref_model_mixup_alpha = 0.75  # changed after construction: the new value is used
    args.ref_model_sync_steps = 2
    state.global_step = 4
    callback.on_step_end(args, state, TrainerControl(), model=model)
    assert torch.equal(ref_model.linear.weight, torch.tensor([[0.875, 0.875]]))


# ---------------------------------------------------------------------------------------------------------------------
# Generation callbacks: LogCompletionsCallback and WeaveCallback
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_path():
    return get_model_path("tiny-Qwen2ForCausalLM")


def lm_trainer(lm_path, tmp_path, eval_dataset, max_steps=4, **arg_kwargs):
    tokenizer = AutoTokenizer.from_pretrained(lm_path)
    model = AutoModelForCausalLM.from_pretrained(lm_path)
    train = load_test_dataset("standard_language_modeling", "train").select(range(16))
    train = train.map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    arg_kwargs.setdefault("report_to", "none")
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
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
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )


GREEDY = GenerationConfig(max_new_tokens=5, do_sample=False)


def greedy_completion(model, tokenizer, text: str, add_special_tokens: bool = True) -> str:
    inputs = tokenizer([text], return_tensors="pt", add_special_tokens=add_special_tokens)
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=GREEDY)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_log_completions_requires_eval_dataset(lm_path, tmp_path):
    trainer = lm_trainer(lm_path, tmp_path, eval_dataset=None)
    with pytest.raises(ValueError, match="eval_dataset"):
        LogCompletionsCallback(trainer)
    trainer = lm_trainer(lm_path, tmp_path, eval_dataset=load_test_dataset("standard_language_modeling", "test"))
    with pytest.raises(ValueError, match="prompt"):
        LogCompletionsCallback(trainer)


def test_log_completions_table_without_reporters(lm_path, tmp_path):
    eval_dataset = load_test_dataset("standard_prompt_only", "test")
    # No `freq`: the trainer's eval_steps (3) is used.
    trainer = lm_trainer(lm_path, tmp_path, eval_dataset, max_steps=6, eval_steps=3, per_device_eval_batch_size=1)
    callback = LogCompletionsCallback(trainer, generation_config=GREEDY, num_prompts=2)
    trainer.add_callback(callback)
    trainer.train()

    prompts = eval_dataset["prompt"][:2]
    assert [row[:2] for row in callback.table] == [[3, prompts[0]], [3, prompts[1]], [6, prompts[0]], [6, prompts[1]]]
    # Step 6 is the last step: its completions come from the final weights.
    trainer.model.eval()
    for row, prompt in zip(callback.table[2:], prompts):
        assert row[2] == greedy_completion(trainer.model, trainer.processing_class, prompt)
    assert trainer.processing_class.padding_side == "right"  # restored after generation


def test_log_completions_conversational_prompts_use_chat_template(lm_path, tmp_path):
    eval_dataset = load_test_dataset("conversational_prompt_only", "test")
    trainer = lm_trainer(lm_path, tmp_path, eval_dataset, max_steps=2, per_device_eval_batch_size=1)
    callback = LogCompletionsCallback(trainer, generation_config=GREEDY, num_prompts=1, freq=2)
    trainer.add_callback(callback)
    trainer.train()

    tokenizer = trainer.processing_class
    text = tokenizer.apply_chat_template(eval_dataset[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert len(callback.table) == 1
    step, prompt, completion = callback.table[0]
    assert (step, prompt) == (2, text)
    trainer.model.eval()
    assert completion == greedy_completion(trainer.model, tokenizer, text, add_special_tokens=False)


def read_offline_wandb_tables(files_dir, key: str) -> list[dict]:
    """Table files written by an offline wandb run, from its files directory (`wandb.run.dir`):
    `media/table/<key>_<step>_<hash>.table.json`."""
    pattern = os.path.join(files_dir, "media", "table", f"{key}_*.table.json")
    tables = []
    for path in glob.glob(pattern):
        with open(path) as f:
            tables.append(json.load(f))
    return sorted(tables, key=lambda table: len(table["data"]))


@pytest.mark.xdist_group("wandb")
def test_log_completions_to_wandb_offline(lm_path, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "trl-callbacks-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    if wandb.run is not None:  # a run an earlier test left open (transformers 4.x reports to wandb by default)
        wandb.finish()
    eval_dataset = load_test_dataset("standard_prompt_only", "test")
    trainer = lm_trainer(lm_path, tmp_path / "out", eval_dataset, max_steps=4, report_to=["wandb"])
    trainer.add_callback(LogCompletionsCallback(trainer, generation_config=GREEDY, num_prompts=3, freq=2))
    files_dir = None
    try:
        trainer.train()
    finally:
        # The run's own directory: an earlier wandb session in this process (transformers 4.x reports to wandb by
        # default) keeps its settings, WANDB_DIR included, so the run may live outside tmp_path.
        files_dir = wandb.run.dir if wandb.run is not None else None
        wandb.finish()
        wandb.teardown()  # wandb caches its settings (WANDB_DIR) per process; the next run must read them anew

    assert files_dir is not None
    tables = read_offline_wandb_tables(files_dir, "completions")
    assert [len(table["data"]) for table in tables] == [3, 6]  # the table is cumulative
    last = tables[-1]
    assert last["columns"] == ["step", "prompt", "completion"]
    prompts = eval_dataset["prompt"][:3]
    assert [row[:2] for row in last["data"]] == [[2, p] for p in prompts] + [[4, p] for p in prompts]
    assert all(isinstance(row[2], str) for row in last["data"])
    assert tables[0]["data"] == last["data"][:3]


class FakeWeave(types.ModuleType):
    """Stand-in for the third-party `weave` package (it needs a W&B server): records what it is asked to log."""

    def __init__(self, client=None):
        super().__init__("weave")
        self.__spec__ = importlib.machinery.ModuleSpec("weave", None)
        self.__version__ = "0.0.0"
        self.client = client
        self.init_calls = []
        self.loggers = []
        fake = self

        class Prediction:
            def __init__(self, inputs, output):
                self.inputs, self.output, self.scores, self.finished = inputs, output, {}, False

            def log_score(self, scorer, score):
                self.scores[scorer] = score

            def finish(self):
                self.finished = True

        class EvaluationLogger:
            def __init__(self, model=None, dataset=None, eval_attributes=None, **kwargs):
                self.model, self.dataset, self.eval_attributes = model, dataset, eval_attributes
                self.predictions, self.summary, self.finished = [], None, False
                fake.loggers.append(self)

            def log_prediction(self, inputs, output=None, **kwargs):
                prediction = Prediction(inputs, output)
                self.predictions.append(prediction)
                return prediction

            def log_summary(self, summary=None, auto_summarize=True):
                self.summary = summary

            def finish(self, exception=None):
                self.finished = True

        self.EvaluationLogger = EvaluationLogger

    def get_client(self):
        return self.client

    def init(self, project_name, **kwargs):
        self.init_calls.append(project_name)
        self.client = object()
        return self.client


@pytest.fixture
def fake_weave(monkeypatch):
    from trl.import_utils import _package_version

    fake = FakeWeave()
    monkeypatch.setitem(sys.modules, "weave", fake)
    _package_version.cache_clear()
    yield fake
    monkeypatch.delitem(sys.modules, "weave")
    _package_version.cache_clear()


def test_weave_callback_validation_and_mode(lm_path, tmp_path):
    trainer = lm_trainer(lm_path, tmp_path, eval_dataset=None)
    with pytest.raises(ValueError, match="eval_dataset"):
        WeaveCallback(trainer)
    trainer = lm_trainer(lm_path, tmp_path, eval_dataset=load_test_dataset("standard_prompt_only", "test"))
    assert WeaveCallback(trainer).is_evaluation_mode is False
    callback = WeaveCallback(trainer, scorers={"len": lambda p, c: len(c)}, num_prompts=2)
    assert callback.is_evaluation_mode is True and len(callback.eval_dataset) == 2
    assert callback.dataset_name == "eval_dataset" and callback.model_name is None
    with pytest.raises(ValueError, match="callable"):
        WeaveCallback(trainer, scorers={"bad": 1.0})


@pytest.mark.skipif("weave" in sys.modules, reason="weave is installed")
def test_weave_callback_without_weave_warns_and_logs_nothing(lm_path, tmp_path, caplog):
    from trl.import_utils import is_weave_available

    if is_weave_available():
        pytest.skip("weave is installed")
    trainer = lm_trainer(lm_path, tmp_path, eval_dataset=load_test_dataset("standard_prompt_only", "test"))
    callback = WeaveCallback(trainer, project_name="team/project")
    with caplog.at_level(logging.WARNING):
        callback.on_train_begin(trainer.args, trainer.state, trainer.control)
    assert "pip install weave" in caplog.text
    assert callback._weave_client is None
    # Evaluation then skips generation altogether and training carries on.
    trainer.state.global_step = 3
    callback.on_evaluate(trainer.args, trainer.state, trainer.control)
    assert callback._last_logged_step == 3


def test_weave_project_resolution(lm_path, tmp_path, fake_weave, monkeypatch):
    trainer = lm_trainer(lm_path, tmp_path, eval_dataset=load_test_dataset("standard_prompt_only", "test"))

    # An explicit project is used when no client exists yet.
    WeaveCallback(trainer, project_name="team/project").on_train_begin(trainer.args, trainer.state, trainer.control)
    assert fake_weave.init_calls == ["team/project"]

    # An existing client wins over everything.
    WeaveCallback(trainer, project_name="other").on_train_begin(trainer.args, trainer.state, trainer.control)
    assert fake_weave.init_calls == ["team/project"]

    # Nothing to go on: a clear error. (transformers 4.x's WandbCallback leaves its run open after `train()`: an
    # earlier test's run in this process would otherwise give the project.)
    fake_weave.client = None
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        monkeypatch.setattr(wandb, "run", None)
    with pytest.raises(ValueError, match="project_name"):
        WeaveCallback(trainer).on_train_begin(trainer.args, trainer.state, trainer.control)


def test_weave_evaluation_mode_logs_scores_and_summary(lm_path, tmp_path, fake_weave):
    eval_dataset = load_test_dataset("standard_prompt_only", "test")
    trainer = lm_trainer(lm_path, tmp_path, eval_dataset, per_device_eval_batch_size=1)

    def failing(prompt, completion):
        raise RuntimeError("boom")

    scorers = {"length": lambda p, c: len(c), "has_answer": lambda p, c: int("Answer" in p), "flaky": failing}
    callback = WeaveCallback(
        trainer, project_name="team/project", scorers=scorers, generation_config=GREEDY, num_prompts=2
    )
    trainer.state.global_step = 7
    callback.on_evaluate(trainer.args, trainer.state, trainer.control)
    callback.on_evaluate(trainer.args, trainer.state, trainer.control)  # same step: logged once

    assert len(fake_weave.loggers) == 1
    evaluation = fake_weave.loggers[0]
    assert evaluation.model == trainer.model.config._name_or_path == lm_path
    assert evaluation.dataset == "eval_dataset"
    assert evaluation.eval_attributes["training_step"] == 7
    assert evaluation.eval_attributes["generation_config"]["max_new_tokens"] == 5
    prompts = eval_dataset["prompt"][:2]
    expected = [greedy_completion(trainer.model, trainer.processing_class, p) for p in prompts]
    assert [p.inputs for p in evaluation.predictions] == [{"prompt": p} for p in prompts]
    assert [p.output for p in evaluation.predictions] == expected
    assert all(p.finished for p in evaluation.predictions)
    has_answer = [int("Answer" in p) for p in prompts]
    assert [p.scores for p in evaluation.predictions] == [
        {"length": len(c), "has_answer": h} for c, h in zip(expected, has_answer)
    ]
    assert evaluation.summary == {
        "total_predictions": 2,
        "successful_predictions": 0,  # the failing scorer spoils every prediction
        "avg_length": sum(len(c) for c in expected) / 2,
        "avg_has_answer": sum(has_answer) / 2,
        "avg_flaky": None,
    }


def test_weave_tracing_mode_finishes_logger(lm_path, tmp_path, fake_weave):
    trainer = lm_trainer(lm_path, tmp_path, load_test_dataset("standard_prompt_only", "test"))
    callback = WeaveCallback(trainer, project_name="p", generation_config=GREEDY, num_prompts=1, model_name="mine")
    callback.on_evaluate(trainer.args, trainer.state, trainer.control)
    (evaluation,) = fake_weave.loggers
    assert evaluation.model == "mine" and evaluation.eval_attributes["model_name"] == "mine"
    assert evaluation.finished and evaluation.summary is None
    assert len(evaluation.predictions) == 1 and evaluation.predictions[0].scores == {}


# ---------------------------------------------------------------------------------------------------------------------
# RichProgressCallback
# ---------------------------------------------------------------------------------------------------------------------


class ExtraMetrics(TrainerCallback):
    """Logs prefixed metrics through the trainer, like TRL trainers do (`rewards/...`)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.trainer.log({"rewards/chosen": 1.5, "rewards/rejected": -0.25, "eval/score": 2})


def test_rich_progress_replaces_tqdm_and_renders_grouped_metrics(tmp_path):
    from rich.console import Console

    callback = RichProgressCallback()
    callback.console = Console(file=io.StringIO(), force_terminal=True, width=120, record=True)
    trainer = Trainer(
        model=tiny_regressor(),
        args=regressor_args(tmp_path, 3, eval_strategy="steps", eval_steps=3, disable_tqdm=False),
        train_dataset=regression_dataset(),
        eval_dataset=regression_dataset(8),
        callbacks=[callback],
    )
    assert not any(isinstance(cb, ProgressCallback) for cb in trainer.callback_handler.callbacks)
    trainer.add_callback(ExtraMetrics(trainer))
    trainer.train()

    text = callback.console.export_text()
    assert "Training" in text and "100%" in text and "Evaluation" in text
    assert "Step 2" in text and "Step 3" in text and "Metric" in text and "Value" in text
    # `rewards/...` and `eval/...` keys form their own titled tables, with 3 decimals.
    assert "rewards" in text and "chosen" in text and "1.500" in text and "-0.250" in text
    assert "score" in text and "2.000" in text
    assert "eval_runtime" in text and "learning_rate" in text  # un-prefixed keys: the untitled table
    assert callback.rich_live is None and callback.current_step is None  # reset at train end


def test_rich_progress_added_after_init_removes_tqdm(tmp_path):
    from rich.console import Console

    trainer = Trainer(
        model=tiny_regressor(),
        args=TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none", use_cpu=True
        ),
        train_dataset=regression_dataset(),
    )
    assert any(isinstance(cb, ProgressCallback) for cb in trainer.callback_handler.callbacks)
    callback = RichProgressCallback()
    callback.console = Console(file=io.StringIO(), force_terminal=True, width=100, record=True)
    trainer.add_callback(callback)
    trainer.train()
    assert not any(isinstance(cb, ProgressCallback) for cb in trainer.callback_handler.callbacks)
    assert "100%" in callback.console.export_text()


def test_rich_progress_prints_the_final_panel_once_off_terminal(tmp_path):
    from rich.console import Console

    callback = RichProgressCallback()
    output = io.StringIO()
    callback.console = Console(file=output, force_terminal=False, width=120)
    trainer = Trainer(
        model=tiny_regressor(),
        args=regressor_args(tmp_path, 3, disable_tqdm=False),
        train_dataset=regression_dataset(),
        callbacks=[callback],
    )
    trainer.add_callback(ExtraMetrics(trainer))
    trainer.train()

    text = output.getvalue()
    assert "\x1b[" not in text  # no cursor movement or colours
    # As in TRL, nothing is redrawn off a terminal: the panel is printed once, in its final state (the training
    # summary logged at step 3).
    assert [text.count(f"Step {n}") for n in (1, 2, 3)] == [0, 0, 1]
    assert text.count("Training") == 1 and "100%" in text and "train_loss" in text
    assert callback.rich_live is None


def test_rich_progress_prints_logs_outside_training(tmp_path):
    from rich.console import Console

    callback = RichProgressCallback()
    output = io.StringIO()
    callback.console = Console(file=output, force_terminal=False, width=100)
    trainer = Trainer(
        model=tiny_regressor(),
        args=regressor_args(tmp_path, 1, disable_tqdm=False),
        train_dataset=regression_dataset(),
        eval_dataset=regression_dataset(8),
        callbacks=[callback],
    )
    metrics = trainer.evaluate()
    assert "Step 0" in output.getvalue() and "eval_runtime" in output.getvalue()
    assert f"{metrics['eval_runtime']:.3f}" in output.getvalue()


# TRL 1.16's panel for these events (spinner frame and times replaced by `*` and `T`), recorded from its output.
TRL_RICH_PANEL = """\
╭──────────────────────────────────────────────────────────────────────────────────────────────────╮
│ Training   ━━━━━━━━━━━━━                             33% T                                 │
│ * ╭────────────────────────────────────────── Step 1 ──────────────────────────────────────────╮ │
│   │ ╭──────────────────────────────────────────────╮ ╭───────────────────────────────────────╮ │ │
│   │ │  Metric          Value                       │ │       rewards                         │ │ │
│   │ │  loss            1.234                       │ │  Metric       Value                   │ │ │
│   │ │  grad_norm       0.500                       │ │  accuracy     0.750                   │ │ │
│   │ │  learning_rate   0.000                       │ │  format/mean  0.250                   │ │ │
│   │ │  num_tokens     27.000                       │ ╰───────────────────────────────────────╯ │ │
│   │ │  epoch           0.500                       │                                           │ │
│   │ ╰──────────────────────────────────────────────╯                                           │ │
│   ╰────────────────────────────────────────────────────────────────────────────────────────────╯ │
╰──────────────────────────────────────────────────────────────────────────────────────────────────╯
"""


def _normalised_panel(text: str) -> str:
    import re

    return re.sub(r"\d+:\d\d:\d\d|-:--:--", "T", re.sub("[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]", "*", text))


def _drive_rich_progress(callback, tmp_path, logs):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    state, control = TrainerState(max_steps=3), TrainerControl()
    callback.on_train_begin(args, state, control)
    state.global_step = 1
    callback.on_step_end(args, state, control)
    callback.on_log(args, state, control, logs=logs)
    callback.on_train_end(args, state, control)


def test_rich_progress_renders_trls_layout(tmp_path):
    from rich.console import Console

    callback = RichProgressCallback()
    callback.console = Console(file=io.StringIO(), force_terminal=False, width=100, color_system=None, record=True)
    logs = {"loss": 1.2345, "grad_norm": 0.5, "learning_rate": 2e-5, "rewards/accuracy": 0.75}
    logs.update({"rewards/format/mean": 0.25, "num_tokens": 27.0, "epoch": 0.5})
    _drive_rich_progress(callback, tmp_path, logs)
    assert _normalised_panel(callback.console.export_text()).rstrip("\n") == TRL_RICH_PANEL.rstrip("\n")


def test_rich_progress_formats_values_like_trl():
    from trl.trainer.progress_callback import _format_metric

    assert [_format_metric(v) for v in (3, True, 1.5e-7, -2.25, None, "abc")] == [
        "3.000",
        "1.000",
        "0.000",
        "-2.250",
        "None",
        "abc",
    ]


def test_rich_progress_works_without_ipython(tmp_path):
    # IPython made unimportable before anything is imported: the callback must not need it.
    script = f"""
import io, sys
sys.modules["IPython"] = None
from rich.console import Console
from transformers import TrainerControl, TrainerState, TrainingArguments
from trl import RichProgressCallback
callback = RichProgressCallback()
callback.console = Console(file=io.StringIO(), force_terminal=False, width=100)
args = TrainingArguments(output_dir={str(tmp_path)!r}, report_to="none", use_cpu=True)
state = TrainerState(max_steps=1)
callback.on_train_begin(args, state, TrainerControl())
callback.on_log(args, state, TrainerControl(), logs={{"loss": 1.0}})
callback.on_train_end(args, state, TrainerControl())
assert "Step 0" in callback.console.file.getvalue()
"""
    import subprocess

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ)
    assert result.returncode == 0, result.stderr[-2000:]


def test_regression_helpers_are_deterministic():
    # Guards the hand computations above: the recorded θ_t must come from a deterministic run.
    assert regression_dataset()["y"][:2] == regression_dataset()["y"][:2]
    assert torch.equal(copy.deepcopy(tiny_regressor()).linear.weight, torch.tensor([[0.5, -0.25]]))


def test_resuming_a_checkpoint_without_reference_or_bema_state_warns(tmp_path, caplog):
    """A TRL checkpoint keeps neither the SyncRef reference nor BEMA's averages: resuming one says they restart."""
    from trl.trainer.utils.checkpoints import load_reference_model

    model = nn.Linear(2, 2)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    # Listen on the two modules' loggers themselves: another test may have stopped `trl` loggers propagating.
    loggers = [logging.getLogger("trl.trainer.utils.checkpoints"), logging.getLogger("trl.trainer.callbacks")]
    for logger in loggers:
        logger.addHandler(caplog.handler)
        caplog.set_level(logging.WARNING, logger=logger.name)
    try:
        load_reference_model(str(tmp_path), model)
        BEMACallback().load_checkpoint_files(str(tmp_path))
    finally:
        for logger in loggers:
            logger.removeHandler(caplog.handler)
    assert "holds no reference-model weights (ref_model.safetensors" in caplog.text
    assert "holds no BEMA state (bema_state.safetensors" in caplog.text
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
