"""The rollout / reward / advantage core shared by the online RL trainers (GRPO, RLOO, distillation, and those built
on them).

An online trainer repeats: sample a batch of prompts, generate several completions per prompt with the current
policy, score them with reward functions, turn scores into advantages, then take one or more optimizer steps on the
resulting batch. The seams of that step are TRL 1.16's protected hooks, called where TRL calls them with TRL's data,
so that a subclass written for TRL changes the run exactly as under TRL. One GRPO step (files in brackets):

```
training_step(model, rows)                                  [here; counts `_step`, logs `step_time`]
└─ Trainer.training_step → _prepare_inputs(rows)            [here; a new round every steps_per_generation *
   │                                                         num_iterations micro-steps, else the buffer]
   ├─ _generate_and_score_completions(rows)                 [here]
   │  ├─ _prepare_rollout_rows(rows)                        [tool_calling.py: environments reset]
   │  ├─ _generate(prompts) → _rollout(prompts)             [here → online_generation.py; tool_calling.py for tools]
   │  │  ├─ _tokenize_prompts(prompts)                      [online_generation.py]
   │  │  └─ _generate_single_turn(ids, images, fields, G)   [grpo_trainer.py → online_generation._sample_completions]
   │  ├─ _calculate_rewards(rows, prompts, completions, completion_ids_list)    [online_rewards.py]
   │  ├─ _get_per_token_logps_and_entropies(...)  old / reference log-probs, when needed  [online_logprobs.py]
   │  ├─ _compute_advantages(rewards, batch)                [grpo_trainer.py / rloo_trainer.py]
   │  └─ returns the batch dict (prompt/completion ids and masks, advantages, num_items_in_batch, ...)
   │  then one randperm shuffle and a split into steps_per_generation micro-batches
   └─ compute_loss(model, batch) → _compute_loss(model, batch)                   [grpo_trainer.py]
      └─ _get_per_token_logps_and_entropies(model, ids, mask, C, compute_entropy=True, ...)   [online_logprobs.py]
```

Subclasses implement `_compute_advantages(rewards_per_func, batch)` and `_compute_loss(model, inputs)`; TRL's
`_generate(prompts)` returns the tuple named by `_generate_outputs`. The fast paths stay behind the hooks: the
transformers back-end prefills each distinct prompt once (`online_generation.py`), and
`_get_per_token_logps_and_entropies` runs the completions of one prompt on a shared prefix; an override of a hook
replaces them with it.

Where each concern lives (this module is the front: it defines the trainer and re-exports the names below):

- `online_math.py`: the pure tensor functions (`masked_mean`, `aggregate_rewards`, `group_advantages`,
  `leave_one_out_advantages`, `k3_kl`, `completion_mask_from_ids`, `ADVANTAGE_EPS`);
- `online_generation.py`: `_OnlineGenerationMixin` (prompt rendering, `_tokenize_prompts`, `_rollout`, the
  back-ends behind `_generate_single_turn`) and `generate_with_shared_prompts`;
- `online_rewards.py`: `_OnlineRewardsMixin` (`_prepare_reward_funcs`, `_calculate_rewards`, reward models) and the
  `RewardFunc` type;
- `online_metrics.py`: `_OnlineMetricsMixin` (rollout metrics, completions table, `log`);
- `online_logprobs.py`: `_OnlineLogprobsMixin` (`_get_per_token_logps_and_entropies` and the shared-prefix passes
  behind it, `_compute_rollout_logps`);
- here: construction, data loading, the round itself (`_prepare_inputs`, `_generate_and_score_completions`) and the
  loss plumbing.
"""

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from .base_trainer import _BaseTrainer
from .online_generation import _OnlineGenerationMixin, _router_logits_off, generate_with_shared_prompts
from .online_logprobs import _OnlineLogprobsMixin
from .online_math import (
    ADVANTAGE_EPS,
    aggregate_rewards,
    completion_mask_from_ids,
    group_advantages,
    k3_kl,
    leave_one_out_advantages,
    masked_mean,
)
from .online_metrics import _OnlineMetricsMixin
from .online_rewards import RewardFunc, _accepts_keyword, _OnlineRewardsMixin, _run_coroutines
from .run_report.callback import keep_samples_for_report
from .utils import (
    RepeatSampler,
    disable_dropout_in_model,
    identity,
    pad,
    repeat_iterable_dataset,
    shuffle_sequence_dict,
    split_tensor_dict,
)
from .utils.ignored_options import ONLINE_IGNORED_OPTIONS
from .utils.vision import (
    check_image_columns,
    check_vision_processing_class,
    is_vision_example,
    prompt_with_images,
)


def _take(rows: list | None, indices: list[int]) -> list | None:
    return None if rows is None else [rows[i] for i in indices]


def _log_timing() -> bool:
    """Per-step `timing/rollout|generation|training` metrics: off by default (TRL logs none), on with
    `TRL_LOG_TIMING=1` (the benchmarks set it)."""
    return os.environ.get("TRL_LOG_TIMING", "0").lower() in ("1", "true", "yes")


# Names imported from this module before it was split (by trainers, tests and user code), kept importable here.
__all__ = [
    "ADVANTAGE_EPS",
    "RewardFunc",
    "_OnlineTrainer",
    "_accepts_keyword",
    "_router_logits_off",
    "_run_coroutines",
    "aggregate_rewards",
    "completion_mask_from_ids",
    "generate_with_shared_prompts",
    "group_advantages",
    "k3_kl",
    "leave_one_out_advantages",
    "masked_mean",
]


class _OnlineStateCallback(TrainerCallback):
    """Keeps the trainer's rollout bookkeeping aligned with the Trainer's step counter (fresh runs and resumes)."""

    def __init__(self, trainer: "_OnlineTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._step = state.global_step * args.gradient_accumulation_steps
        # A resumed run continues the generation round its checkpoint was taken in (see `_restore_checkpoint_state`).
        self.trainer._buffered_inputs = self.trainer.__dict__.pop("_resumed_buffered_inputs", None)

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._on_optimizer_step()


# ---------------------------------------------------------------------------------------------------------------------
# The trainer core
# ---------------------------------------------------------------------------------------------------------------------
class _OnlineTrainer(
    _OnlineLogprobsMixin, _OnlineGenerationMixin, _OnlineRewardsMixin, _OnlineMetricsMixin, _BaseTrainer
):
    """Base class of online RL trainers: prompt sampling, generation, rewards, advantages, metrics and logging.

    Subclasses set `_config_class` and `_name`, and implement `_compute_advantages` and `_compute_loss`.
    They may override `_needs_ref_model`, `_needs_rollout_logps` and `_generate`.
    """

    _config_class: type = None
    # Whether a round is shuffled (one `randperm` on the global RNG) before its split into micro-batches, as TRL's GRPO
    # does; TRL's self-distillation trainers split it in generation order.
    _shuffle_rollout_batch = True
    # Whether the batch carries `num_items_in_batch`, the loss tokens of the round on all processes (TRL's GRPO and
    # distillation normalise token-level losses by it).
    _batch_counts_loss_tokens = True
    _ignored_options = ONLINE_IGNORED_OPTIONS
    # `compute_loss` normalises for gradient accumulation itself; the Trainer must not divide again.
    loss_is_scaled_for_ga = True
    # GRPO and RLOO log each step's wall time (`step_time`) as TRL does; TRL's Online DPO family does not.
    _logs_step_time = True
    # Completions of one prompt run that prompt once in the loss and log-prob passes (see `_shared_prompt_layout`);
    # `_shared_prefix_passes` counts the passes that did.
    _share_prefix = True
    _shared_prefix_passes = 0
    # The reference scores a rollout batch while it is prepared, before the loss's forward pass.
    _reference_pass_after_policy_forward = False
    # Sampling several completions a prompt dominates a step: a second backward pass costs less of it (~1.5x the step
    # at 24 layers) to take every gradient off the peak (`optimizer_in_backward`).
    _clips_in_two_backward_passes = True
    # Config values TRL keeps as trainer attributes (plugins read them there).
    _copied_config_fields = (
        "loss_type",
        "scale_rewards",
        "importance_sampling_level",
        "num_iterations",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "mask_truncated_completions",
        "multi_objective_aggregation",
        "off_policy_mask_threshold",
        "top_entropy_quantile",
        "use_adaptive_entropy",
        "pad_to_multiple_of",
        "shuffle_dataset",
        "normalize_advantages",
        "reward_clip_range",
    )

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
            args = self._default_args(self._config_class, model)
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
        model = self._load_trained_model(model, args, peft_config, quantization_config=quantization_config)
        if processing_class is None:
            processing_class = self._load_processing_class(model_id, args, padding_side="left")
        # Images: prompts are processed with their images at generation time; pixel values follow each row.
        first_example = self._first_example(train_dataset)
        check_image_columns(first_example, trainer_name)
        self._is_vision_dataset = is_vision_example(first_example)
        if self._is_vision_dataset:
            check_vision_processing_class(processing_class, trainer_name)
            if rollout_func is not None:
                raise ValueError(
                    f"{trainer_name} generates from image prompts with transformers' generate or vLLM only; "
                    "rollout_func is not supported with images. Drop rollout_func, or train on text prompts."
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
        self._check_reward_func_signatures(train_dataset)
        num_funcs = len(self.reward_funcs)
        if args.reward_weights is not None:
            if len(args.reward_weights) != num_funcs:
                raise ValueError(
                    f"Number of reward weights ({len(args.reward_weights)}) must match number of reward functions "
                    f"({num_funcs}): reward_weights has {len(args.reward_weights)} values but there are {num_funcs} "
                    f"reward functions ({self.reward_func_names}); give exactly one weight per reward function."
                )
            self.reward_weights = torch.tensor(args.reward_weights, dtype=torch.float32)
        else:
            self.reward_weights = torch.ones(num_funcs, dtype=torch.float32)

        # ---- PEFT and reference model --------------------------------------------------------------------------
        model = self._wrap_peft(model, peft_config, args)
        ref_model = self._build_ref_model(user_model, model, ref_model, args, needed=self._needs_ref_model(args))
        self._copy_given_adapter_as_reference(user_model, model, self._needs_ref_model(args))
        if ref_model is not None:
            if args.disable_dropout:
                disable_dropout_in_model(ref_model)
            if getattr(args, "cast_lm_head_to_fp32", False):
                self._cast_lm_head_to_fp32(ref_model)

        # ---- Generation ----------------------------------------------------------------------------------------
        self.rollout_func = rollout_func
        self.use_vllm = bool(getattr(args, "use_vllm", False))  # TRL's attribute (callbacks read it)
        settings = self._rollout_settings(args)
        self.num_generations = settings["num_generations"]
        self.num_generations_eval = settings["num_generations_eval"]
        self.max_completion_length = settings["max_completion_length"]
        self.chat_template_kwargs = settings["chat_template_kwargs"]
        self.eos_token_ids = self._eos_token_ids(model, tokenizer)
        self.pad_token_id = tokenizer.pad_token_id
        self._image_token_id = getattr(processing_class, "image_token_id", None)  # suppressed in generation
        self.generation_config = self._build_generation_config(args, tokenizer)
        # TRL's attributes that plugins read: the text tokenizer, whether the processing class is a vision
        # processor, and the resolved sampling and loss settings (copies of the config's values).
        self._tokenizer = tokenizer
        self._is_vlm = isinstance(processing_class, ProcessorMixin)
        for name in self._copied_config_fields:
            if hasattr(args, name):
                setattr(self, name, getattr(args, name))

        # ---- State ---------------------------------------------------------------------------------------------
        self._init_metrics()
        self._step = 0
        self._buffered_inputs: list[dict[str, Any]] | None = None
        self._timing = {"rollout": 0.0, "generation": 0.0}
        self._completion_logs: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
        self._logged_extra: dict[str, list] = {}
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

        As TRL decides it: true when `gradient_accumulation_steps` is a multiple of `steps_per_generation *
        num_iterations`, so that every use of a round (all its micro-batches, all its iterations) falls inside one
        optimizer step. The old-policy log-probabilities are then the detached current ones and need no extra pass.
        """
        args = self.args
        return args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) == 0

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

    def _setup_aux_loss(self, model: nn.Module, args: Any) -> None:
        """Enable the mixture-of-experts load-balancing loss when the model has a router (see router_aux_loss_coef)."""
        # Shared with the offline trainers; configs without `router_aux_loss_coef` use the model config's setting.
        self._aux_loss_enabled, self._aux_loss_coef = self._resolve_aux_loss(model, args)

    @staticmethod
    def _cast_lm_head_to_fp32(model: nn.Module) -> None:
        """Keep the output projection in float32 and feed it float32 hidden states (ScaleRL).

        A head tied to the input embeddings gets its own float32 copy of the shared weight (the embeddings keep
        their dtype; `config.tie_word_embeddings` is left as it is), as TRL does.
        """
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            raise ValueError("cast_lm_head_to_fp32=True, but the model has no output embeddings (LM head).")
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embeddings is not None and head.weight is embeddings.weight:
            head.weight = nn.Parameter(head.weight.detach().float().clone(), requires_grad=head.weight.requires_grad)
        head.float()
        head.register_forward_pre_hook(lambda module, inputs: tuple(x.float() for x in inputs))

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
        args = self.args
        if isinstance(dataset, IterableDataset):
            if args.shuffle_dataset:  # as TRL: a seeded buffer shuffle, reseeded every epoch through set_epoch
                dataset = dataset.shuffle(seed=args.seed)
            dataset = repeat_iterable_dataset(
                dataset,
                mini_repeat_count=self.num_generations,
                batch_size=args.generation_batch_size // self.num_generations,
                repeat_count=args.num_iterations * args.steps_per_generation,
            )
            return self._iterable_dataloader(dataset, self._train_batch_size * args.steps_per_generation, "Training")
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
        if dataset is None:
            raise ValueError(f"{type(self).__name__}: evaluation requires an eval_dataset.")
        if isinstance(dataset, IterableDataset):
            dataset = repeat_iterable_dataset(dataset.shuffle(seed=self.args.seed), self.num_generations_eval)
            return self._iterable_dataloader(dataset, self.args.per_device_eval_batch_size, "Evaluation")
        return self._get_dataloader(
            dataset=dataset,
            description="Evaluation",
            batch_size=self.args.per_device_eval_batch_size,
            sampler_fn=self._get_eval_sampler,
        )

    def _iterable_dataloader(self, dataset: torch.utils.data.IterableDataset, batch_size: int, description: str):
        """DataLoader of a streaming dataset (already repeated into groups).

        Read in the main process (no worker processes, whatever `dataloader_num_workers`): a `datasets`
        IterableDataset splits its shards between workers, whose batches the DataLoader then interleaves, which would
        break the groups and rounds of completions; reading it once keeps the order TRL produces. Never dispatched
        from the main process either (the batches are lists of rows, not tensors): every process reads the stream and
        keeps its slice of each global batch.
        """
        from torch.utils.data import DataLoader

        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, description=description),
            num_workers=0,
            pin_memory=self.args.dataloader_pin_memory,
        )
        config = self.accelerator.dataloader_config
        dispatch = config.dispatch_batches
        config.dispatch_batches = False
        try:
            return self.accelerator.prepare(loader)
        finally:
            config.dispatch_batches = dispatch

    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """A dataset given to `evaluate()` is used as the constructor's `eval_dataset` is: raw prompts (a `Dataset` or
        an `IterableDataset`), generated from at evaluation time; only its `prompt` column is checked."""
        self._check_prompt_dataset(dataset, name)
        return dataset

    def _get_eval_sampler(self, eval_dataset: Any):
        return RepeatSampler(
            data_source=eval_dataset, mini_repeat_count=self.num_generations_eval, seed=self.args.seed
        )

    # ------------------------------------------------------------------------------------------------------------
    # Rollout: generate, score, compute advantages; buffer the micro-batches of a round
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """One micro-batch: in training, a new round is generated (`_generate_and_score_completions`) every
        `steps_per_generation * num_iterations` micro-steps, shuffled (one `randperm`) and split into
        `steps_per_generation` micro-batches that the next micro-steps pop; evaluation generates every batch."""
        if self._mode == "eval":
            return self._generate_and_score_completions(generation_batch)
        args = self.args
        steps = args.steps_per_generation
        if self._buffered_inputs is None or self._step % (steps * args.num_iterations) == 0:
            batch = self._generate_and_score_completions(generation_batch)
            if self._shuffle_rollout_batch:
                batch = shuffle_sequence_dict(batch)  # micro-batches mix completions of different prompts
            self._buffered_inputs = split_tensor_dict(batch, steps)
        return self._buffered_inputs[self._step % steps]

    def _checkpoint_state(self) -> dict[str, Any]:
        # A checkpoint taken in the middle of a generation round keeps the round's remaining micro-batches, so that a
        # resumed run trains on the same completions instead of sampling new ones.
        state = super()._checkpoint_state()
        if self._buffered_inputs is not None and _loadable_without_pickle(self._buffered_inputs):
            state["buffered_inputs"] = self._buffered_inputs
        return state

    def _restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        super()._restore_checkpoint_state(state)
        if "buffered_inputs" in state:
            device = self.accelerator.device
            self._resumed_buffered_inputs = [
                {key: value.to(device) if torch.is_tensor(value) else value for key, value in chunk.items()}
                for chunk in state["buffered_inputs"]
            ]

    def _global_token_count(self, completion_mask: torch.Tensor) -> torch.Tensor:
        count = completion_mask.sum().float().reshape(1)
        return self.accelerator.gather(count).sum()

    # Names of the values TRL's `_generate(prompts)` returns for this trainer, in order (RLOO's three; GRPO and
    # distillation return more). `_generate` builds the tuple from `_rollout`; an override returns the same shape.
    _generate_outputs: tuple[str, ...] = ("prompt_ids", "completion_ids", "completions")

    def _generate(self, prompts: list) -> tuple:
        """TRL's hook: the completions of one round, as the tuple of `_generate_outputs` (token id lists, decoded
        completions, ...). Values the tuple has no place for (image inputs per row) travel beside it."""
        rollout = self._rollout(prompts)
        self._rollout_extras = {key: value for key, value in rollout.items() if key not in self._generate_outputs}
        return tuple(rollout.get(name) for name in self._generate_outputs)

    def _generate_rows(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """`_rollout` on the prompts of `rows` (one completion per row), for trainers that generate outside
        `_generate_and_score_completions` (the Online DPO family)."""
        self._prompt_rows = rows
        try:
            return self._rollout([row["prompt"] for row in rows])
        finally:
            self._prompt_rows = None

    def _prepare_rollout_rows(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Hook: the rows of a round before generation (environments reset and extend their prompts here)."""
        return inputs

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's hook: one round on this process's `inputs` (a list of dataset rows): generate, score, compute the
        advantages; returns the batch dict the loss reads.

        Keys: `prompt_ids`/`prompt_mask` `(B, P)` (left-padded), `completion_ids`/`completion_mask` `(B, C)`
        (right-padded; the mask is 1 through the first end-of-sequence token, and 0 for a whole truncated row under
        `mask_truncated_completions`), `advantages` `(B,)`, `num_items_in_batch` (0-dim: the loss tokens of the whole
        round on all processes), and when used `tool_mask`, `old_per_token_logps`, `ref_per_token_logps`,
        `sampling_per_token_logps`, `importance_sampling_ratio`, `vision_rows`. Keys a subclass adds travel with
        their rows through the shuffle and split of `_prepare_inputs`.
        """
        start = time.perf_counter()
        mode = self._mode
        device = self.accelerator.device
        if self._is_vision_dataset:  # as in TRL, prompts (also those given to the rewards) carry their images
            inputs = [{**example, "prompt": prompt_with_images(example)} for example in inputs]
        inputs = self._prepare_rollout_rows(inputs)
        prompts = [example["prompt"] for example in inputs]

        self._prompt_rows = inputs
        try:
            output = self._generate(prompts)
        finally:
            self._prompt_rows = None
        rollout = {**self.__dict__.pop("_rollout_extras", {}), **dict(zip(self._generate_outputs, output))}
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

        offset = self.accelerator.process_index * len(prompts)
        completions = rollout.get("completions")
        if completions is None:
            completions = self._decode_completions(prompts, completion_lists)
        extra_fields = rollout.get("extra_fields") or {}
        if extra_fields:  # as TRL: a rollout_func's extra keys become columns of the rows the rewards see
            inputs = [
                {**example, **{key: values[i] for key, values in extra_fields.items()}}
                for i, example in enumerate(inputs)
            ]
        rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_lists)
        # Token counts and completion lengths describe everything generated, even rows a method then drops.
        generated = (prompt_mask, completion_mask, terminated, lengths)
        tool_lists, sampling_lists = rollout.get("tool_mask"), rollout.get("sampling_logps")
        vision_rows = rollout.get("vision_rows")
        keep = self._select_rollout_rows(completions, rewards_per_func)
        if keep is not None:  # a method that trains on a subset of the completions (GFPO's group filter)
            local = keep[(keep >= offset) & (keep < offset + len(prompts))] - offset
            rows = local.tolist()
            prompts, completions = [prompts[i] for i in rows], [completions[i] for i in rows]
            prompt_ids, prompt_mask, completion_ids, completion_mask, terminated, lengths = (
                t[local] for t in (prompt_ids, prompt_mask, completion_ids, completion_mask, terminated, lengths)
            )
            tool_lists, sampling_lists = _take(tool_lists, rows), _take(sampling_lists, rows)
            vision_rows = _take(vision_rows, rows)
            rewards_per_func = rewards_per_func[keep]

        if self.args.mask_truncated_completions:
            completion_mask = completion_mask * terminated.unsqueeze(1).to(completion_mask.dtype)
        batch: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
        }
        if tool_lists is not None:
            # Tool results are context for the next turn: attended to, but outside the loss.
            tool_masks = [torch.tensor(m, dtype=completion_mask.dtype, device=device) for m in tool_lists]
            width = completion_mask.shape[1]
            tool_mask = pad(tool_masks, 1, "right", multiple)[:, :width]
            batch["tool_mask"] = torch.nn.functional.pad(tool_mask, (0, width - tool_mask.shape[1]), value=1)
        if vision_rows is not None:
            batch["vision_rows"] = vision_rows
        if sampling_lists is not None:
            sampling = [torch.tensor(lp, dtype=torch.float32, device=device) for lp in sampling_lists]
            batch["sampling_per_token_logps"] = pad(sampling, 0.0, "right", multiple)[:, : completion_ids.shape[1]]
        self._compute_rollout_logps(batch)

        advantages = self._compute_advantages(rewards_per_func, batch)
        process_slice = slice(
            self.accelerator.process_index * len(prompts), (self.accelerator.process_index + 1) * len(prompts)
        )
        all_advantages = advantages
        batch["advantages"] = advantages[process_slice].to(device)
        batch = self._finish_rollout_batch(batch, rewards_per_func)
        if self._batch_counts_loss_tokens:
            batch["num_items_in_batch"] = self._global_token_count(self._loss_mask(batch))

        self._record_rollout_metrics(mode, *generated, rewards_per_func)
        if mode == "train":  # a few of this process's completions for the run report (no gathering)
            reward_names = self.reward_func_names if self._logs_rewards else []
            keep_samples_for_report(self, prompts, completions, rewards_per_func[process_slice], reward_names)
        if self.args.log_completions:
            self._store_completions(mode, prompts, completions, rewards_per_func, all_advantages)
        self._timing["rollout"] += time.perf_counter() - start
        return batch

    @staticmethod
    def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
        """The completion tokens the loss is taken over: `completion_mask`, without tool results (`tool_mask`)."""
        mask = inputs["completion_mask"]
        tool_mask = inputs.get("tool_mask")
        return mask if tool_mask is None else mask * tool_mask

    def _select_rollout_rows(self, completions: list, rewards_per_func: torch.Tensor) -> torch.Tensor | None:
        """Hook: global indices (into the gathered `(N, F)` rewards) of the completions to train on, or None for all.

        The kept rows must form whole groups of `_group_size()` completions each, in group order."""
        return None

    def _finish_rollout_batch(self, batch: dict[str, Any], rewards_per_func: torch.Tensor) -> dict[str, Any]:
        """Hook: the rollout batch once advantages are set (e.g. replaying stored groups); unchanged here."""
        return batch

    def _group_size(self) -> int:
        return self.num_generations if self._mode == "train" else self.num_generations_eval

    # ------------------------------------------------------------------------------------------------------------
    # Loss plumbing
    # ------------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError(f"{type(self).__name__} does not support returning outputs from compute_loss.")
        return self._compute_loss(model, inputs)

    def _gradient_accumulation_divisor(self) -> float:
        """What `_compute_loss` divides a loss by for gradient accumulation: the accumulation steps in training when
        the trainer declares `loss_is_scaled_for_ga` (else the Trainer divides, as TRL's RLOO leaves it), 1 otherwise."""
        if self._mode != "train" or not self.loss_is_scaled_for_ga:
            return 1.0
        return float(self.current_gradient_accumulation_steps or self.args.gradient_accumulation_steps)

    def _add_aux_loss(self, loss: torch.Tensor, aux_loss: torch.Tensor | None) -> torch.Tensor:
        """`loss` plus the router load-balancing loss (`aux_loss`, from `_get_per_token_logps_and_entropies`) times
        its coefficient, when the model has one."""
        if self._aux_loss_enabled and aux_loss is not None:
            self._record_metric("aux_loss", aux_loss)
            loss = loss + self._aux_loss_coef * aux_loss / self._gradient_accumulation_divisor()
        return loss

    def _step_token_count(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """The normaliser of token-level losses (as TRL): the round's loss tokens on all processes
        (`num_items_in_batch`), scaled in training to one optimizer step by `gradient_accumulation_steps /
        steps_per_generation`."""
        count = inputs.get("num_items_in_batch")
        if count is None or self._mode != "train":
            return count
        return count * (self.args.gradient_accumulation_steps / self.args.steps_per_generation)

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        self._timing = {"rollout": 0.0, "generation": 0.0}
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        elapsed = time.perf_counter() - start
        metrics = self._metrics["train"]
        if not _log_timing():
            if self._logs_step_time:
                metrics["step_time"].append(elapsed)
            return loss
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


def _loadable_without_pickle(value: Any) -> bool:
    """Whether `value` holds only what `torch.load(weights_only=True)` reads back: tensors, numbers, strings, None,
    and lists, tuples and dicts of them."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_loadable_without_pickle(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _loadable_without_pickle(item) for key, item in value.items())
    return False
