"""The rollout / reward / advantage core shared by the online RL trainers (GRPO, RLOO, and those built on them).

An online trainer repeats: sample a batch of prompts, generate several completions per prompt with the current
policy, score them with reward functions, turn scores into advantages, then take one or more optimizer steps on the
resulting batch. [`_OnlineTrainer`] implements everything except the two places where methods differ, which
subclasses provide as hooks:

- `_compute_advantages(rewards_per_func, batch)`: from per-function rewards to one advantage per completion (GRPO:
  group-normalised; RLOO: leave-one-out baseline with the KL folded into the reward);
- `_compute_loss(model, inputs)`: the policy loss on one micro-batch.

Generation is isolated in `_generate(prompts, inputs)`, which returns token id lists, so another backend (vLLM,
continuous batching, a user `rollout_func`) replaces a single method. Rewards go through `_compute_rewards`; reference
and old-policy log-probabilities are computed by `_compute_rollout_logps` only when the method needs them.

Data flow through one generation round (shapes are per process, `N = per_device_train_batch_size *
steps_per_generation` completions in training):

1. the dataloader yields `N` examples (`RepeatSampler` places the `num_generations` copies of a prompt next to each
   other, and repeats the round `steps_per_generation * num_iterations` times so the Trainer's step count is right);
2. `_generate` produces the completions; the prompt's KV cache is computed once per unique prompt and shared by its
   completions;
3. `_compute_rewards` calls every reward function / model and gathers the `(N_global, F)` rewards across processes;
4. `_compute_advantages` returns the global advantages, of which each process keeps its slice;
5. the batch is shuffled, split into `steps_per_generation` micro-batches and buffered; each micro-step pops one.
"""

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import logging
import numbers
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from accelerate.utils import gather_object
from datasets import Dataset, IterableDataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    TrainerCallback,
)

from ..data_utils import apply_chat_template, is_conversational
from ..models.utils import unwrap_model_for_generation
from .base_trainer import _BaseTrainer
from .utils import (
    RepeatSampler,
    compute_token_logps,
    disable_dropout_in_model,
    get_callable_name,
    identity,
    is_async_callable,
    nanstd,
    pad,
    print_prompt_completions_sample,
    repeat_iterable_dataset,
    shuffle_sequence_dict,
    split_tensor_dict,
)


logger = logging.getLogger(__name__)

RewardFunc = str | PreTrainedModel | Callable[..., list[float | None]]

# Row key holding exact prompt token ids for `_generate` (multi-turn continuation; see `_tokenize_prompts`).
CONTINUATION_IDS_KEY = "_continuation_prompt_ids"

# Added to a standard deviation before dividing by it, so that groups with identical rewards give 0, not NaN.
ADVANTAGE_EPS = 1e-4


# ---------------------------------------------------------------------------------------------------------------------
# Pure functions (tested against hand-written formulas)
# ---------------------------------------------------------------------------------------------------------------------
def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is non-zero (0 when the mask is empty), over `dim` or everything."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def aggregate_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the rewards of each completion, skipping NaN entries (a function that returned None).

    Args:
        rewards_per_func: `(N, F)` rewards, NaN where a function did not apply.
        weights: `(F,)` reward weights.

    Returns:
        `(N,)` aggregated rewards (0 for a completion no function applied to).
    """
    return (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = ADVANTAGE_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages: each reward minus its group mean, optionally divided by a standard deviation.

    Consecutive blocks of `num_generations` rewards form a group (the completions of one prompt).

    Args:
        rewards: `(N,)` rewards, `N` a multiple of `num_generations`.
        num_generations: Group size G.
        scale_rewards: `"group"` divides by `std(group) + eps`, `"batch"` by `std(all rewards) + eps`, `"none"` keeps
            the centred rewards.
        eps: Added to the standard deviation.

    Returns:
        `(advantages, group_std)`, both `(N,)`; `group_std` is the (unbiased) std of each completion's group.
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"The number of rewards ({rewards.numel()}) is not a multiple of the group size ({num_generations})."
        )
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    group_std = grouped.std(dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (group_std + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none'; got {scale_rewards!r}.")
    return advantages, group_std


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """RLOO advantages: each reward minus the mean reward of the other completions of its prompt.

    Args:
        rewards: `(N,)` rewards, consecutive groups of `num_generations`.
        num_generations: Group size G (at least 2).

    Returns:
        `(N,)` advantages `r_i - (sum_j r_j - r_i) / (G - 1)`.
    """
    if num_generations < 2:
        raise ValueError(f"The leave-one-out baseline needs at least 2 completions per prompt; got {num_generations}.")
    grouped = rewards.view(-1, num_generations)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    return (grouped - baseline).reshape(-1)


def k3_kl(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference) (Schulman): `exp(ref - logp) - (ref - logp) - 1 >= 0`."""
    delta = ref_per_token_logps - per_token_logps
    return torch.exp(delta) - delta - 1


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """Mask of the tokens up to and including the first end-of-sequence token of each row.

    Args:
        completion_ids: `(N, T)` generated ids (anything after the first EOS is padding).
        eos_token_ids: Ids that end a completion.

    Returns:
        `(mask, terminated)`: `(N, T)` int mask and `(N,)` bool, True where the row contains an EOS.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    terminated = is_eos.any(dim=1)
    first_eos = torch.where(terminated, is_eos.int().argmax(dim=1), completion_ids.shape[1])
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).int()
    return mask, terminated


# ---------------------------------------------------------------------------------------------------------------------
# Generation with one prompt prefill per group
# ---------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_with_shared_prompts(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    row_to_prompt: torch.Tensor,
    generation_config: GenerationConfig,
    share_prompt_cache: bool = True,
    **generate_kwargs: Any,
) -> torch.Tensor:
    """Sample one completion per row, computing each distinct prompt's KV cache only once.

    `generate` on a batch where every prompt is repeated `G` times would run the prompt through the model `G` times.
    Here the unique prompts (all tokens but the last) are prefilled once, the cache rows are copied to the rows that
    share a prompt, and `generate` continues from that cache. The result is identical to calling `generate` on the
    repeated prompts (same positions, same masks), only the redundant prefill is skipped.

    Args:
        model: Unwrapped causal LM.
        prompt_ids: `(U, L)` left-padded ids of the distinct prompts.
        prompt_mask: `(U, L)` attention mask.
        row_to_prompt: `(N,)` index of the prompt of each output row.
        generation_config: Sampling settings (`max_new_tokens`, eos/pad ids, ...).
        share_prompt_cache: Prefill once per prompt. Falls back to plain `generate` when False, when a prompt has
            fewer than 2 tokens, when no prompt is repeated, or with a non-default `cache_implementation`.
        **generate_kwargs: Extra arguments for `generate`.

    Returns:
        `(N, L + T)` prompt and completion ids (completions right-padded with the pad id).
    """
    from transformers import DynamicCache

    ids = prompt_ids[row_to_prompt]
    mask = prompt_mask[row_to_prompt]
    share = (
        share_prompt_cache
        and prompt_ids.shape[1] >= 2
        and row_to_prompt.numel() > prompt_ids.shape[0]
        and int(prompt_mask.sum(dim=1).min()) >= 2
        and getattr(generation_config, "cache_implementation", None) in (None, "dynamic")
        and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    )
    if share:
        # Same positions as `generate` uses for left-padded prompts: counted from the first real token.
        positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        model(
            input_ids=prompt_ids[:, :-1],
            attention_mask=prompt_mask[:, :-1],
            position_ids=positions[:, :-1],
            past_key_values=cache,
            use_cache=True,
        )
        cache.batch_select_indices(row_to_prompt)
        generate_kwargs["past_key_values"] = cache
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config, **generate_kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Reward function plumbing
# ---------------------------------------------------------------------------------------------------------------------
def _to_float_list(values: Any, name: str, expected: int) -> list[float]:
    """Validate a reward function's output: one number (or None) per completion. None becomes NaN."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist()
    elif hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy arrays
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise ValueError(
            f"Reward function {name!r} must return a list with one reward per completion ({expected} values); it "
            f"returned {type(values).__name__}. Return e.g. `[1.0, 0.0, ...]` (None for completions it does not "
            "score)."
        )
    if len(values) != expected:
        raise ValueError(
            f"Reward function {name!r} returned {len(values)} values, but {expected} completions were scored; it "
            "must return exactly one reward (or None) per completion, in the order of `completions`."
        )
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(float("nan"))
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out.append(float(value.item()))
        elif isinstance(value, numbers.Real):
            out.append(float(value))
        else:
            raise ValueError(
                f"Reward function {name!r} returned a non-numeric value at position {i}: {value!r} "
                f"({type(value).__name__}). Rewards must be numbers (int/float) or None."
            )
    return out


def _run_coroutines(coroutines: list) -> list:
    """Run coroutines concurrently and return their results, also when an event loop is already running here."""

    async def gather_all():
        return await asyncio.gather(*coroutines)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather_all())
    # Inside a running loop (e.g. a notebook): run on a fresh loop in a worker thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather_all()).result()


def _accepts_keyword(func: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def _router_logits_off(model: nn.Module):
    """Mixture-of-experts models: no router logits / load-balancing loss while generating (they are not trained on
    there, and the loss computation does not support cached decoding)."""
    config = getattr(model, "config", None)
    enabled = bool(getattr(config, "output_router_logits", False))
    if enabled:
        config.output_router_logits = False
    try:
        yield
    finally:
        if enabled:
            config.output_router_logits = True


class _OnlineStateCallback(TrainerCallback):
    """Keeps the trainer's rollout bookkeeping aligned with the Trainer's step counter (fresh runs and resumes)."""

    def __init__(self, trainer: "_OnlineTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._step = state.global_step * args.gradient_accumulation_steps
        self.trainer._buffered_inputs = None

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._on_optimizer_step()


# ---------------------------------------------------------------------------------------------------------------------
# The trainer core
# ---------------------------------------------------------------------------------------------------------------------
class _OnlineTrainer(_BaseTrainer):
    """Base class of online RL trainers: prompt sampling, generation, rewards, advantages, metrics and logging.

    Subclasses set `_config_class` and `_default_suffix`, and implement `_compute_advantages` and `_compute_loss`.
    They may override `_needs_ref_model`, `_needs_rollout_logps` and `_generate`.
    """

    _config_class: type = None
    _default_suffix: str = "Online"
    # `compute_loss` normalises for gradient accumulation itself; the Trainer must not divide again.
    loss_is_scaled_for_ga = True
    # Prefill each distinct prompt once and share its KV cache across its group (see generate_with_shared_prompts).
    _share_prompt_cache = True

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        reward_funcs: RewardFunc | list[RewardFunc] | None,
        args: Any = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        rollout_func: Callable | None = None,
        ref_model: "str | PreTrainedModel | nn.Module | None" = None,
    ):
        trainer_name = type(self).__name__
        user_model = model  # a path (the reference is reloaded from it) or an instance (the reference is a copy)
        # ---- Config and data checks ----------------------------------------------------------------------------
        if args is None:
            args = self._default_args(self._config_class, model, self._default_suffix)
        elif not isinstance(args, self._config_class):
            raise TypeError(
                f"{trainer_name} expects `args` to be a {self._config_class.__name__}; got {type(args).__name__}. "
                f"Build one with {self._config_class.__name__}(output_dir=..., ...)."
            )
        self._check_train_dataset(train_dataset, trainer_name)
        self._prepare_iterable_args(args, train_dataset)
        self._check_prompt_dataset(train_dataset, "train")
        if isinstance(eval_dataset, dict):
            for key, dataset in eval_dataset.items():
                self._check_prompt_dataset(dataset, f"eval ({key})")
        elif eval_dataset is not None:
            self._check_prompt_dataset(eval_dataset, "eval")
        self._check_generation_backend(args, rollout_func)

        # ---- Model and processing class ------------------------------------------------------------------------
        model_id = self._model_id(model)
        model = self._load_model(model, args, quantization_config=quantization_config)
        if self._is_peft_model(model) and peft_config is not None:
            raise ValueError(
                "You passed a PeftModel together with a peft_config. Pass either a base model with peft_config, or "
                "the PeftModel alone."
            )
        if processing_class is None:
            processing_class = self._load_processing_class(model_id, args, padding_side="left")
        if isinstance(processing_class, ProcessorMixin) and not isinstance(processing_class, PreTrainedTokenizerBase):
            raise ValueError(
                f"{trainer_name} currently trains text-only causal LMs; a {type(processing_class).__name__} "
                "(vision-language processor) was given. Pass the model's tokenizer as processing_class."
            )
        tokenizer = self._ensure_pad_token(processing_class)
        self._setup_aux_loss(model, args)
        if args.disable_dropout:
            disable_dropout_in_model(model)
        if getattr(args, "cast_lm_head_to_fp32", False):
            self._cast_lm_head_to_fp32(model)

        # ---- Reward functions ----------------------------------------------------------------------------------
        self.reward_funcs, self.reward_processing_classes, self.reward_func_names = self._prepare_reward_funcs(
            reward_funcs, reward_processing_classes, args
        )
        num_funcs = len(self.reward_funcs)
        if args.reward_weights is not None:
            if len(args.reward_weights) != num_funcs:
                raise ValueError(
                    f"reward_weights has {len(args.reward_weights)} values but there are {num_funcs} reward "
                    f"functions ({self.reward_func_names}); give exactly one weight per reward function."
                )
            self.reward_weights = torch.tensor(args.reward_weights, dtype=torch.float32)
        else:
            self.reward_weights = torch.ones(num_funcs, dtype=torch.float32)

        # ---- PEFT and reference model --------------------------------------------------------------------------
        model = self._wrap_peft(model, peft_config, args)
        ref_model = self._build_ref_model(user_model, model, ref_model, args, needed=self._needs_ref_model(args))
        if ref_model is not None:
            if args.disable_dropout:
                disable_dropout_in_model(ref_model)
            if getattr(args, "cast_lm_head_to_fp32", False):
                self._cast_lm_head_to_fp32(ref_model)

        # ---- Generation ----------------------------------------------------------------------------------------
        self.rollout_func = rollout_func
        settings = self._rollout_settings(args)
        self.num_generations = settings["num_generations"]
        self.num_generations_eval = settings["num_generations_eval"]
        self.max_completion_length = settings["max_completion_length"]
        self.chat_template_kwargs = settings["chat_template_kwargs"]
        self.eos_token_ids = self._eos_token_ids(model, tokenizer)
        self.pad_token_id = tokenizer.pad_token_id
        self.generation_config = self._build_generation_config(args, tokenizer)

        # ---- State ---------------------------------------------------------------------------------------------
        self._init_metrics()
        self._step = 0
        self._buffered_inputs: list[dict[str, Any]] | None = None
        self._timing = {"rollout": 0.0, "generation": 0.0}
        self._completion_logs: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
        self._logged_extra: dict[str, list] = {}
        self._eval_num_tokens = 0
        self._signature_cache: dict[int, bool] = {}

        super().__init__(
            model=model,
            args=args,
            data_collator=identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.model_accepts_loss_kwargs = False

        # ---- Evaluation-only models ----------------------------------------------------------------------------
        self.ref_model = self._prepare_ref_model(ref_model)
        for i, reward_func in enumerate(self.reward_funcs):
            if isinstance(reward_func, nn.Module):
                self.reward_funcs[i] = self._prepare_ref_model(reward_func)
        self._add_sync_ref_model_callback(self.ref_model)
        self.add_callback(_OnlineStateCallback(self))
        self._add_model_tags(self.model)
        # vLLM generation (server client or in-process engine); built last since it needs the accelerator.
        self.vllm_generation = self._create_vllm_generation(args, rollout_func)

    # ------------------------------------------------------------------------------------------------------------
    # Hooks for subclasses
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def _rollout_settings(cls, args: Any) -> dict[str, Any]:
        """Rollout settings the core reads from the config, by name.

        Returns a dict with `num_generations` (completions `_generate` receives per prompt in training),
        `num_generations_eval` (same in evaluation), `max_completion_length` (generation cap) and
        `chat_template_kwargs` (dict). Trainers whose config names these differently or lacks them (Online DPO:
        `max_new_tokens`, a fixed pair of completions) override this.
        """
        return {
            "num_generations": args.num_generations,
            "num_generations_eval": args.num_generations_eval or args.num_generations,
            "max_completion_length": args.max_completion_length,
            "chat_template_kwargs": dict(args.chat_template_kwargs or {}),
        }

    def _logprob_temperature(self) -> float:
        """Temperature dividing the logits in log-probability passes: the sampling temperature, so that the
        log-probabilities are the sampler's. Methods that score the model itself (Online DPO) override it with 1.0."""
        return self.args.temperature

    @staticmethod
    def _needs_ref_model(args: Any) -> bool:
        """Whether a reference model is needed (a separate copy unless the policy is a PEFT model)."""
        return getattr(args, "beta", 0.0) != 0.0

    def _is_on_policy(self) -> bool:
        """Whether the model that generated a batch is exactly the one trained on it at every micro-step.

        True when no optimizer step can happen between generating a round and consuming it: one pass over the data
        (`num_iterations == 1`) and every generation round inside one optimizer step (`gradient_accumulation_steps`
        a multiple of `steps_per_generation`). The old-policy log-probabilities are then the detached current ones and
        need no extra forward pass.
        """
        args = self.args
        return args.num_iterations == 1 and args.gradient_accumulation_steps % args.steps_per_generation == 0

    def _needs_rollout_logps(self) -> bool:
        """Whether the policy's log-probabilities must be computed (without grad) right after generation."""
        return not self._is_on_policy()

    def _compute_advantages(self, rewards_per_func: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """From `(N_global, F)` rewards (NaN = not applicable) to `(N_global,)` advantages. Must be overridden."""
        raise NotImplementedError

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Loss of one micro-batch (already normalised for gradient accumulation). Must be overridden."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------------------
    # Construction helpers
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_prompt_dataset(dataset: Any, name: str) -> None:
        if dataset is None:
            return
        columns = getattr(dataset, "column_names", None)
        if isinstance(columns, dict):  # a DatasetDict
            raise ValueError(
                f"The {name} dataset is a DatasetDict with splits {list(columns)}; pass one split, for example "
                "dataset['train']."
            )
        if columns is None and isinstance(dataset, IterableDataset):
            first = next(iter(dataset), None)
            columns = list(first.keys()) if first is not None else []
        if columns is not None and "prompt" not in columns:
            raise ValueError(
                f"The {name} dataset must have a 'prompt' column (standard text or a list of chat messages); found "
                f"columns {list(columns)}. Rename your prompt column with dataset.rename_column(<old>, 'prompt')."
            )

    def _check_generation_backend(self, args: Any, rollout_func: Callable | None) -> None:
        if args.use_vllm and rollout_func is None:
            from ..import_utils import is_vllm_available

            if not is_vllm_available():
                raise ImportError(
                    "use_vllm=True needs vLLM, which is not installed. Install it with `pip install trl[vllm]`, or "
                    "set use_vllm=False to generate with transformers."
                )

    def _setup_aux_loss(self, model: nn.Module, args: Any) -> None:
        """Enable the mixture-of-experts load-balancing loss when the model has a router (see router_aux_loss_coef)."""
        # Shared with the offline trainers; configs without `router_aux_loss_coef` use the model config's setting.
        self._aux_loss_enabled, self._aux_loss_coef = self._resolve_aux_loss(model, args)

    @staticmethod
    def _cast_lm_head_to_fp32(model: nn.Module) -> None:
        """Keep the output projection in float32 and feed it float32 hidden states (ScaleRL)."""
        config = getattr(model, "config", None)
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError(
                "cast_lm_head_to_fp32=True needs untied input/output embeddings, but this model ties them "
                "(config.tie_word_embeddings=True). Set cast_lm_head_to_fp32=False."
            )
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            raise ValueError("cast_lm_head_to_fp32=True, but the model has no output embeddings (LM head).")
        head.float()
        head.register_forward_pre_hook(lambda module, inputs: tuple(x.float() for x in inputs))

    @staticmethod
    def _eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        ids = []
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        generation_config = getattr(model, "generation_config", None)
        extra = getattr(generation_config, "eos_token_id", None)
        if extra is not None:
            ids.extend([extra] if isinstance(extra, int) else list(extra))
        return list(dict.fromkeys(ids))

    def _build_generation_config(self, args: Any, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
        kwargs = {
            "max_new_tokens": self.max_completion_length,
            "do_sample": True,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k else None,
            "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
            "cache_implementation": args.cache_implementation,
        }
        kwargs.update(args.generation_kwargs or {})
        return GenerationConfig(**kwargs)

    def _prepare_reward_funcs(self, reward_funcs: Any, reward_processing_classes: Any, args: Any):
        if reward_funcs is None:
            raise ValueError(
                f"{type(self).__name__} needs at least one reward function: pass reward_funcs=<callable>, a reward "
                "model (a path/id or an AutoModelForSequenceClassification), or a list of them."
            )
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is an empty list; give at least one reward function or reward model.")
        if reward_processing_classes is None:
            processing = [None] * len(funcs)
        elif isinstance(reward_processing_classes, (list, tuple)):
            processing = list(reward_processing_classes)
            if len(processing) != len(funcs):
                raise ValueError(
                    f"reward_processing_classes has {len(processing)} entries but there are {len(funcs)} reward "
                    "functions; give one entry per reward function (None for plain callables)."
                )
        else:
            processing = [reward_processing_classes] + [None] * (len(funcs) - 1)
        init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
        init_kwargs.pop("quantization_config", None)
        names = []
        for i, func in enumerate(funcs):
            if isinstance(func, str):
                from .utils import create_model_from_path

                funcs[i] = create_model_from_path(
                    func, architecture=AutoModelForSequenceClassification, num_labels=1, **init_kwargs
                )
                func = funcs[i]
            if isinstance(func, nn.Module):
                func.eval()
                for param in func.parameters():
                    param.requires_grad_(False)
                name_or_path = getattr(getattr(func, "config", None), "_name_or_path", "") or type(func).__name__
                names.append(name_or_path.rstrip("/").split("/")[-1])
                if processing[i] is None:
                    processing[i] = AutoTokenizer.from_pretrained(name_or_path)
                reward_tokenizer = processing[i]
                if reward_tokenizer.pad_token is None:
                    reward_tokenizer.pad_token = reward_tokenizer.eos_token
                if getattr(func.config, "pad_token_id", None) is None:
                    func.config.pad_token_id = reward_tokenizer.pad_token_id
            elif callable(func):
                names.append(get_callable_name(func))
            else:
                raise ValueError(
                    f"reward_funcs[{i}] is a {type(func).__name__}; expected a callable, a model path/id (str) or an "
                    "AutoModelForSequenceClassification model."
                )
        return funcs, processing, names

    # ------------------------------------------------------------------------------------------------------------
    # Data loading: one dataloader batch = one generation round of this process
    # ------------------------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}: training requires a train_dataset.")
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            args = self.args
            dataset = repeat_iterable_dataset(
                dataset,
                mini_repeat_count=self.num_generations,
                batch_size=args.generation_batch_size // self.num_generations,
                repeat_count=args.num_iterations * args.steps_per_generation,
            )
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_train_sampler(self, train_dataset: Any = None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        args = self.args
        # Each round's prompts are repeated num_generations times in a row (groups stay together), and the whole
        # round is emitted steps_per_generation * num_iterations times so that every micro-step fetches a batch.
        return RepeatSampler(
            data_source=dataset,
            mini_repeat_count=self.num_generations,
            batch_size=args.generation_batch_size // self.num_generations,
            repeat_count=args.num_iterations * args.steps_per_generation,
            shuffle=bool(args.shuffle_dataset),
            seed=args.seed,
        )

    def get_eval_dataloader(self, eval_dataset: Any = None):
        dataset = eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        elif dataset is None:
            dataset = self.eval_dataset
        if isinstance(dataset, IterableDataset):
            dataset = repeat_iterable_dataset(dataset, mini_repeat_count=self.num_generations_eval)
        if dataset is None:
            raise ValueError(f"{type(self).__name__}: evaluation requires an eval_dataset.")
        return self._get_dataloader(
            dataset=dataset,
            description="Evaluation",
            batch_size=self.args.per_device_eval_batch_size,
            sampler_fn=self._get_eval_sampler,
        )

    def _get_eval_sampler(self, eval_dataset: Any):
        return RepeatSampler(
            data_source=eval_dataset, mini_repeat_count=self.num_generations_eval, seed=self.args.seed
        )

    # ------------------------------------------------------------------------------------------------------------
    # Rollout: generate, score, compute advantages; buffer the micro-batches of a round
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        mode = self._mode
        if mode == "eval":
            batch = self._generate_and_score(generation_batch)
            batch["num_items_in_batch"] = self._global_token_count(batch["completion_mask"])
            return batch

        args = self.args
        steps = args.steps_per_generation
        if self._buffered_inputs is None or self._step % (steps * args.num_iterations) == 0:
            batch = self._generate_and_score(generation_batch)
            batch = shuffle_sequence_dict(batch)  # micro-batches mix completions of different prompts
            chunks = split_tensor_dict(batch, steps)
            for chunk, normaliser in zip(chunks, self._token_normalisers(chunks)):
                chunk["num_items_in_batch"] = normaliser
            self._buffered_inputs = chunks
        inputs = self._buffered_inputs[self._step % steps]
        self._step += 1
        return inputs

    def _global_token_count(self, completion_mask: torch.Tensor) -> torch.Tensor:
        count = completion_mask.sum().float().reshape(1)
        return self.accelerator.gather(count).sum()

    def _token_normalisers(self, chunks: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Completion tokens (all processes) of the optimizer step each micro-batch belongs to.

        Token-level losses divide by this count so that the gradient of an optimizer step is the mean over all its
        tokens, whatever the gradient accumulation. When one round spans several optimizer steps, consecutive groups
        of `gradient_accumulation_steps` micro-batches form a step. When an optimizer step spans several rounds
        (later rounds are not generated yet), the count of this round is scaled by the number of rounds per step.
        """
        device = chunks[0]["completion_mask"].device
        local = torch.stack([chunk["completion_mask"].sum().float() for chunk in chunks]).to(device)
        counts = self.accelerator.gather(local.unsqueeze(0)).reshape(-1, len(chunks)).sum(dim=0)
        accumulation = self.args.gradient_accumulation_steps
        steps = len(chunks)
        if steps <= accumulation:
            total = counts.sum() * (accumulation / steps)
            return [total for _ in chunks]
        normalisers = []
        for j in range(steps):
            start = (j // accumulation) * accumulation
            normalisers.append(counts[start : start + accumulation].sum())
        return normalisers

    def _render_prompts(self, inputs: list[dict[str, Any]]) -> tuple[list[str], bool]:
        """Prompt texts (chat template applied to conversational prompts) and whether the data is conversational."""
        conversational = is_conversational({"prompt": inputs[0]["prompt"]})
        if not conversational:
            return [example["prompt"] for example in inputs], False
        texts = []
        for example in inputs:
            row = {"prompt": example["prompt"]}
            if example.get("tools") is not None:
                row["tools"] = example["tools"]
            template_kwargs = {**self.chat_template_kwargs, **(example.get("chat_template_kwargs") or {})}
            texts.append(apply_chat_template(row, self.processing_class, **template_kwargs)["prompt"])
        return texts, True

    def _tokenize_prompts(self, inputs: list[dict[str, Any]]) -> list[list[int]]:
        """Prompt token ids of each row, as every generation backend receives them.

        A row carrying `CONTINUATION_IDS_KEY` (a multi-turn rollout continuing after a tool result) is used as is, so
        the next turn is generated from exactly the tokens trained on; other rows are rendered with
        `_render_prompts` and tokenized (each distinct text once).
        """
        ids: list[list[int] | None] = [example.get(CONTINUATION_IDS_KEY) for example in inputs]
        missing = [i for i, row_ids in enumerate(ids) if row_ids is None]
        if missing:
            texts, conversational = self._render_prompts([inputs[i] for i in missing])
            unique_texts = list(dict.fromkeys(texts))
            encoded = self.processing_class(text=unique_texts, add_special_tokens=not conversational)["input_ids"]
            by_text = dict(zip(unique_texts, encoded))
            for i, text in zip(missing, texts):
                ids[i] = list(by_text[text])
        return [list(row_ids) for row_ids in ids]

    def _rollout(self, prompts: list[Any], inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """Produce the completions of one round: `_generate` by default; multi-turn rollouts (tool calling) wrap it.

        Besides the keys of `_generate`, the result may hold `prompts` (prompts changed during the rollout, e.g. by an
        environment's `reset()`), `completions` (already-structured completions given to the reward functions, e.g.
        conversations with tool messages) and `tool_mask` (per completion token, 0 for tokens not produced by the
        policy, such as tool results: they are attended to but excluded from the loss).
        """
        return self._generate(prompts, inputs)

    def _generate(self, prompts: list[Any], inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """Generate one completion per entry of `prompts` (which repeat in groups).

        Returns a dict with `prompt_ids` and `completion_ids` (lists of token id lists; a completion ends at its first
        end-of-sequence token, included), optionally `sampling_logps` (per-token log-probabilities under the sampler,
        for importance-sampling correction) and `extra_fields` (name -> one value per completion, passed to the
        reward functions). Override this to plug in another generation backend.
        """
        if self.rollout_func is not None:
            return self._generate_with_rollout_func(prompts)
        if getattr(self, "vllm_generation", None) is not None:
            return self._generate_with_vllm(inputs)
        row_ids = self._tokenize_prompts(inputs)
        # Each distinct prompt is prefilled once; rows of the same group share it.
        unique = list(dict.fromkeys(tuple(ids) for ids in row_ids))
        position = {ids: i for i, ids in enumerate(unique)}
        encoded = [list(ids) for ids in unique]
        device = self.accelerator.device
        prompt_tensors = [torch.tensor(ids, dtype=torch.long, device=device) for ids in encoded]
        prompt_ids = pad(prompt_tensors, padding_value=self.pad_token_id, padding_side="left")
        prompt_mask = pad([torch.ones_like(t) for t in prompt_tensors], padding_value=0, padding_side="left")
        row_to_prompt = torch.tensor([position[tuple(ids)] for ids in row_ids], device=device)

        start = time.perf_counter()
        args = self.args
        was_training = self.model.training
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
            _router_logits_off(unwrapped),
        ):
            try:
                if getattr(args, "use_transformers_continuous_batching", False):
                    rows = [encoded[i] for i in row_to_prompt.tolist()]
                    completion_lists = self._generate_continuous_batching(unwrapped, rows)
                else:
                    output = generate_with_shared_prompts(
                        unwrapped,
                        prompt_ids,
                        prompt_mask,
                        row_to_prompt,
                        self.generation_config,
                        share_prompt_cache=self._share_prompt_cache,
                        disable_compile=True,
                    )
                    completion_ids = output[:, prompt_ids.shape[1] :]
                    completion_mask, _ = completion_mask_from_ids(completion_ids, self.eos_token_ids)
                    completion_lists = [
                        ids[: int(n)].tolist() for ids, n in zip(completion_ids, completion_mask.sum(dim=1))
                    ]
            finally:
                self.model.train(was_training)  # some backends (continuous batching) switch to eval mode
        self._timing["generation"] += time.perf_counter() - start
        return {
            "prompt_ids": [encoded[i] for i in row_to_prompt.tolist()],
            "completion_ids": completion_lists,
            "sampling_logps": None,
            "extra_fields": {},
        }

    def _create_vllm_generation(self, args: Any, rollout_func: Callable | None) -> Any:
        """The vLLM back-end when `use_vllm=True` (and no `rollout_func` replaces generation), else None."""
        if not getattr(args, "use_vllm", False) or rollout_func is not None:
            return None
        from ..generation.vllm_generation import VLLMGeneration

        return VLLMGeneration(
            self.model,
            self.accelerator,
            args,
            eos_token_ids=self.eos_token_ids,
            max_tokens=self.max_completion_length,
        )

    def _uses_sampling_logps(self) -> bool:
        """Whether the sampler's per-token log-probabilities are used (vLLM importance-sampling correction): only
        then does `_generate` return them, since they cost an extra log-probability pass over the batch."""
        return bool(getattr(self.args, "vllm_importance_sampling_correction", False))

    def _generate_with_vllm(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """`_generate` through vLLM: the trainer tokenizes (so prompt ids are the same as with transformers), vLLM
        samples one completion per row and returns the sampled tokens' log-probabilities."""
        prompt_ids = self._tokenize_prompts(inputs)
        start = time.perf_counter()
        # The trainer's step counter versions the weights: a new optimizer step makes vLLM's copy stale.
        output = self.vllm_generation.generate(
            prompt_ids, model=self.model_wrapped, weights_version=self.state.global_step
        )
        self._timing["generation"] += time.perf_counter() - start
        return {
            "prompt_ids": output["prompt_ids"],
            "completion_ids": output["completion_ids"],
            "sampling_logps": output["logprobs"] if self._uses_sampling_logps() else None,
            "extra_fields": {},
        }

    def end(self) -> None:
        # Release vLLM first: its in-process engine tears down the process groups it joined, which must still exist.
        if getattr(self, "vllm_generation", None) is not None:
            self.vllm_generation.close()
        super().end()

    def _generate_continuous_batching(self, model: nn.Module, prompt_lists: list[list[int]]) -> list[list[int]]:
        from transformers import ContinuousBatchingConfig

        config = ContinuousBatchingConfig(**(self.args.transformers_continuous_batching_config or {}))
        results = model.generate_batch(
            inputs=prompt_lists, generation_config=self.generation_config, continuous_batching_config=config
        )
        # Request ids are assigned in input order.
        ordered = sorted(results.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
        completions = []
        for result in ordered:
            ids = list(result.generated_tokens)
            for k, token in enumerate(ids):
                if token in self.eos_token_ids:
                    ids = ids[: k + 1]
                    break
            completions.append(ids)
        return completions

    def _generate_with_rollout_func(self, prompts: list[Any]) -> dict[str, Any]:
        start = time.perf_counter()
        output = self.rollout_func(prompts, self)
        self._timing["generation"] += time.perf_counter() - start
        if not isinstance(output, dict) or "prompt_ids" not in output or "completion_ids" not in output:
            found = list(output) if isinstance(output, dict) else type(output).__name__
            raise ValueError(
                "rollout_func must return a dict with at least 'prompt_ids' and 'completion_ids' (and optionally "
                f"'logprobs'); got {found}."
            )
        for key in ("prompt_ids", "completion_ids"):
            if len(output[key]) != len(prompts):
                raise ValueError(
                    f"rollout_func returned {len(output[key])} {key} for {len(prompts)} prompts; it must return one "
                    "entry per prompt (prompts are already repeated num_generations times)."
                )
        extra = {k: v for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs")}
        extra.pop("logprob_token_ids", None)
        return {
            "prompt_ids": [list(ids) for ids in output["prompt_ids"]],
            "completion_ids": [list(ids) for ids in output["completion_ids"]],
            "sampling_logps": output.get("logprobs"),
            "extra_fields": extra,
        }

    def _decode_completions(self, inputs: list[dict[str, Any]], completion_ids: list[list[int]]) -> list[Any]:
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        if not is_conversational({"prompt": inputs[0]["prompt"]}):
            return texts
        completions = []
        for example, text in zip(inputs, texts):
            # A prompt ending with an assistant message is continued: the completion extends that message.
            last = example["prompt"][-1]
            bootstrap = last.get("content", "") if last.get("role") == "assistant" else ""
            if not isinstance(bootstrap, str):
                bootstrap = ""
            completions.append([{"role": "assistant", "content": bootstrap + text}])
        return completions

    def _generate_and_score(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """One rollout on this process's `inputs` (a list of dataset rows): returns the tensors of the batch."""
        start = time.perf_counter()
        mode = self._mode
        device = self.accelerator.device
        prompts = [example["prompt"] for example in inputs]

        rollout = self._rollout(prompts, inputs)
        if rollout.get("prompts") is not None:  # e.g. an environment's reset() extended the prompts
            prompts = list(rollout["prompts"])
            inputs = [{**example, "prompt": prompt} for example, prompt in zip(inputs, prompts)]
        prompt_lists, completion_lists = rollout["prompt_ids"], rollout["completion_ids"]
        prompt_tensors = [torch.tensor(ids, dtype=torch.long, device=device) for ids in prompt_lists]
        completion_tensors = [torch.tensor(ids, dtype=torch.long, device=device) for ids in completion_lists]
        multiple = self.args.pad_to_multiple_of
        prompt_ids = pad(prompt_tensors, self.pad_token_id, "left", multiple)
        prompt_mask = pad([torch.ones_like(t) for t in prompt_tensors], 0, "left", multiple)
        completion_ids = pad(completion_tensors, self.pad_token_id, "right", multiple)
        completion_mask = pad([torch.ones_like(t) for t in completion_tensors], 0, "right", multiple)
        if completion_ids.shape[1] == 0:  # every completion empty (possible with a rollout_func): keep one column
            completion_ids = torch.full((len(completion_lists), 1), self.pad_token_id, device=device)
            completion_mask = torch.zeros_like(completion_ids)
        eos = set(self.eos_token_ids)
        terminated = torch.tensor([bool(ids) and ids[-1] in eos for ids in completion_lists], device=device)
        lengths = completion_mask.sum(dim=1)

        completions = rollout.get("completions")
        if completions is None:
            completions = self._decode_completions(inputs, completion_lists)
        rewards_per_func = self._compute_rewards(
            inputs, prompts, completions, completion_lists, rollout.get("extra_fields") or {}
        )

        loss_mask = completion_mask
        if rollout.get("tool_mask") is not None:
            tool_masks = [torch.tensor(m, dtype=completion_mask.dtype, device=device) for m in rollout["tool_mask"]]
            tool_mask = pad(tool_masks, 0, "right", multiple)[:, : completion_mask.shape[1]]
            tool_mask = torch.nn.functional.pad(tool_mask, (0, completion_mask.shape[1] - tool_mask.shape[1]))
            loss_mask = completion_mask * tool_mask
        if self.args.mask_truncated_completions:
            loss_mask = loss_mask * terminated.unsqueeze(1).int()
        batch: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": loss_mask,
        }
        if rollout.get("tool_mask") is not None:
            # Tool results are context for the next turn: attended to, but outside the loss.
            batch["completion_attention_mask"] = completion_mask
        if rollout.get("sampling_logps") is not None:
            sampling = [torch.tensor(lp, dtype=torch.float32, device=device) for lp in rollout["sampling_logps"]]
            batch["sampling_per_token_logps"] = pad(sampling, 0.0, "right", multiple)[:, : completion_ids.shape[1]]
        self._compute_rollout_logps(batch)

        advantages = self._compute_advantages(rewards_per_func, batch)
        process_slice = slice(
            self.accelerator.process_index * len(prompts), (self.accelerator.process_index + 1) * len(prompts)
        )
        all_advantages = advantages
        batch["advantages"] = advantages[process_slice].to(device)

        self._record_rollout_metrics(mode, prompt_mask, completion_mask, terminated, lengths, rewards_per_func)
        if self.args.log_completions:
            self._store_completions(mode, prompts, completions, rewards_per_func, all_advantages)
        self._timing["rollout"] += time.perf_counter() - start
        return batch

    # ------------------------------------------------------------------------------------------------------------
    # Rewards
    # ------------------------------------------------------------------------------------------------------------
    def _compute_rewards(
        self,
        inputs: list[dict[str, Any]],
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        extra_fields: dict[str, list] | None = None,
    ) -> torch.Tensor:
        """Score every completion with every reward function; returns the `(N_global, F)` rewards of all processes.

        Callables are called with keyword arguments `prompts`, `completions`, `completion_ids`, `trainer_state`,
        `log_extra`, `log_metric` and every other dataset column (plus `extra_fields`). `async def` functions run
        concurrently. A None reward becomes NaN (the function does not apply to that completion).
        """
        device = self.accelerator.device
        mode = self._mode
        num = len(prompts)
        rewards = torch.full((num, len(self.reward_funcs)), float("nan"), dtype=torch.float32, device=device)

        columns = {
            key: [example.get(key) for example in inputs]
            for key in inputs[0]
            if key not in ("prompt", "completion", "completion_ids")
        }
        columns.update(extra_fields or {})

        def log_extra(name: str, values: list) -> None:
            self._logged_extra[name] = list(values)

        def log_metric(name: str, value: float) -> None:
            self._metrics[mode][name].append(float(value))

        common = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            "trainer_state": self.state,
            "log_extra": log_extra,
            "log_metric": log_metric,
            **columns,
        }
        pending: list[tuple[int, Any]] = []
        for i, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names)):
            if isinstance(func, nn.Module):
                rewards[:, i] = self._score_with_reward_model(
                    func, self.reward_processing_classes[i], prompts, completions
                ).to(device)
                continue
            kwargs = common
            if _accepts_keyword(func, "completions_ids"):  # spelling used in some older examples
                kwargs = {**common, "completions_ids": completion_ids}
            if is_async_callable(func):
                pending.append((i, func(**kwargs)))
            else:
                values = func(**kwargs)
                if inspect.iscoroutine(values):
                    pending.append((i, values))
                else:
                    rewards[:, i] = torch.tensor(_to_float_list(values, name, num), device=device)
        if pending:
            results = _run_coroutines([coroutine for _, coroutine in pending])
            for (i, _), values in zip(pending, results):
                rewards[:, i] = torch.tensor(_to_float_list(values, self.reward_func_names[i], num), device=device)

        all_nan = torch.isnan(rewards).all(dim=1)
        if bool(all_nan.any()):
            row = int(all_nan.nonzero()[0])
            shown = {key: values[row] for key, values in columns.items()}
            warnings.warn(
                f"Every reward function returned None for completion {row} (prompt {str(prompts[row])[:200]!r}, "
                f"columns {str(shown)[:200]}); its reward counts as 0. Make sure at least one reward function "
                "applies to every sample.",
                UserWarning,
                stacklevel=2,
            )
        return self.accelerator.gather(rewards)

    @torch.no_grad()
    def _score_with_reward_model(
        self, reward_model: nn.Module, tokenizer: Any, prompts: list[Any], completions: list[Any]
    ) -> torch.Tensor:
        if is_conversational({"prompt": prompts[0]}):
            texts = [
                apply_chat_template({"messages": prompt + completion}, tokenizer)["text"]
                for prompt, completion in zip(prompts, completions)
            ]
        else:
            texts = [prompt + completion for prompt, completion in zip(prompts, completions)]
        encoded = tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        device = next(reward_model.parameters()).device
        encoded = {key: value.to(device) for key, value in encoded.items()}
        return reward_model(**encoded).logits[:, 0].float()

    def _aggregated_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        return aggregate_rewards(rewards_per_func, self.reward_weights.to(rewards_per_func.device))

    def _group_size(self) -> int:
        return self.num_generations if self._mode == "train" else self.num_generations_eval

    # ------------------------------------------------------------------------------------------------------------
    # Log-probabilities
    # ------------------------------------------------------------------------------------------------------------
    def _forward_logps(
        self, model: nn.Module, inputs: dict[str, Any], compute_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Per-token log-probabilities (and entropies) of the completion tokens, `(B, T)` each.

        The LM head runs only on completion positions (see `compute_token_logps`); positions are counted from each
        prompt's first real token, as during generation.
        """
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        # Completion tokens outside the loss mask (padding, masked truncated rows) are not attended to either; they
        # are never scored, so this changes no log-probability that is used. Multi-turn rollouts give the tokens to
        # attend to separately: tool results are context, yet outside the loss.
        attended = inputs.get("completion_attention_mask")
        attended = completion_mask if attended is None else attended
        attention_mask = torch.cat([prompt_mask, attended.long()], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        prompt_length = prompt_ids.shape[1]
        target_mask = torch.zeros(
            input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.bool, device=input_ids.device
        )
        target_mask[:, prompt_length - 1 :] = completion_mask.bool()
        result = compute_token_logps(
            model,
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            target_mask=target_mask,
            temperature=self._logprob_temperature(),
            compute_entropy=compute_entropy,
        )
        logps = result.logps[:, prompt_length - 1 :]
        entropy = result.entropy[:, prompt_length - 1 :] if result.entropy is not None else None
        return logps, entropy, result.outputs

    @torch.no_grad()
    def _batched_logps(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Log-probabilities of a whole rollout batch without gradients, in micro-batch-sized pieces."""
        size = self.args.per_device_train_batch_size if self._mode == "train" else self.args.per_device_eval_batch_size
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_attention_mask")
        pieces = []
        for start in range(0, batch["prompt_ids"].shape[0], size):
            piece = {key: batch[key][start : start + size] for key in keys if key in batch}
            pieces.append(self._forward_logps(model, piece)[0])
        return torch.cat(pieces, dim=0)

    def _compute_rollout_logps(self, batch: dict[str, Any]) -> None:
        """Add `old_per_token_logps` (when the data will be off-policy) and `ref_per_token_logps` (when a reference
        is used) to a rollout batch. On-policy, the loss pass's detached log-probabilities are the old ones (a trainer
        that compares them with an external sampler's, like GRPO, does so in its loss)."""
        if self._needs_rollout_logps():
            batch["old_per_token_logps"] = self._batched_logps(self.model, batch)
        if self._needs_ref_model(self.args):
            with self._reference_context(self.model, self.ref_model) as reference:
                batch["ref_per_token_logps"] = self._batched_logps(reference, batch)

    # ------------------------------------------------------------------------------------------------------------
    # Loss plumbing
    # ------------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError(f"{type(self).__name__} does not support returning outputs from compute_loss.")
        return self._compute_loss(model, inputs)

    def _gradient_accumulation_divisor(self) -> float:
        if self._mode != "train":
            return 1.0
        return float(
            getattr(self, "current_gradient_accumulation_steps", None) or self.args.gradient_accumulation_steps
        )

    def _add_aux_loss(self, loss: torch.Tensor, outputs: Any) -> torch.Tensor:
        if self._aux_loss_enabled and getattr(outputs, "aux_loss", None) is not None:
            self._record_metric("aux_loss", outputs.aux_loss)
            loss = loss + self._aux_loss_coef * outputs.aux_loss / self._gradient_accumulation_divisor()
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        self._timing = {"rollout": 0.0, "generation": 0.0}
        loss = super().training_step(model, inputs, num_items_in_batch)
        elapsed = time.perf_counter() - start
        metrics = self._metrics["train"]
        metrics["step_time"].append(elapsed)
        # Per micro-step times (0 rollout time on micro-steps served from the buffer), so interval means are
        # amortised costs per step.
        metrics["timing/rollout"].append(self._timing["rollout"])
        metrics["timing/generation"].append(self._timing["generation"])
        metrics["timing/training"].append(elapsed - self._timing["rollout"])
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).mean().detach()
        return loss, None, None

    def _on_optimizer_step(self) -> None:
        """Called after each optimizer step (adaptive controllers live here)."""

    # ------------------------------------------------------------------------------------------------------------
    # Metrics and completion logs
    # ------------------------------------------------------------------------------------------------------------
    def _record_reduced(self, name: str, value: torch.Tensor, reduction: str) -> None:
        """Record a local scalar reduced across processes with `min`, `max` or `mean` (NaN-aware)."""
        gathered = self.accelerator.gather(value.detach().float().reshape(1))
        finite = gathered[~torch.isnan(gathered)]
        if finite.numel() == 0:
            result = float("nan")
        elif reduction == "min":
            result = finite.min().item()
        elif reduction == "max":
            result = finite.max().item()
        else:
            result = finite.mean().item()
        self._metrics[self._mode][name].append(result)

    def _record_rollout_metrics(
        self,
        mode: str,
        prompt_mask: torch.Tensor,
        completion_mask: torch.Tensor,
        terminated: torch.Tensor,
        lengths: torch.Tensor,
        rewards_per_func: torch.Tensor,
    ) -> None:
        gather = self.accelerator.gather
        metrics = self._metrics[mode]
        tokens = gather((prompt_mask.sum() + completion_mask.sum()).reshape(1)).sum().item()
        if mode == "train":
            self.state.num_input_tokens_seen += int(tokens)
            metrics["num_tokens"] = [float(self.state.num_input_tokens_seen)]
        else:
            self._eval_num_tokens += int(tokens)
            metrics["num_tokens"] = [float(self._eval_num_tokens)]

        all_lengths = gather(lengths.float())
        all_terminated = gather(terminated.long()).bool()
        metrics["completions/mean_length"].append(all_lengths.mean().item())
        metrics["completions/min_length"].append(all_lengths.min().item())
        metrics["completions/max_length"].append(all_lengths.max().item())
        terminated_lengths = all_lengths[all_terminated]
        if terminated_lengths.numel() == 0:
            terminated_lengths = torch.zeros(1, device=all_lengths.device)
        metrics["completions/mean_terminated_length"].append(terminated_lengths.mean().item())
        metrics["completions/min_terminated_length"].append(terminated_lengths.min().item())
        metrics["completions/max_terminated_length"].append(terminated_lengths.max().item())
        metrics["completions/clipped_ratio"].append(1.0 - all_terminated.float().mean().item())

        for i, name in enumerate(self.reward_func_names):
            column = rewards_per_func[:, i]
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(column).item())
            metrics[f"rewards/{name}/std"].append(nanstd(column).item())
        rewards = self._aggregated_rewards(rewards_per_func)
        group_std = rewards.view(-1, self._group_size()).std(dim=1)
        metrics["reward"].append(rewards.mean().item())
        metrics["reward_std"].append(group_std.mean().item())
        zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
        metrics["frac_reward_zero_std"].append(zero_std.float().mean().item())

    def _store_completions(
        self,
        mode: str,
        prompts: list[Any],
        completions: list[Any],
        rewards_per_func: torch.Tensor,
        advantages: torch.Tensor,
    ) -> None:
        all_prompts = gather_object(prompts)
        all_completions = gather_object(completions)
        extra = {name: gather_object(values) for name, values in self._logged_extra.items()}
        self._logged_extra = {}
        rewards = rewards_per_func.cpu()
        rows = []
        for k, (prompt, completion) in enumerate(zip(all_prompts, all_completions)):
            row = {"step": self.state.global_step, "prompt": prompt, "completion": completion}
            for i, name in enumerate(self.reward_func_names):
                row[name] = rewards[k, i].item()
            for name, values in extra.items():
                row[name] = values[k] if k < len(values) else None
            row["advantage"] = advantages[k].item()
            rows.append(row)
        limit = self.args.generation_batch_size
        self._completion_logs[mode] = (self._completion_logs[mode] + rows)[-limit:]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = self._mode
        super().log(logs, start_time)
        rows = self._completion_logs[mode]
        if not (getattr(self.args, "log_completions", False) and rows):
            return
        self._completion_logs[mode] = []
        if not self.accelerator.is_main_process:
            return
        if self.args.log_unique_prompts:
            seen, unique_rows = set(), []
            for row in rows:
                key = json.dumps(row["prompt"], sort_keys=True, default=str)
                if key not in seen:
                    seen.add(key)
                    unique_rows.append(row)
            rows = unique_rows
        fixed = {"step", "prompt", "completion", "advantage", *self.reward_func_names}
        extra_names = [key for key in rows[0] if key not in fixed]
        try:
            print_prompt_completions_sample(
                [row["prompt"] for row in rows],
                [row["completion"] for row in rows],
                {name: [row[name] for row in rows] for name in self.reward_func_names},
                [row["advantage"] for row in rows],
                self.state.global_step,
                self.args.num_completions_to_print,
                extra={name: [row.get(name) for row in rows] for name in extra_names} or None,
            )
        except ImportError:
            logger.warning("log_completions=True but `rich` is not installed; the completion table is not printed.")
        self._write_completions_parquet(rows, mode)

    def _write_completions_parquet(self, rows: list[dict[str, Any]], mode: str) -> None:
        import pandas as pd

        def flatten(value: Any) -> Any:
            return (
                value
                if isinstance(value, (str, int, float, bool)) or value is None
                else json.dumps(value, default=str)
            )

        frame = pd.DataFrame([{key: flatten(value) for key, value in row.items()} for row in rows])
        folder = os.path.join(self.args.output_dir, "completions")
        os.makedirs(folder, exist_ok=True)
        suffix = "" if mode == "train" else "_eval"
        frame.to_parquet(os.path.join(folder, f"completions_{self.state.global_step:05d}{suffix}.parquet"))
        report_to = self.args.report_to or []
        if "wandb" in report_to:
            try:
                import wandb

                if wandb.run is not None:
                    wandb.log({"completions": wandb.Table(dataframe=frame)})
            except ImportError:
                pass
