"""Plain helpers shared by the trainer test files: argument builders, parameter snapshots, log filters, toy rewards and
judges, and independent log-probability oracles. Fixtures live in tests/conftest.py."""

import os

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM

from trl.experimental.judges import BasePairwiseJudge


# ---------------------------------------------------------------------------------------------------------------------
# Llama-style decoders built from configs (grouped-query attention: 4 query heads on 2 key/value heads, 3 layers)
# ---------------------------------------------------------------------------------------------------------------------
DECODER_PAD = 0
DECODER_VOCAB = 300
DECODER_SIZES = dict(
    vocab_size=DECODER_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=DECODER_PAD,
)


def llama_style_decoder(family: str) -> nn.Module:
    """A random-weight causal LM of `family` ("qwen2": q/k/v biases, "llama": attention and MLP biases, "mistral":
    no sliding window, "qwen3": per-head q/k norms) with [`DECODER_SIZES`]."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    builders = {
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**DECODER_SIZES)),
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**DECODER_SIZES, attention_bias=True, mlp_bias=True)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**DECODER_SIZES, sliding_window=None)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**DECODER_SIZES, head_dim=16)),
    }
    return builders[family]()


LLAMA_STYLE_FAMILIES = ("qwen2", "llama", "mistral", "qwen3")


# ---------------------------------------------------------------------------------------------------------------------
# Training arguments
# ---------------------------------------------------------------------------------------------------------------------
# Every trainer test logs each step, saves nothing unless asked and skips gradient checkpointing (tiny models, speed).
# No run report either (rendering its charts costs about a second a run): tests/test_run_report.py tests it.
COMMON_ARGS = dict(
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    gradient_checkpointing=False,
    disable_tqdm=True,
    save_run_report=False,
)
# Online pairwise trainers (Online DPO, XPO, Nash-MD): two prompts a step, short generations.
ONLINE_PAIR_ARGS = dict(max_steps=2, per_device_train_batch_size=2, max_new_tokens=8, learning_rate=1e-2, seed=0)
# Group-sampling trainers (GRPO, RLOO): two groups of two completions a step.
GROUP_ARGS = dict(
    max_steps=2,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=6,
    learning_rate=1e-2,
    seed=0,
)
# Offline preference trainers (DPO, KTO, BCO).
PREFERENCE_ARGS = dict(max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=1e-2)


# Metrics of every online trainer's rollouts (GRPO, RLOO, distillation): tokens and completion lengths.
ROLLOUT_METRICS = [
    "num_tokens",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
]


def args_builder(config_class, **defaults):
    """Return `make_args(tmp_path, config_class=config_class, **overrides)` building a config for a test.

    The config gets `output_dir=tmp_path`, then `COMMON_ARGS`, then `defaults`, then the call's overrides (later ones
    win).
    """

    def make_args(tmp_path, config_class=config_class, **overrides):
        return config_class(**{"output_dir": str(tmp_path), **COMMON_ARGS, **defaults, **overrides})

    return make_args


# ---------------------------------------------------------------------------------------------------------------------
# Parameters and logs
# ---------------------------------------------------------------------------------------------------------------------
def record_calls(monkeypatch, target, name, events, label=1, when=None):
    """Replace `target.<name>` (a class's function or an instance's bound method) by a wrapper that appends `label`
    to `events` (when `when()` is true, if given) before calling the original."""
    original = getattr(target, name)

    def recording(*args, **kwargs):
        if when is None or when():
            events.append(label)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, recording)


def snapshot(model):
    """Detached copies of every parameter, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def changed_params(before, model, trainable_only=True):
    """Names of the parameters that differ from the `snapshot` `before` (only trainable ones unless told otherwise)."""
    return [
        name
        for name, p in model.named_parameters()
        if (p.requires_grad or not trainable_only) and not torch.equal(before[name], p.detach())
    ]


def train_logs(trainer):
    """The training-step entries of the trainer's log history (those with a loss)."""
    return [log for log in trainer.state.log_history if "loss" in log]


# One plain-SGD step at learning rate 1 without clipping: the parameter change is exactly minus the gradient.
SGD_STEP_ARGS = dict(max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=1e9, lr_scheduler_type="constant")


def sgd_step_update(trainer):
    """Train `trainer` (built with `SGD_STEP_ARGS`) and return each parameter's value before minus after."""
    before = snapshot(trainer.model)
    trainer.train()
    return {name: before[name] - p.detach() for name, p in trainer.model.named_parameters()}


def perturb(model, seed=0, scale=0.05, all_params=False):
    """Add seeded Gaussian noise to the trainable parameters (to all of them with `all_params`), in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad or all_params:
                p.add_(torch.randn(p.shape, generator=generator) * scale)


def train_and_check_metrics(trainer, metrics):
    """Train `trainer`, check that its parameters changed and that the last training log and `evaluate()` hold every
    name of `metrics` (finite in the log). Returns the evaluation metrics."""
    import math

    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    last = train_logs(trainer)[-1]
    for key in metrics:
        assert key in last and math.isfinite(last[key]), key
    evaluation = trainer.evaluate()
    for key in metrics:
        assert f"eval_{key}" in evaluation, key
    return evaluation


def assert_saved_model_reloads(trainer, directory, model_class=AutoModelForCausalLM):
    """Save the trainer's model to `directory` and check that it reloads with exactly the same parameters."""
    trainer.save_model(str(directory))
    reloaded = model_class.from_pretrained(str(directory))
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, reloaded.get_parameter(name)), name


def assert_same_params(model, other, atol=1e-6):
    """Check that every parameter of `model` is close to the parameter of the same name in `other`."""
    for name, param in model.named_parameters():
        assert torch.allclose(param, other.get_parameter(name), atol=atol), name


def read_model_card(output_dir):
    """Text of the model card (README.md) a trainer wrote in `output_dir`."""
    with open(os.path.join(str(output_dir), "README.md")) as f:
        return f.read()


# ---------------------------------------------------------------------------------------------------------------------
# Shared training scenarios (each test keeps its own trainer-specific assertions)
# ---------------------------------------------------------------------------------------------------------------------
TINY_LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def train_peft_adapters_only(trainer_class, **trainer_kwargs):
    """Train a LoRA policy (`TINY_LORA`) with `trainer_class(**trainer_kwargs)` and check that there is no separate
    reference model and that only adapter weights changed. Returns the trainer and the pre-training `snapshot`."""
    from peft import LoraConfig

    trainer = trainer_class(peft_config=LoraConfig(**TINY_LORA), **trainer_kwargs)
    assert trainer.ref_model is None
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model)
    assert changed and all("lora" in name for name in changed)
    return trainer, before


def resume_from_first_checkpoint(trainer_class, args, output_dir, abs=1e-5, **trainer_kwargs):
    """Train two steps saving every step, resume a fresh trainer from `checkpoint-1` and check that its second step
    reproduces the uninterrupted run's loss. Returns the uninterrupted and the resumed trainers."""
    trainer = trainer_class(args=args, **trainer_kwargs)
    trainer.train()
    checkpoint = os.path.join(str(output_dir), "checkpoint-1")
    assert os.path.isdir(checkpoint)
    resumed = trainer_class(args=args, **trainer_kwargs)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 2
    assert train_logs(resumed)[-1]["loss"] == pytest.approx(train_logs(trainer)[-1]["loss"], abs=abs)
    return trainer, resumed


def prefer_token_rewards(trainer_class, make_args, tmp_path, model_path, prompts, below=1024, **overrides):
    """Train `trainer_class` 40 steps (groups of 8) on a reward for emitting token ids below `below` (a quarter of the
    tiny vocabulary: the untrained policy, sampled without truncation, scores about 0.25); return the logged mean
    rewards (one every 5 steps)."""

    def prefer_low_quarter(completion_ids, **kwargs):
        return [sum(t < below for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = make_args(
        tmp_path,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=8,
        learning_rate=3e-2,
        max_steps=40,
        logging_steps=5,
        **overrides,
    )
    trainer = trainer_class(model_path, reward_funcs=prefer_low_quarter, args=args, train_dataset=prompts)
    trainer.train()
    return [log["reward"] for log in train_logs(trainer)]


# ---------------------------------------------------------------------------------------------------------------------
# Toy rewards and judges
# ---------------------------------------------------------------------------------------------------------------------
def low_id_reward(completion_ids, **kwargs):
    """Share of completion tokens in the lower half of the vocabulary: varies between samples."""
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 13) / 4 for ids in completion_ids]


class ShorterJudge(BasePairwiseJudge):
    """Prefers the shorter completion of each pair (the first one on ties)."""

    def judge(self, prompts, completions, shuffle_order=True):
        return [0 if len(first) <= len(second) else 1 for first, second in completions]


# ---------------------------------------------------------------------------------------------------------------------
# Models and log-probability oracles
# ---------------------------------------------------------------------------------------------------------------------
REF_TOKEN = 42  # the token the "always the same token" reference model emits


def single_token_reference(model_path, token=REF_TOKEN):
    """A reference model that (practically) always samples `token`: its LM head gets a huge bias on that token."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    head = model.lm_head
    biased = nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[token] = 1e4
    model.lm_head = biased
    return model


def row_token_logps(model, prompt_ids, completion_ids):
    """Log-probability of each completion token after its prompt, from a plain forward pass on the unpadded tokens."""
    ids = torch.cat([prompt_ids, completion_ids]).unsqueeze(0)
    with torch.no_grad():
        logps = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    targets = ids[0, 1:]
    token_logps = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return token_logps[len(prompt_ids) - 1 :]


def row_logp(model, prompt_ids, completion_ids):
    """Summed log-probability of a completion after its prompt (see `row_token_logps`)."""
    return row_token_logps(model, prompt_ids, completion_ids).sum()


def batch_rows(batch):
    """Unpadded (prompt, completion) token tensors of every row of a batch."""
    rows = []
    for i in range(batch["prompt_ids"].shape[0]):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()]
        rows.append((prompt, completion))
    return rows


def padded_completion_logps(model, batch):
    """Per-token log-probs of a padded batch with a full log-softmax (the tests' oracle).

    Returns `(token_logps, mask, logits)`: log-probs of each next token `(B, T-1)`, the float mask of completion tokens
    that are not padding `(B, T-1)` and the float logits `(B, T-1, V)`.
    """
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    token_logps = torch.log_softmax(logits, dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = (batch["completion_mask"][:, 1:] * batch["attention_mask"][:, 1:]).float()
    return token_logps, mask, logits


def encoder_decoder_pair_logps(model, rows):
    """Oracle for encoder-decoder preference rows (TRL's `prompt_input_ids`, `chosen_labels`, `rejected_labels`).

    The `n` chosen then the `n` rejected completions are scored as decoder labels after their prompt, the model
    building its decoder input from `labels` itself, with a full log-softmax. Returns `(token_logps, mask, logits)`:
    `(2n, L)` log-probs of the label tokens, the float mask of real label tokens and the float logits `(2n, L, V)`.
    """
    prompts = [list(row["prompt_input_ids"]) for row in rows] * 2
    labels = [list(row[f"{name}_labels"]) for name in ("chosen", "rejected") for row in rows]
    width, length = max(map(len, prompts)), max(map(len, labels))
    input_ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    attention_mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    label_ids = torch.tensor([x + [-100] * (length - len(x)) for x in labels])
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, labels=label_ids).logits.float()
    mask = label_ids != -100
    token_logps = torch.log_softmax(logits, -1).gather(-1, label_ids.clamp(min=0)[..., None]).squeeze(-1) * mask
    return token_logps, mask.float(), logits


# ---------------------------------------------------------------------------------------------------------------------
# Vision-language models
# ---------------------------------------------------------------------------------------------------------------------
def recording_image_reward(seen):
    """A reward function (named `image_reward`) that appends `(prompts, completions, images)` of each call to `seen`
    and depends on the row's image (brighter top-left pixel, higher) and on the completion (so groups differ)."""

    def image_reward(prompts, completions, images, **kwargs):
        seen.append((prompts, completions, images))
        return [
            float(sum(row[0].getpixel((0, 0)))) / 765.0 + 0.01 * len(completion[0]["content"])
            for row, completion in zip(images, completions)
        ]

    return image_reward


def assert_rewards_saw_group_images(seen):
    """The first reward call got 4 completions in groups of 2: a group shares its prompt's image (also inside the
    prompt messages), the next group has another one."""
    prompts, completions, images = seen[0]
    assert len(completions) == len(images) == 4
    assert images[0][0].tobytes() == images[1][0].tobytes()
    assert images[0][0].tobytes() != images[2][0].tobytes()
    assert prompts[0][0]["content"][0]["image"] is images[0][0]


# ---------------------------------------------------------------------------------------------------------------------
# Differences of the installed transformers that tests must allow for (`make test-compat` runs the suite at the floor)
# ---------------------------------------------------------------------------------------------------------------------
def _has_response_parser() -> bool:
    from trl._compat import response_content_parsers

    return bool(response_content_parsers())


# Tool calling reads tool calls with `tokenizer.parse_response` (transformers 5); the trainers refuse tools without it.
requires_response_parser = pytest.mark.skipif(
    not _has_response_parser(), reason="tool calling needs transformers' response parser (transformers >= 5)"
)


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


# transformers 4.x rounds the logged training loss to 4 decimals; 5.x logs it as computed.
LOGGED_LOSS_TOLERANCE = 5e-5 if _transformers_major() < 5 else 0.0


def _can_build_tiny_qwen2_vl_processor() -> bool:
    import importlib.util

    import transformers

    # transformers 5.4+ builds it without a video processor; before, Qwen2VLProcessor requires one, which needs a
    # working torchvision.
    if hasattr(transformers, "PaddleOCRVLProcessor"):
        return True
    try:
        return importlib.util.find_spec("torchvision") is not None and bool(__import__("torchvision"))
    except Exception:
        return False


# The tiny Qwen2-VL processor needs transformers >= 5.4, or torchvision on older releases (its video processor).
requires_qwen2_vl_processor = pytest.mark.skipif(
    not _can_build_tiny_qwen2_vl_processor(),
    reason="the Qwen2-VL processor of transformers < 5.4 needs torchvision, which is not installed (or not loadable)",
)
QWEN2_VL = "tiny-Qwen2VLForConditionalGeneration"


def vlm_layouts(*names: str) -> list:
    """Model names as pytest params; the Qwen2-VL one carries `requires_qwen2_vl_processor`."""
    return [pytest.param(n, marks=requires_qwen2_vl_processor) if n == QWEN2_VL else n for n in names]


# The example YAMLs (examples/cli_configs) point at `.trl-assets/v1`, the tiny assets as transformers 5 saves them;
# transformers 4.x cannot read those and builds its own copy (`v1-transformers4`, see `trl._compat.saved_files_suffix`).
uses_example_yaml_assets = pytest.mark.skipif(
    _transformers_major() < 5, reason="the example YAMLs point at the transformers 5 assets (.trl-assets/v1)"
)
