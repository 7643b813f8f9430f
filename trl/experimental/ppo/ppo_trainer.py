"""PPO for language models (Ziegler et al. 2019; "The N+ implementation details of RLHF with PPO", Huang et al. 2024).

One training step (an "update") of [`PPOTrainer.train`]:

1. take `local_batch_size` tokenized prompts;
2. roll out: sample `response_length` tokens per prompt (the shared generation helper of the online trainers), then,
   in chunks of `local_rollout_forward_batch_size` and without gradients, the policy's and the reference's
   log-probabilities of the sampled tokens, the value model's values and the reward model's score of each response
   (cut after the stop token);
3. rewards: `-kl_coef * KL` per token plus the score after the last token ([`token_rewards`]); advantages and returns
   by GAE; advantages whitened;
4. `num_ppo_epochs` passes over the batch in `num_mini_batches` shuffled mini-batches (one optimizer step each, with
   gradient accumulation over micro-batches of `per_device_train_batch_size`), minimising the clipped policy loss
   plus `vf_coef` times the clipped value loss;
5. log the step's metrics (`objective/*`, `policy/*`, `loss/*`, `val/*`).

The pure maths is in `ppo_math.py`.
"""

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from accelerate.utils import gather_object
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding, GenerationConfig, TrainerCallback, TrainerState

from ...models.utils import disable_dropout_in_model, prepare_deepspeed, unwrap_model_for_generation
from ...trainer.base_trainer import _BaseTrainer
from ...trainer.online_generation import generate_with_shared_prompts
from ...trainer.utils import print_prompt_completions_sample
from ...trainer.utils.logprobs import compute_token_logps
from ..utils import create_reference_model, first_true_indices, get_reward, truncate_right
from .modeling_value_head import PreTrainedModelWrapper
from .ppo_config import PPOConfig, clips_gradients
from .ppo_math import (
    INVALID_LOGPROB,
    clipped_policy_loss,
    clipped_value_loss,
    generalized_advantage_estimation,
    masked_mean,  # noqa: F401  (TRL's module-level name)
    masked_var,  # noqa: F401  (TRL's module-level name)
    masked_whiten,
    response_masks,
    token_rewards,
)


logger = logging.getLogger(__name__)

# Added to the sampling temperature so that a temperature of 0 never divides by zero.
_TEMPERATURE_EPS = 1e-7
_VALUE_MODEL_DIR = "value_model"


@dataclass
class _PPOTrainerState(TrainerState):
    """Trainer state with the number of episodes (prompts) seen, saved in checkpoints."""

    episode: int = 0


class _PolicyAndValue(nn.Module):
    """The trained module: the policy and the value model, optimised together.

    `forward` runs the policy and the value model's backbone on the same inputs. A value-head model sharing the
    policy (`AutoModelForCausalLMWithValueHead` around the same module) is run once.
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.shares_backbone = isinstance(value_model, PreTrainedModelWrapper) and (
            value_model.pretrained_model is policy
        )
        if not isinstance(value_model, PreTrainedModelWrapper):
            self.critic_backbone = getattr(value_model, value_model.base_model_prefix)
        self.config = getattr(policy, "config", None)


def _value_forward(value_model: nn.Module, **inputs: Any) -> torch.Tensor:
    """Values `(B, L)` of a sequence-classification model (backbone + `score`) or a value-head model."""
    if isinstance(value_model, PreTrainedModelWrapper):
        return value_model(**inputs)[2]
    backbone = getattr(value_model, value_model.base_model_prefix)
    hidden = backbone(**inputs, output_hidden_states=True, return_dict=True, use_cache=False).hidden_states[-1]
    return value_model.score(hidden).squeeze(-1)


def _model_inputs(query_responses: torch.Tensor, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Padding tokens masked out and positions counted from the first real token (left-padded prompts)."""
    attention_mask = query_responses != pad_token_id
    return {
        "input_ids": query_responses.masked_fill(~attention_mask, 0),
        "attention_mask": attention_mask.long(),
        "position_ids": attention_mask.long().cumsum(1) - attention_mask.long(),
    }


def _cat_right_padded(chunks: list[torch.Tensor], value: float) -> torch.Tensor:
    """Chunks of rows stacked along dim 0, each first right-padded along dim 1 to the longest with `value`."""
    length = max(chunk.size(1) for chunk in chunks)
    return torch.cat(
        [nn.functional.pad(c, (0, 0) * (c.dim() - 2) + (0, length - c.size(1)), value=value) for c in chunks]
    )


@torch.no_grad()
def batch_generation(
    model: nn.Module,
    queries: torch.Tensor,
    local_rollout_forward_batch_size: int,
    pad_token_id: int,
    generation_config: GenerationConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate a response to each query with `model.generate`, `local_rollout_forward_batch_size` queries at a time.

    Args:
        model: The causal LM to sample from.
        queries: `(B, L)` left-padded query ids (`pad_token_id` on padding, masked out of attention).
        local_rollout_forward_batch_size: Queries per `generate` call.
        pad_token_id: Padding id of the queries and of the returned, right-padded responses.
        generation_config: Sampling settings.

    Returns:
        `(query_responses, logits)`: `(B, L + T)` queries followed by their responses (chunks whose generation
        stopped earlier padded with `pad_token_id`), and `(B, T, V)` the scores `generate` sampled each response token
        from (after its logits processors such as the temperature; 0 on padding).
    """
    context_length = queries.shape[1]
    query_responses, logits = [], []
    for rows in queries.split(local_rollout_forward_batch_size):
        output = model.generate(
            input_ids=rows,
            attention_mask=(rows != pad_token_id).long(),
            generation_config=generation_config,
            return_dict_in_generate=True,
            output_scores=True,
        )
        query_responses.append(torch.cat([rows, output.sequences[:, context_length:]], dim=1))
        logits.append(torch.stack(output.scores, dim=1))
    return _cat_right_padded(query_responses, pad_token_id), _cat_right_padded(logits, 0.0)


class PPOTrainer(_BaseTrainer):
    """Trainer for Proximal Policy Optimization with a value model, a reward model and a KL penalty to a reference.

    Args:
        args: [`PPOConfig`].
        processing_class: Tokenizer of the policy (its pad token must be set); the reward and value models score the
            policy's token ids directly, so they must share its vocabulary.
        model: The policy (a causal LM).
        ref_model: Reference policy; None uses a frozen copy of `model`, or the policy with its adapters disabled
            when training PEFT adapters.
        reward_model: Sequence-classification model giving one score per response.
        train_dataset: Prompts tokenized into an `input_ids` column.
        value_model: Sequence-classification model (its `score` head gives one value per token), or a
            [`AutoModelForCausalLMWithValueHead`] (possibly around `model` itself, sharing the backbone).
        data_collator: Collator of the prompt batches (default: padding with the tokenizer, left-padded prompts).
        eval_dataset: Prompts used for sample completions and `evaluate()`.
        optimizers: `(optimizer, lr_scheduler)`; created from `args` when None.
        callbacks: Extra callbacks.
        peft_config: Train PEFT adapters on `model` (then `ref_model` may be None).
    """

    _tag_names = ["trl", "ppo"]
    _name = "PPO"
    _paper = {
        "title": "Fine-Tuning Language Models from Human Preferences",
        "id": "1909.08593",
        "citation": (
            "@article{mziegler2019fine-tuning,\n    title        = {{Fine-Tuning Language Models from Human "
            "Preferences}},\n    author       = {Daniel M. Ziegler and Nisan Stiennon and Jeffrey Wu and Tom B. Brown "
            "and Alec Radford and Dario Amodei and Paul F. Christiano and Geoffrey Irving},\n    year         = "
            "2019,\n    eprint       = {arXiv:1909.08593}\n}"
        ),
    }

    def __init__(
        self,
        args: PPOConfig,
        processing_class: Any,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model: nn.Module,
        train_dataset: Dataset,
        value_model: nn.Module,
        data_collator: Any = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        optimizers: tuple = (None, None),
        callbacks: list[TrainerCallback] | None = None,
        peft_config: Any = None,
    ) -> None:
        if args is None:
            args = PPOConfig(output_dir="ppo-output")
        self._check_inputs(args, processing_class, model, ref_model, reward_model, train_dataset, value_model)
        self.args = args

        policy = self._wrap_peft(model, peft_config, args) if peft_config is not None else model
        self.policy_model = policy
        self.is_peft_model = self._is_peft_model(policy)
        if self.is_peft_model:
            self.ref_model = ref_model  # None: the policy with its adapters disabled (null_ref_context)
        else:
            self.ref_model = ref_model if ref_model is not None else create_reference_model(policy)
        self.reward_model = reward_model
        self.value_model = value_model
        self.train_dataset_len = len(train_dataset)

        # Responses end at the stop token (none by default: always `response_length` tokens).
        self.stop_token_id = processing_class.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        policy.generation_config.eos_token_id = self.stop_token_id
        for module in (policy, self.ref_model, reward_model, value_model):
            if module is not None:
                disable_dropout_in_model(module)

        self._derive_batch_sizes(args, train_dataset)
        model_module = _PolicyAndValue(policy, value_model)
        if data_collator is None:
            data_collator = DataCollatorWithPadding(processing_class)
        super().__init__(
            model=model_module,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            optimizers=optimizers,
            callbacks=callbacks,
        )
        # One optimizer step per mini-batch: gradients of its micro-batches are accumulated (and the loss scaled).
        self.accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps
        self._init_state()
        self._init_metrics()
        self.create_optimizer_and_scheduler(num_training_steps=args.num_total_batches)
        self.local_seed = args.seed + self.accelerator.process_index * 100003
        self.sample_generations_freq = (
            max(1, args.num_total_batches // args.num_sample_generations) if args.num_sample_generations > 0 else 0
        )
        if args.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)

        self.dataloader = DataLoader(
            train_dataset,
            batch_size=args.local_batch_size,
            shuffle=True,
            collate_fn=self.data_collator,
            drop_last=True,
        )
        # The shuffling generator is drawn from the global RNG when the dataloader is prepared: seed it first so that
        # every process shuffles alike, then move every process to its own seed.
        # A plain RandomSampler with an accelerate-synchronised generator (not transformers' seedable sampler):
        # the prompt order then only depends on `seed`, as in TRL.
        dataloader_config = self.accelerator.dataloader_config
        seedable, dataloader_config.use_seedable_sampler = dataloader_config.use_seedable_sampler, False
        torch.manual_seed(args.seed)
        try:
            self.model_wrapped, self.optimizer, self.dataloader = self.accelerator.prepare(
                self.model, self.optimizer, self.dataloader
            )
        finally:
            dataloader_config.use_seedable_sampler = seedable
        torch.manual_seed(self.local_seed)
        eval_data = eval_dataset if not isinstance(eval_dataset, dict) else next(iter(eval_dataset.values()), None)
        self.eval_dataloader = None
        if eval_data is not None:
            self.eval_dataloader = self.accelerator.prepare(
                DataLoader(eval_data, batch_size=args.per_device_eval_batch_size, collate_fn=self.data_collator)
            )
        for name in ("ref_model", "reward_model"):
            module = getattr(self, name)
            if module is None:
                continue
            if self.is_deepspeed_enabled:
                setattr(self, name, prepare_deepspeed(module, self.accelerator))
            else:
                setattr(self, name, module.to(self.accelerator.device).eval())
        self._add_model_tags(policy)

    # ------------------------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_inputs(args, processing_class, model, ref_model, reward_model, train_dataset, value_model) -> None:
        """Reject what would fail (or silently train wrong) once training starts."""
        for name, module in (("model", model), ("reward_model", reward_model), ("value_model", value_model)):
            if module is None:
                raise ValueError(
                    f"PPOTrainer needs a {name}; got None. Pass an instantiated model (e.g. "
                    f"AutoModelForSequenceClassification.from_pretrained(path, num_labels=1) for the reward and "
                    "value models)."
                )
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"PPOTrainer expects {name} to be an instantiated model; got {type(module).__name__}. Load it "
                    "first, e.g. with AutoModelForCausalLM.from_pretrained(path)."
                )
        if ref_model is not None and ref_model is model:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the same as `model`, "
                "you must make a copy of it, or `None` if you use peft. (With `ref_model=None` a frozen copy is made, "
                "or the adapters are disabled when training PEFT adapters.)"
            )
        if getattr(processing_class, "pad_token_id", None) is None:
            raise ValueError(
                "The processing class has no pad token; set tokenizer.pad_token (e.g. to a dedicated token) before "
                "creating the trainer: padding marks the end of every response."
            )
        if train_dataset is None or "input_ids" not in (getattr(train_dataset, "column_names", None) or []):
            found = getattr(train_dataset, "column_names", None)
            raise ValueError(
                f"PPOTrainer trains on tokenized prompts: train_dataset needs an 'input_ids' column; found {found}. "
                "Tokenize the prompts first, e.g. dataset.map(lambda row: tokenizer(row['prompt']))."
            )
        if not hasattr(reward_model, "score") and not isinstance(reward_model, PreTrainedModelWrapper):
            raise ValueError(
                f"reward_model must be a sequence-classification model with a `score` head (e.g. "
                f"AutoModelForSequenceClassification with num_labels=1); got {type(reward_model).__name__}."
            )
        PPOTrainer._warn_on_vocabulary_mismatch(model, reward_model, value_model, processing_class)

    @staticmethod
    def _warn_on_vocabulary_mismatch(model: Any, reward_model: Any, value_model: Any, processing_class: Any) -> None:
        """Warn when the reward or value model may not share the policy's tokenizer.

        PPO scores the policy's token ids with both models directly (no mapping between vocabularies). TRL trains in
        these cases, and they are often harmless: a pad token added to the policy's tokenizer lies past the end of
        the reward model's embeddings, but padding is replaced before scoring. So they warn here; an id that really
        falls outside a model's embeddings is refused when it is scored (`get_reward`).
        """
        vocab_size = len(processing_class)
        policy_vocab = processing_class.get_vocab()
        for name, module in (("reward_model", reward_model), ("value_model", value_model)):
            embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
            rows = getattr(embeddings, "num_embeddings", None)
            if rows is not None and rows < vocab_size:
                logger.warning(
                    f"The {name} embeds {rows} token ids but the policy's tokenizer has {vocab_size}: it scores the "
                    f"policy's token ids directly, so any id from {rows} up would be out of range (padding is "
                    "replaced before scoring, so an added pad token is fine). Train the reward/value model on the "
                    "policy's tokenizer if other ids may reach it."
                )
            own_tokenizer = _saved_tokenizer(module)
            own_vocab = own_tokenizer.get_vocab() if own_tokenizer is not None else None
            if own_vocab is not None and any(
                policy_vocab.get(token, index) != index for token, index in own_vocab.items()
            ):
                logger.warning(
                    f"The {name} was saved with a different tokenizer ({module.name_or_path}) than the policy's: "
                    "PPO scores the policy's token ids with it (no mapping between vocabularies is done), so the "
                    f"scores may be meaningless. Use a {name} trained with the policy's tokenizer."
                )
            policy_size = getattr(getattr(model, "config", None), "vocab_size", None)
            own = getattr(getattr(module, "config", None), "vocab_size", None)
            if policy_size is not None and own is not None and own < policy_size:
                logger.warning(
                    f"The {name} has a vocabulary of {own} tokens, the policy {policy_size}: PPO scores the policy's "
                    f"token ids with it, so a sampled id from {own} up would be out of range."
                )

    @staticmethod
    def _derive_batch_sizes(args: PPOConfig, train_dataset: Dataset) -> None:
        from accelerate import PartialState

        world_size = PartialState().num_processes
        args.world_size = world_size
        args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
        args.micro_batch_size = args.per_device_train_batch_size * world_size
        args.batch_size = args.local_batch_size * world_size
        if args.local_batch_size % args.num_mini_batches:
            raise ValueError(
                f"The rollout batch of {args.local_batch_size} prompts per process (per_device_train_batch_size * "
                f"gradient_accumulation_steps) must split into num_mini_batches={args.num_mini_batches} equal parts."
            )
        args.mini_batch_size = args.batch_size // args.num_mini_batches
        args.local_mini_batch_size = args.local_batch_size // args.num_mini_batches
        if len(train_dataset) < args.local_batch_size:
            raise ValueError(
                f"train_dataset has {len(train_dataset)} prompts, fewer than one rollout batch of "
                f"{args.local_batch_size} (per_device_train_batch_size * gradient_accumulation_steps): lower "
                "these or add prompts."
            )
        if args.whiten_rewards and args.local_mini_batch_size < 8:
            raise ValueError(
                f"Per-rank minibatch size {args.local_mini_batch_size} is insufficient for whitening: whiten_rewards "
                "needs at least 8 prompts per mini-batch (per_device_train_batch_size * gradient_accumulation_steps "
                "/ num_mini_batches)."
            )
        if args.max_steps > 0:
            args.total_episodes = args.max_steps * args.batch_size
        elif args.total_episodes is None:
            args.total_episodes = int(args.num_train_epochs * len(train_dataset))
        args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)

    def get_train_dataloader(self) -> DataLoader:
        return self.dataloader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        if eval_dataset is None or isinstance(eval_dataset, str):
            return self.eval_dataloader
        return self.accelerator.prepare(
            DataLoader(eval_dataset, batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator)
        )

    @contextlib.contextmanager
    def null_ref_context(self):
        """With a PEFT policy and no reference model: the policy with its adapters disabled (or the reference adapter
        `ref_adapter_name` active), restoring `model_adapter_name` afterwards."""
        policy = self.accelerator.unwrap_model(self.model_wrapped).policy
        if self.args.ref_adapter_name is None:
            with policy.disable_adapter():
                yield
            return
        policy.set_adapter(self.args.ref_adapter_name)
        try:
            yield
        finally:
            policy.set_adapter(self.args.model_adapter_name or "default")

    # ------------------------------------------------------------------------------------------------------------
    # Rollouts
    # ------------------------------------------------------------------------------------------------------------
    def _generation_config(self, temperature: float, max_new_tokens: int) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            temperature=temperature + _TEMPERATURE_EPS,
            top_k=0,
            top_p=1.0,
            do_sample=True,
            pad_token_id=self.processing_class.pad_token_id,
        )

    @torch.no_grad()
    def _generate(
        self, policy: nn.Module, queries: torch.Tensor, chunk: int, config: GenerationConfig
    ) -> torch.Tensor:
        """Prompt + response ids `(B, L + T)`, generated `chunk` prompts at a time, responses right-padded."""
        pad_token_id = self.processing_class.pad_token_id
        outputs = []
        for rows in queries.split(chunk):
            mask = rows != pad_token_id
            outputs.append(
                generate_with_shared_prompts(
                    policy,
                    rows.masked_fill(~mask, 0),
                    mask.long(),
                    torch.arange(rows.size(0), device=rows.device),
                    config,
                    disable_compile=True,
                )
            )
        # `generate` wrote 0 in place of the prompts' padding: put the pad id back (it marks padding downstream).
        return torch.cat([queries, _cat_right_padded(outputs, pad_token_id)[:, queries.size(1) :]], dim=1)

    def _response_logps(
        self,
        model: nn.Module,
        query_responses: torch.Tensor,
        context_length: int,
        entropy: bool = False,
        hidden_states: bool = False,
    ):
        """Log-probabilities (and entropies) of the response tokens `(B, T)` at the sampling temperature; the LM head
        runs only on response positions."""
        inputs = _model_inputs(query_responses, self.processing_class.pad_token_id)
        target_mask = torch.zeros_like(query_responses[:, 1:], dtype=torch.bool)
        target_mask[:, context_length - 1 :] = True
        result = compute_token_logps(
            model,
            **inputs,
            target_mask=target_mask,
            temperature=self.args.temperature + _TEMPERATURE_EPS,
            compute_entropy=entropy,
            output_hidden_states=hidden_states,
        )
        logps = result.logps[:, context_length - 1 :]
        ent = result.entropy[:, context_length - 1 :] if entropy else None
        return logps, ent, result.outputs

    @torch.no_grad()
    def _rollout(self, queries: torch.Tensor) -> dict[str, torch.Tensor]:
        """Generate responses and score them: step 2 of the algorithm (see the module docstring)."""
        args = self.args
        pad_token_id = self.processing_class.pad_token_id
        context_length = queries.size(1)
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        with unwrap_model_for_generation(
            self.model_wrapped,
            self.accelerator,
            gather_deepspeed3_params=args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
        ) as unwrapped:
            query_responses = self._generate(
                unwrapped.policy,
                queries,
                args.local_rollout_forward_batch_size,
                self._generation_config(args.temperature, args.response_length),
            )
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("logprobs", "ref_logprobs", "values", "scores")}
        postprocessed = []
        for start in range(0, queries.size(0), args.local_rollout_forward_batch_size):
            query_response = query_responses[start : start + args.local_rollout_forward_batch_size]
            response = query_response[:, context_length:]
            parts["logprobs"].append(self._response_logps(wrapper.policy, query_response, context_length)[0])
            if self.ref_model is None:
                with self.null_ref_context():
                    ref_logps = self._response_logps(wrapper.policy, query_response, context_length)[0]
            else:
                ref_logps = self._response_logps(self.ref_model, query_response, context_length)[0]
            parts["ref_logprobs"].append(ref_logps)
            if self.stop_token_id is not None:
                response = truncate_right(response, self.stop_token_id, pad_token_id)[0]
            postprocessed.append(response)
            values = _value_forward(wrapper.value_model, **_model_inputs(query_response, pad_token_id))
            parts["values"].append(values[:, context_length - 1 : -1])
            scored = torch.cat([query_response[:, :context_length], response], dim=1)
            parts["scores"].append(get_reward(self.reward_model, scored, pad_token_id, context_length)[1])
        batch = {k: torch.cat(v) for k, v in parts.items()}
        batch["query_responses"] = query_responses
        batch["responses"] = query_responses[:, context_length:]
        batch["postprocessed_responses"] = torch.cat(postprocessed)
        return batch

    def _advantages(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rewards, GAE advantages and returns of a rollout batch: step 3 of the algorithm."""
        args = self.args
        responses = batch["postprocessed_responses"]
        sequence_lengths = first_true_indices(responses == self.processing_class.pad_token_id) - 1
        scores = batch["scores"]
        contains_eos = (responses == self.processing_class.eos_token_id).any(dim=-1)
        if args.missing_eos_penalty is not None:
            scores = scores.clone()
            scores[~contains_eos] -= args.missing_eos_penalty
        padding_mask, padding_mask_p1 = response_masks(sequence_lengths, responses.size(1))
        logprobs = batch["logprobs"].masked_fill(padding_mask, INVALID_LOGPROB)
        ref_logprobs = batch["ref_logprobs"].masked_fill(padding_mask, INVALID_LOGPROB)
        values = batch["values"].masked_fill(padding_mask_p1, 0)
        rewards, kl, non_score_reward = token_rewards(
            scores, logprobs, ref_logprobs, sequence_lengths, args.kl_coef, args.kl_estimator
        )
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0)
        advantages, returns = generalized_advantage_estimation(rewards, values, args.gamma, args.lam)
        advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)
        return {
            **batch,
            "scores": scores,
            "logprobs": logprobs,
            "values": values,
            "kl": kl,
            "non_score_reward": non_score_reward,
            "advantages": advantages,
            "returns": returns,
            "padding_mask": padding_mask,
            "padding_mask_p1": padding_mask_p1,
        }

    # ------------------------------------------------------------------------------------------------------------
    # Optimisation
    # ------------------------------------------------------------------------------------------------------------
    def _policy_and_values(self, query_responses: torch.Tensor, context_length: int):
        """Response log-probabilities, entropies and values `(B, T)` of the trained module (with gradients), under the
        mixed-precision autocast that the prepared module's forward would run (its policy and value model are called
        directly here)."""
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        with self.accelerator.autocast():
            logps, entropy, outputs = self._response_logps(
                wrapper.policy, query_responses, context_length, entropy=True, hidden_states=wrapper.shares_backbone
            )
            if wrapper.shares_backbone:
                values = wrapper.value_model.v_head(outputs.hidden_states[-1]).squeeze(-1)
            else:
                inputs = _model_inputs(query_responses, self.processing_class.pad_token_id)
                values = _value_forward(wrapper.value_model, **inputs)
        return logps, entropy, values[:, context_length - 1 : -1].float()

    def _ppo_epochs(self, data: dict[str, torch.Tensor], context_length: int) -> dict[str, torch.Tensor]:
        """Step 4 of the algorithm; returns the per-micro-batch statistics."""
        args = self.args
        shape = (args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps)
        stats = {k: torch.zeros(shape, device=self.accelerator.device) for k in _STAT_NAMES}
        model = self.model_wrapped
        for epoch in range(args.num_ppo_epochs):
            order = torch.from_numpy(np.random.permutation(args.local_batch_size))
            for mini_idx, mini_start in enumerate(range(0, args.local_batch_size, args.local_mini_batch_size)):
                mini = order[mini_start : mini_start + args.local_mini_batch_size]
                for micro_idx, micro_start in enumerate(
                    range(0, args.local_mini_batch_size, args.per_device_train_batch_size)
                ):
                    with self.accelerator.accumulate(model):
                        rows = mini[micro_start : micro_start + args.per_device_train_batch_size].to(
                            self.accelerator.device
                        )
                        padding, padding_p1 = data["padding_mask"][rows], data["padding_mask_p1"][rows]
                        logps, entropy, vpred = self._policy_and_values(data["query_responses"][rows], context_length)
                        logps = logps.masked_fill(padding, INVALID_LOGPROB)
                        vpred = vpred.masked_fill(padding_p1, 0)
                        vf_loss, vf_clipfrac = clipped_value_loss(
                            vpred, data["values"][rows], data["returns"][rows], ~padding_p1, args.cliprange_value
                        )
                        policy = clipped_policy_loss(
                            data["advantages"][rows], logps, data["logprobs"][rows], ~padding, args.cliprange
                        )
                        loss = policy.loss + args.vf_coef * vf_loss
                        self.accelerator.backward(loss)
                        if self.accelerator.sync_gradients and clips_gradients(args.max_grad_norm):
                            self.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                        self.optimizer.step()
                        self.optimizer.zero_grad()
                    index = (epoch, mini_idx, micro_idx)
                    stats["approxkl"][index] = policy.approxkl
                    stats["pg_clipfrac"][index] = policy.clipfrac
                    stats["pg_loss"][index] = policy.loss.detach()
                    stats["vf_loss"][index] = vf_loss.detach()
                    stats["vf_clipfrac"][index] = vf_clipfrac
                    stats["entropy"][index] = entropy.detach().mean()
                    stats["ratio"][index] = policy.ratio.detach().mean()
        return stats

    def _step_metrics(self, data: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], start: float) -> dict:
        """Step 5: the logged metrics, averaged over processes."""
        gather = self.accelerator.gather_for_metrics

        def mean(value: torch.Tensor) -> float:
            return gather(value.reshape(1)).mean().item()

        mean_non_score_reward = data["non_score_reward"].sum(1).mean()
        return {
            "eps": int(self.state.episode / max(time.time() - start, 1e-9)),
            "objective/kl": mean(data["kl"].sum(1).mean()),
            "objective/entropy": mean((-data["logprobs"]).sum(1).mean()),
            "objective/non_score_reward": mean(mean_non_score_reward),
            "objective/rlhf_reward": mean(mean_non_score_reward + data["scores"].mean()),
            "objective/scores": mean(data["scores"].mean()),
            "policy/approxkl_avg": mean(stats["approxkl"].mean()),
            "policy/clipfrac_avg": mean(stats["pg_clipfrac"].mean()),
            "loss/policy_avg": mean(stats["pg_loss"].mean()),
            "loss/value_avg": mean(stats["vf_loss"].mean()),
            "val/clipfrac_avg": mean(stats["vf_clipfrac"].mean()),
            "policy/entropy_avg": mean(stats["entropy"].mean()),
            "val/ratio": mean(stats["ratio"].mean()),
            # Undefined (NaN) with a single micro-batch per update.
            "val/ratio_var": mean(stats["ratio"].var()) if stats["ratio"].numel() > 1 else float("nan"),
            "val/num_eos_tokens": int(
                gather((data["responses"] == self.processing_class.eos_token_id).sum().reshape(1)).sum().item()
            ),
            "lr": self.lr_scheduler.get_last_lr()[0],
            "episode": self.state.episode,
        }

    def _batches(self):
        while True:
            yield from self.dataloader

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> None:
        """Run `num_total_batches` PPO updates (see the module docstring), optionally resuming from a checkpoint
        (`True`: the last one in `output_dir`)."""
        if kwargs:
            raise TypeError(f"PPOTrainer.train got unexpected arguments {sorted(kwargs)}.")
        args = self.args
        self._init_state()
        batches = self._batches()
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint, batches)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start = time.time()
        self.model_wrapped.train()
        while self.state.global_step < args.num_total_batches:
            self.state.episode += args.batch_size
            queries = next(batches)["input_ids"].to(self.accelerator.device)
            context_length = queries.size(1)
            data = self._advantages(self._rollout(queries))
            stats = self._ppo_epochs(data, context_length)
            metrics = self._step_metrics(data, stats, start)
            self.state.epoch = self.state.episode / self.train_dataset_len
            self.state.global_step += 1
            self.log(metrics)
            self.lr_scheduler.step()
            del data, stats
            if self.sample_generations_freq and (self.state.global_step - 1) % self.sample_generations_freq == 0:
                self.generate_completions(sampling=True)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_save:
                self._save_checkpoint(self.model, trial=None)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(args, self.state, self.control)

    def _init_state(self) -> None:
        args = self.args
        from transformers.trainer_callback import ExportableState

        stateful = [cb for cb in [*self.callback_handler.callbacks, self.control] if isinstance(cb, ExportableState)]
        self.state = _PPOTrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=stateful,
        )
        self.state.max_steps = args.num_total_batches
        self.state.num_train_epochs = args.total_episodes / self.train_dataset_len
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name)
            if value is not None:
                steps = math.ceil(args.num_total_batches * value) if value < 1 else value
                setattr(self.state, name, steps)
        self.state.train_batch_size = args.batch_size

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # The step metrics arrive complete; the `_metrics` accumulator of the base stays empty in training.
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    # ------------------------------------------------------------------------------------------------------------
    # Sample completions and evaluation
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _score_eval_batches(self, sampling: bool, dataloader: DataLoader | None = None) -> dict[str, list]:
        args = self.args
        pad_token_id = self.processing_class.pad_token_id
        dataloader = dataloader if dataloader is not None else self.eval_dataloader
        if dataloader is None:
            raise ValueError("No eval_dataset was given to PPOTrainer: sample completions and evaluate() need one.")
        table: dict[str, list] = {"query": [], "model response": [], "score": [], "eos": []}
        config = self._generation_config(0.01, args.response_length)
        if not sampling:
            config = GenerationConfig(max_new_tokens=args.response_length, do_sample=False, pad_token_id=pad_token_id)
        with unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, gather_deepspeed3_params=args.ds3_gather_for_generation
        ) as unwrapped:
            for batch in dataloader:
                query = batch["input_ids"].to(self.accelerator.device)
                context_length = query.size(1)
                query_response = self._generate(unwrapped.policy, query, query.size(0), config)
                response = query_response[:, context_length:]
                if self.stop_token_id is not None:
                    response = truncate_right(response, self.stop_token_id, pad_token_id)[0]
                table["query"] += gather_object(self.processing_class.batch_decode(query, skip_special_tokens=True))
                table["model response"] += gather_object(self.processing_class.batch_decode(response))
                scored = torch.cat([query, response], dim=1)
                score = get_reward(self.reward_model, scored, pad_token_id, context_length)[1]
                table["score"] += self.accelerator.gather_for_metrics(score).float().cpu().tolist()
                eos = (response == self.processing_class.eos_token_id).any(dim=-1)
                table["eos"] += self.accelerator.gather_for_metrics(eos).cpu().tolist()
                if sampling:
                    break
        return table

    def generate_completions(self, sampling: bool = False) -> None:
        """Generate responses to the evaluation prompts (temperature 0.01), score them and print the first five
        (rich) and log the table to wandb / Comet when they are reporting. `sampling=True` stops after one batch."""
        table = self._score_eval_batches(sampling)
        if not self.accelerator.is_main_process:
            return
        n = min(5, len(table["query"]))
        try:
            print_prompt_completions_sample(
                table["query"][:n],
                table["model response"][:n],
                {"score": table["score"][:n]},
                None,
                self.state.global_step,
            )
        except ImportError:
            pass
        report_to = self.args.report_to or []
        if "wandb" in report_to or "comet_ml" in report_to:
            import pandas as pd

            frame = pd.DataFrame({k: v for k, v in table.items() if k != "eos"})
            if "wandb" in report_to:
                import wandb

                if wandb.run is not None:
                    wandb.log({"completions": wandb.Table(dataframe=frame)})
            if "comet_ml" in report_to:
                from ...trainer.utils import log_table_to_comet_experiment

                log_table_to_comet_experiment(name="completions.csv", table=frame)

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Greedy responses to the evaluation prompts, scored by the reward model.

        Returns `{prefix}_objective/scores` (mean score), `{prefix}_val/num_eos_tokens` (responses holding an EOS)
        and `{prefix}_runtime`; they are also logged.
        """
        if isinstance(eval_dataset, dict):
            metrics = {}
            for name, dataset in eval_dataset.items():
                metrics.update(self.evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        start = time.time()
        dataloader = self.get_eval_dataloader(eval_dataset)
        table = self._score_eval_batches(sampling=False, dataloader=dataloader)
        scores = table["score"]
        metrics = {
            f"{metric_key_prefix}_objective/scores": sum(scores) / max(len(scores), 1),
            f"{metric_key_prefix}_val/num_eos_tokens": float(sum(table["eos"])),
            f"{metric_key_prefix}_runtime": round(time.time() - start, 4),
        }
        self.log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------------------------------------------------
    # Saving and resuming
    # ------------------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy only (and the tokenizer) to `output_dir`."""
        wrapper = self.model
        self.model = self.accelerator.unwrap_model(self.model_wrapped).policy
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self.model = wrapper

    def _save_checkpoint_extras(self, checkpoint_dir: str) -> None:
        # Written while the checkpoint is staged, so that a kill never leaves a checkpoint without its value model.
        super()._save_checkpoint_extras(checkpoint_dir)
        if self.args.should_save:
            value_model = self.accelerator.unwrap_model(self.model_wrapped).value_model
            value_model.save_pretrained(os.path.join(checkpoint_dir, _VALUE_MODEL_DIR))

    def _resume(self, checkpoint: str | bool, batches) -> None:
        from ...trainer.utils.checkpoints import last_complete_checkpoint

        if checkpoint is True:
            checkpoint = last_complete_checkpoint(self.args.output_dir)  # never one cut short by a kill
        if not os.path.isdir(checkpoint):
            raise ValueError(f"Checkpoint directory {checkpoint!r} does not exist.")
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        _load_weights(wrapper.policy, checkpoint, peft=self.is_peft_model)
        value_dir = os.path.join(checkpoint, _VALUE_MODEL_DIR)
        if not os.path.isdir(value_dir):
            raise ValueError(f"Checkpoint {checkpoint!r} has no {_VALUE_MODEL_DIR}/ folder (saved by PPOTrainer).")
        value_model = wrapper.value_model
        if isinstance(value_model, PreTrainedModelWrapper):
            value_model.post_init(
                _load_weights(value_model.pretrained_model, value_dir, peft=value_model.is_peft_model)
            )
        else:
            _load_weights(value_model, value_dir, peft=False)
        self._load_optimizer_and_scheduler(checkpoint)
        saved = _PPOTrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        self.state.global_step, self.state.episode, self.state.epoch = saved.global_step, saved.episode, saved.epoch
        self.state.log_history = saved.log_history
        for _ in range(saved.global_step):
            next(batches)
        self._load_rng_state(checkpoint)


def _saved_tokenizer(model: nn.Module) -> Any:
    """The tokenizer saved beside a model loaded from a local folder, or None (nothing is downloaded)."""
    path = getattr(model, "name_or_path", None)
    if not path or not os.path.isdir(path):
        return None
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


_STAT_NAMES = ("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")


def _load_weights(model: nn.Module, directory: str, peft: bool) -> dict[str, torch.Tensor]:
    """Load the weights saved by `save_pretrained` in `directory` into `model`; returns the tensors the model did
    not take (a value head's, for instance)."""
    if peft:
        from peft import set_peft_model_state_dict

        from .modeling_value_head import _load_weight_file

        for name in ("adapter_model.safetensors", "adapter_model.bin"):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                set_peft_model_state_dict(model, _load_weight_file(path))
                head = os.path.join(directory, "pytorch_model.bin")
                return _load_weight_file(head) if os.path.isfile(head) else {}
        raise ValueError(f"No adapter weights in {directory!r}.")
    from .modeling_value_head import _head_state_dict

    state = _head_state_dict(directory, ("",))
    if not state:
        raise ValueError(f"No model weights in {directory!r}.")
    result = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied and not k.endswith("lm_head.weight")]
    if missing:
        raise ValueError(f"Checkpoint {directory!r} lacks weights {missing[:5]} of {type(model).__name__}.")
    return {k: state[k] for k in result.unexpected_keys}
