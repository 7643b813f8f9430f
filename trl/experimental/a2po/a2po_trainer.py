"""A*-PO: policy optimisation by regressing the optimal advantage.

Stage 1 (once, before training): for each prompt, `num_value_samples` completions are sampled from the frozen
reference model and scored; the optimal value is estimated as `V*(x) = beta1 * (logsumexp(r_i / beta1) - log N)`.
Stage 2 (each step): one completion per prompt is sampled from the policy and scored, and the policy regresses the
optimal advantage: `loss = mean_i (beta2 * log(pi(y_i|x_i) / pi_ref(y_i|x_i)) - (r_i - V*(x_i)))^2`
(Brantley et al., 2025, https://huggingface.co/papers/2505.20686).
"""

import contextlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from accelerate.utils import gather_object
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase, Trainer

from ...data_utils import maybe_apply_chat_template
from ...kernels.log_softmax import selective_log_softmax
from ...models.utils import unwrap_model_for_generation
from ...trainer.base_trainer import _BaseTrainer
from ...trainer.fast_paths.small_row_linear import small_row_linear
from ...trainer.online_rewards import _to_float_list
from ...trainer.utils.logprobs import small_head_output
from ..utils import create_reference_model
from .a2po_config import A2POConfig


RewardFunc = Callable[..., list[float]]


def optimal_value(rewards: torch.Tensor, beta1: float) -> torch.Tensor:
    """Soft-max estimate of the optimal value from `N` reference samples per prompt.

    `V*(x) = beta1 * (logsumexp_i(r_i / beta1) - log N)`, over the last dimension.

    Args:
        rewards: `(..., N)` rewards of the reference samples of each prompt.
        beta1: Temperature (`beta1 -> 0` gives the max, `beta1 -> inf` the mean).

    Returns:
        `(...)` value estimates.
    """
    n = rewards.shape[-1]
    return beta1 * (torch.logsumexp(rewards / beta1, dim=-1) - math.log(n))


def a2po_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    beta2: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least-squares regression of the optimal advantage.

    `loss = mean_i (beta2 * (logp_i - ref_logp_i) - (r_i - V*_i))^2`.

    Args:
        policy_logps: `(B,)` sequence log-probabilities under the policy (with gradient).
        ref_logps: `(B,)` sequence log-probabilities under the reference.
        rewards: `(B,)` rewards of the completions.
        values: `(B,)` optimal values `V*(x_i)` of their prompts.
        beta2: Weight of the log-ratio.

    Returns:
        `(loss, implicit_rewards, advantages)`: the scalar loss, and the `(B,)` terms `beta2 * log-ratio` and
        `r - V*`.
    """
    implicit_rewards = beta2 * (policy_logps - ref_logps)
    advantages = rewards - values
    return ((implicit_rewards - advantages) ** 2).mean(), implicit_rewards, advantages


def first_eos_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """`(B, C)` mask that is 1 up to and including the first token of `eos_token_ids` in each row (all ones when a
    row has none)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    width = completion_ids.shape[1]
    first = torch.where(
        is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(is_eos[:, 0], width, dtype=torch.long)
    )
    positions = torch.arange(width, device=completion_ids.device).expand_as(completion_ids)
    return (positions <= first.unsqueeze(1)).long()


class A2POTrainer(_BaseTrainer):
    """Trainer for A*-PO: an offline optimal-value estimate from reference samples, then on-policy regression of the
    optimal advantage (one completion per prompt, generated with `generate`).

    Example:

    ```python
    from datasets import load_dataset
    from trl.experimental.a2po import A2POConfig, A2POTrainer
    from trl.rewards import accuracy_reward

    dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
    trainer = A2POTrainer(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        reward_funcs=accuracy_reward,
        args=A2POConfig(output_dir="Qwen2.5-0.5B-A2PO"),
        train_dataset=dataset,
    )
    trainer.train()
    ```

    Args:
        model: Model to train, or a path / hub id loaded with `AutoModelForCausalLM` and `args.model_init_kwargs`.
        reward_funcs: One function or a list; each is called with `prompts`, `completions` (decoded text) and the
            other dataset columns as keywords, and returns one reward per completion (assumed binary, 0 or 1).
        args: Configuration; `None` gives `A2POConfig(f"{model id}-A2PO")`.
        train_dataset: Dataset with a `prompt` column (standard or conversational).
        eval_dataset: Optional evaluation dataset of the same format.
        processing_class: Tokenizer; `None` loads the model's with `padding_side="left"`.
        callbacks: Extra trainer callbacks.
        optimizers: `(optimizer, lr_scheduler)` to use instead of the defaults.
    """

    _tag_names = ["trl", "a2po"]
    _name = "A2PO"
    # The reference scores each batch in `_prepare_inputs`, before the policy's forward pass.
    _reference_pass_after_policy_forward = False
    _paper = {
        "title": "Accelerating RL for LLM Reasoning with Optimal Advantage Regression",
        "id": "2505.20686",
        "citation": """\
@article{brantley2025accelerating,
    title        = {{Accelerating RL for LLM Reasoning with Optimal Advantage Regression}},
    author       = {Kiant'e Brantley and Mingyu Chen and Zhaolin Gao and Jason D. Lee and Wen Sun and Wenhao Zhan and Xuezhou Zhang},
    year         = 2025,
    eprint       = {arXiv:2505.20686},
}""",
    }

    def __init__(
        self,
        model: PreTrainedModel | str,
        reward_funcs: RewardFunc | list[RewardFunc],
        args: A2POConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class: PreTrainedTokenizerBase | None = None,
        callbacks=None,
        optimizers=(None, None),
    ):
        if args is None:
            args = A2POConfig(f"{self._model_id(model)}-A2PO")
        model_id = self._model_id(model)
        model = self._load_model(model, args)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                model_id, padding_side="left", trust_remote_code=args.trust_remote_code
            )
        tokenizer = self._ensure_pad_token(processing_class)

        self.reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        if not self.reward_funcs or not all(callable(func) for func in self.reward_funcs):
            raise TypeError("A2POTrainer: reward_funcs must be a callable or a non-empty list of callables.")
        weights = args.reward_weights
        if weights is not None and len(weights) != len(self.reward_funcs):
            raise ValueError(
                f"A2POTrainer: reward_weights has {len(weights)} values but there are {len(self.reward_funcs)} reward "
                "functions; give one weight per function."
            )
        self.reward_weights = torch.tensor(weights or [1.0] * len(self.reward_funcs), dtype=torch.float32)
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if dataset is not None and "prompt" not in (getattr(dataset, "column_names", None) or []):
                raise ValueError(f"A2POTrainer: {name} needs a 'prompt' column.")

        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
        if tokenizer.eos_token_id is not None:
            eos_ids.append(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(set(eos_ids))
        forward = inspect.signature(model.forward).parameters
        self.model_kwarg_keys = set(forward)
        sampling = dict(
            do_sample=True,
            max_new_tokens=args.max_completion_length,
            pad_token_id=tokenizer.pad_token_id,
            temperature=args.temperature,
            top_p=args.top_p,
        )
        if args.top_k is not None:
            sampling["top_k"] = args.top_k
        self.value_generation_config = GenerationConfig(num_return_sequences=args.num_value_samples, **sampling)
        self.generation_config = GenerationConfig(num_return_sequences=1, **sampling)
        self._optimal_values: dict[str, float] | None = None
        self._init_metrics()

        ref_model = create_reference_model(model)
        super().__init__(
            model=model,
            args=args,
            data_collator=lambda features: features,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.ref_model = self._prepare_ref_model(ref_model)

    # ------------------------------------------------------------------------------------------------------------
    # Generation and rewards
    # ------------------------------------------------------------------------------------------------------------
    @property
    def _tokenizer(self) -> PreTrainedTokenizerBase:
        return getattr(self.processing_class, "tokenizer", self.processing_class)

    def _prompt_texts(self, examples: list[dict[str, Any]]) -> list[str]:
        return [
            maybe_apply_chat_template({"prompt": ex["prompt"]}, self.processing_class)["prompt"] for ex in examples
        ]

    def _sample(
        self, model: nn.Module, texts: list[str], generation_config: GenerationConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample completions of `texts`: `(prompt_ids, prompt_mask, completion_ids, completion_mask)`, the prompt
        rows repeated `num_return_sequences` times."""
        max_length = self.args.max_prompt_length
        encoded = self._tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            truncation=max_length is not None,
            max_length=max_length,
        )
        prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
        device = self.accelerator.device
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        with torch.no_grad():
            if model is self.ref_model:
                with small_row_linear(model):
                    output = model.generate(
                        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config
                    )
            else:
                with (
                    unwrap_model_for_generation(
                        model, self.accelerator, gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
                    ) as unwrapped,
                    small_row_linear(unwrapped),
                ):
                    output = unwrapped.generate(
                        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config
                    )
        repeats = generation_config.num_return_sequences or 1
        completion_ids = output[:, prompt_ids.shape[1] :]
        completion_mask = first_eos_mask(completion_ids, self.eos_token_ids)
        return (
            prompt_ids.repeat_interleave(repeats, dim=0),
            prompt_mask.repeat_interleave(repeats, dim=0),
            completion_ids,
            completion_mask,
        )

    def _calculate_rewards(self, prompts, completions, **reward_kwargs) -> torch.Tensor:
        """Weighted sum of the reward functions on decoded `completions`: a `(B,)` float tensor."""
        total = torch.zeros(len(completions), dtype=torch.float32)
        for weight, func in zip(self.reward_weights, self.reward_funcs):
            name = getattr(func, "__name__", type(func).__name__)
            values = func(prompts=prompts, completions=completions, **reward_kwargs)
            total += weight * torch.tensor(_to_float_list(values, name, len(completions), prompts))
        return total.to(self.accelerator.device)

    def _score(self, examples: list[dict[str, Any]], completion_ids, completion_mask, repeats: int) -> torch.Tensor:
        rows = [ex for ex in examples for _ in range(repeats)]
        kept = [ids[mask.bool()] for ids, mask in zip(completion_ids, completion_mask)]
        completions = self._tokenizer.batch_decode(kept, skip_special_tokens=True)
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        return self._calculate_rewards([row["prompt"] for row in rows], completions, **columns)

    # ------------------------------------------------------------------------------------------------------------
    # Stage 1: optimal values from reference samples
    # ------------------------------------------------------------------------------------------------------------
    def _estimate_optimal_values(self) -> None:
        """Sample `num_value_samples` reference completions per prompt of the train and eval datasets, cache
        `V*(x)` per templated prompt, and (with `filter_all_incorrect`) drop training prompts with no reward."""
        values: dict[str, float] = {}
        solved: dict[str, bool] = {}
        n = self.args.num_value_samples
        # Evaluation prompts are sampled in batches of the training batch size too (as in TRL).
        batch_size = self.args.per_device_train_batch_size
        evals = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        for dataset in [self.train_dataset, *evals]:
            if dataset is None:
                continue
            # A sequential loader over this process's share of the prompts (iterating one draws its base seed from
            # the global generator, as TRL's does, so the samples that follow are TRL's).
            shard = dataset
            if self.accelerator.num_processes > 1:
                shard = dataset.shard(self.accelerator.num_processes, self.accelerator.process_index, contiguous=False)
            local: dict[str, tuple[float, bool]] = {}
            for batch in DataLoader(shard, batch_size=batch_size, collate_fn=lambda features: features):
                texts = self._prompt_texts(batch)
                _, _, completion_ids, completion_mask = self._sample(
                    self.ref_model, texts, self.value_generation_config
                )
                rewards = self._score(batch, completion_ids, completion_mask, n).view(len(batch), n).cpu()
                for text, row_rewards, value in zip(texts, rewards, optimal_value(rewards, self.args.beta1)):
                    local[text] = (value.item(), row_rewards.sum().item() != 0)
            for part in gather_object([local]):
                for text, (value, any_correct) in part.items():
                    values[text] = value
                    solved[text] = any_correct
        self._optimal_values = values
        if self.args.filter_all_incorrect and self.train_dataset is not None:
            keep = [solved.get(text, True) for text in self._prompt_texts(list(self.train_dataset))]
            if not all(keep):
                indices = [i for i, kept in enumerate(keep) if kept]
                self.train_dataset = self.train_dataset.filter(lambda _, i: keep[i], with_indices=True)
                if not isinstance(self.train_dataset, Dataset) or len(self.train_dataset) != len(indices):
                    raise RuntimeError("A2POTrainer: filtering the all-incorrect prompts failed.")
                if len(indices) == 0:
                    raise ValueError(
                        "A2POTrainer: every training prompt got reward 0 on all its value samples, so "
                        "filter_all_incorrect removed them all. Use an easier dataset, more num_value_samples, or "
                        "filter_all_incorrect=False."
                    )

    def train(self, *args, **kwargs):
        """Estimate the optimal values (stage 1) if not done yet, then train as [`~transformers.Trainer.train`]."""
        if self._optimal_values is None:
            self._estimate_optimal_values()
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # Stage 2: on-policy regression
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_inputs(self, inputs):
        """Sample one completion per prompt from the policy, score it, and attach `V*(x)` and the reference
        sequence log-probability."""
        if self._optimal_values is None:
            self._estimate_optimal_values()
        texts = self._prompt_texts(inputs)
        prompt_ids, prompt_mask, completion_ids, completion_mask = self._sample(
            self.model, texts, self.generation_config
        )
        rewards = self._score(inputs, completion_ids, completion_mask, 1)
        missing = [text for text in texts if text not in self._optimal_values]
        if missing:
            raise KeyError(f"A2POTrainer: no optimal value was estimated for the prompt {missing[0]!r}.")
        values = torch.tensor([self._optimal_values[text] for text in texts], device=rewards.device)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.shape[1]
        with torch.no_grad():
            ref_logps = self._get_sequence_logps(self.ref_model, input_ids, attention_mask, logits_to_keep)
        self._record_metric("reward", rewards.mean())
        self._record_metric("v_star", values.mean())
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "logits_to_keep": logits_to_keep,
            "rewards": rewards,
            "v_star": values,
            "ref_logps": ref_logps,
        }

    def _get_sequence_logps(self, model, input_ids, attention_mask, logits_to_keep) -> torch.Tensor:
        """`(B,)` sum of the log-probabilities of the last `logits_to_keep` tokens (the completion), counted where
        `attention_mask` is 1."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "logits_to_keep" in self.model_kwarg_keys:
            kwargs["logits_to_keep"] = logits_to_keep + 1
        logits = model(**kwargs).logits[:, -(logits_to_keep + 1) : -1]
        token_logps = selective_log_softmax(logits, input_ids[:, -logits_to_keep:])
        return (token_logps * attention_mask[:, -logits_to_keep:]).sum(dim=1)

    def _small_logits(self, input_ids: torch.Tensor, logits_to_keep: int) -> Any:
        """Declares the policy's logits small when the model builds them at the completion positions only: those
        logits, their log-softmax and their gradients, four copies in float32 (see `small_head_output`)."""
        if "logits_to_keep" not in self.model_kwarg_keys:
            return contextlib.nullcontext()
        vocab_size = self.accelerator.unwrap_model(self.model).config.get_text_config().vocab_size
        return small_head_output(4 * input_ids.shape[0] * (logits_to_keep + 1) * vocab_size * 4)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("A2POTrainer does not support return_outputs=True.")
        input_ids, logits_to_keep = inputs["input_ids"], inputs["logits_to_keep"]
        with self._small_logits(input_ids, logits_to_keep):
            logps = self._get_sequence_logps(model, input_ids, inputs["attention_mask"], logits_to_keep)
        loss, implicit_rewards, advantages = a2po_loss(
            logps, inputs["ref_logps"], inputs["rewards"], inputs["v_star"], self.args.beta2
        )
        self._record_metric("implicit_reward", implicit_rewards.mean())
        self._record_metric("advantage", advantages.mean())
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys: list[str] | None = None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the window's metric means (`eval_`-prefixed in evaluation) to a copy of `logs` and log it."""
        mode = self._mode
        metrics = {key: sum(values) / len(values) for key, values in self._metrics[mode].items() if values}
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        Trainer.log(self, {**logs, **metrics}, start_time)
        self._metrics[mode].clear()
