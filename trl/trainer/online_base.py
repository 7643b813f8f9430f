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

Where each concern lives (this module is the front: it defines the trainer and re-exports the names below):

- `online_math.py`: the pure tensor functions (`masked_mean`, `aggregate_rewards`, `group_advantages`,
  `leave_one_out_advantages`, `k3_kl`, `completion_mask_from_ids`, `ADVANTAGE_EPS`);
- `online_generation.py`: step 2, `_OnlineGenerationMixin` (prompt rendering, `_rollout`, `_generate` and its
  back-ends) and `generate_with_shared_prompts`;
- `online_rewards.py`: step 3, `_OnlineRewardsMixin` (`_prepare_reward_funcs`, `_compute_rewards`, reward models)
  and the `RewardFunc` type;
- `online_metrics.py`: `_OnlineMetricsMixin` (rollout metrics, completions table, `log`);
- here: construction, data loading, the round itself (`_prepare_inputs`, `_generate_and_score`), log-probabilities
  and the loss plumbing.
"""

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from .base_trainer import _BaseTrainer
from .online_generation import (
    CONTINUATION_IDS_KEY,
    _OnlineGenerationMixin,
    _router_logits_off,
    generate_with_shared_prompts,
)
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
    compute_token_logps,
    disable_dropout_in_model,
    identity,
    pad,
    repeat_iterable_dataset,
    shuffle_sequence_dict,
    split_tensor_dict,
)
from .utils.decode_replay import layers_checkpointed, replay_decoder_layers, replayed_layer_outputs
from .utils.prefix_sharing import (
    MIN_SHARED_SAVING,
    SharedPrefixLayout,
    contiguous_rows,
    same_prompt_groups,
    share_prefixes,
    shared_prefix_token_logps,
    sharing_possible_now,
    supports_prefix_sharing,
)
from .utils.vision import (
    check_image_columns,
    check_vision_processing_class,
    collate_vision_rows,
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
    "CONTINUATION_IDS_KEY",
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
class _OnlineTrainer(_OnlineGenerationMixin, _OnlineRewardsMixin, _OnlineMetricsMixin, _BaseTrainer):
    """Base class of online RL trainers: prompt sampling, generation, rewards, advantages, metrics and logging.

    Subclasses set `_config_class` and `_default_suffix`, and implement `_compute_advantages` and `_compute_loss`.
    They may override `_needs_ref_model`, `_needs_rollout_logps` and `_generate`.
    """

    _config_class: type = None
    _default_suffix: str = "Online"
    # `compute_loss` normalises for gradient accumulation itself; the Trainer must not divide again.
    loss_is_scaled_for_ga = True
    # GRPO and RLOO log each step's wall time (`step_time`) as TRL does; TRL's Online DPO family does not.
    _logs_step_time = True
    # Completions of one prompt run that prompt once in the loss and log-prob passes (see `_shared_prompt_layout`);
    # `_shared_prefix_passes` counts the passes that did.
    _share_prefix = True
    _shared_prefix_passes = 0
    # The loss pass replays the rollout decode's layer outputs instead of its checkpointed forward when it can (see
    # `_replayed_layer_outputs`); `_decode_replays` counts the passes that did.
    _decode_replay = False
    _decode_replays = 0

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

    def _generate_and_score(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """One rollout on this process's `inputs` (a list of dataset rows): returns the tensors of the batch."""
        start = time.perf_counter()
        mode = self._mode
        device = self.accelerator.device
        if self._is_vision_dataset:  # as in TRL, prompts (also those given to the rewards) carry their images
            inputs = [{**example, "prompt": prompt_with_images(example)} for example in inputs]
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

        offset = self.accelerator.process_index * len(prompts)
        completions = rollout.get("completions")
        if completions is None:
            completions = self._decode_completions(inputs, completion_lists)
        rewards_per_func = self._compute_rewards(
            inputs, prompts, completions, completion_lists, rollout.get("extra_fields") or {}
        )
        # Token counts and completion lengths describe everything generated, even rows a method then drops.
        generated = (prompt_mask, completion_mask, terminated, lengths)
        keep = self._select_rollout_rows(completions, rewards_per_func)
        if keep is not None:  # a method that trains on a subset of the completions (GFPO's group filter)
            local = keep[(keep >= offset) & (keep < offset + len(prompts))] - offset
            rows = local.tolist()
            prompts, completions = [prompts[i] for i in rows], [completions[i] for i in rows]
            prompt_ids, prompt_mask, completion_ids, completion_mask, terminated, lengths = (
                t[local] for t in (prompt_ids, prompt_mask, completion_ids, completion_mask, terminated, lengths)
            )
            rollout = {**rollout, "tool_mask": _take(rollout.get("tool_mask"), rows)}
            rollout["sampling_logps"] = _take(rollout.get("sampling_logps"), rows)
            rewards_per_func = rewards_per_func[keep]

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
        if rollout.get("vision_rows") is not None:
            batch["vision_rows"] = rollout["vision_rows"]
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
        batch = self._finish_rollout_batch(batch, rewards_per_func)

        self._record_rollout_metrics(mode, *generated, rewards_per_func)
        if mode == "train":  # a few of this process's completions for the run report (no gathering)
            reward_names = self.reward_func_names if self._logs_rewards else []
            keep_samples_for_report(self, prompts, completions, rewards_per_func[process_slice], reward_names)
        if self.args.log_completions:
            self._store_completions(mode, prompts, completions, rewards_per_func, all_advantages)
        self._timing["rollout"] += time.perf_counter() - start
        return batch

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
    # Log-probabilities
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _sequence_inputs(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask, position_ids)` of prompt + completion, each `(B, P + T)`.

        Positions are counted from each prompt's first real token, as during generation.
        """
        prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        # Completion tokens outside the loss mask (padding, masked truncated rows) are not attended to either; they
        # are never scored, so this changes no log-probability that is used. Multi-turn rollouts give the tokens to
        # attend to separately: tool results are context, yet outside the loss.
        attended = inputs.get("completion_attention_mask")
        attended = completion_mask if attended is None else attended
        attention_mask = torch.cat([prompt_mask, attended.long()], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        return input_ids, attention_mask, position_ids

    def _forward_logps(
        self, model: nn.Module, inputs: dict[str, Any], compute_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Per-token log-probabilities (and entropies) of the completion tokens, `(B, T)` each.

        The LM head runs only on completion positions (see `compute_token_logps`); positions are counted from each
        prompt's first real token, as during generation.
        """
        input_ids, attention_mask, position_ids = self._sequence_inputs(inputs)
        completion_mask = inputs["completion_mask"]
        prompt_length = inputs["prompt_ids"].shape[1]
        target_mask = torch.zeros(
            input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.bool, device=input_ids.device
        )
        target_mask[:, prompt_length - 1 :] = completion_mask.bool()
        image_inputs = {}
        if inputs.get("vision_rows") is not None:
            # The model derives its own (possibly multi-dimensional) positions around the image tokens.
            image_inputs = collate_vision_rows(inputs["vision_rows"], prompt_length, input_ids.shape[1])
            image_inputs = {key: value.to(input_ids.device) for key, value in image_inputs.items()}
            position_ids = None
        layout = None if image_inputs else self._shared_prompt_layout(model, inputs, input_ids, attention_mask)
        if layout is not None:
            replayed = None
            if not self._loss_compares_with_rollout_logps(inputs):
                replayed = self._replayed_layer_outputs(model, input_ids, attention_mask, layout)
            with contextlib.nullcontext() if replayed is None else replay_decoder_layers(model, replayed):
                result = shared_prefix_token_logps(
                    model,
                    input_ids,
                    layout,
                    target_mask,
                    compute_entropy=compute_entropy,
                    temperature=self._logprob_temperature(),
                )
        else:
            result = compute_token_logps(
                model,
                input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **image_inputs,
                target_mask=target_mask,
                temperature=self._logprob_temperature(),
                compute_entropy=compute_entropy,
            )
        logps = result.logps[:, prompt_length - 1 :]
        entropy = result.entropy[:, prompt_length - 1 :] if result.entropy is not None else None
        return logps, entropy, result.outputs

    def _shared_prompt_layout(
        self, model: nn.Module, inputs: dict[str, Any], input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> SharedPrefixLayout | None:
        """The shared-prefix layout of a rollout micro-batch whose completions of one prompt run that prompt once
        ([`~trl.trainer.utils.prefix_sharing.share_prefixes`]), or None to run whole rows.

        Whole rows run when the model cannot take the layout ([`supports_prefix_sharing`], checked once per model),
        when an auxiliary router loss reads the forward's outputs, when attended tokens are not contiguous
        (multi-turn tool results), or when sharing saves too few tokens to pay."""
        if not self._share_prefix or self._aux_loss_enabled or "completion_attention_mask" in inputs:
            return None
        cache = self.__dict__.setdefault("_prefix_sharing_support", {})
        if id(model) not in cache:
            cache[id(model)] = supports_prefix_sharing(model)
        if not cache[id(model)] or not sharing_possible_now(model):
            return None
        groups = same_prompt_groups(inputs["prompt_ids"], inputs["prompt_mask"])
        if len(groups) == input_ids.shape[0] or not contiguous_rows(attention_mask):
            return None
        layout = share_prefixes(input_ids, attention_mask, groups, pad_token_id=self.pad_token_id)
        if layout.saved_share < MIN_SHARED_SAVING:
            return None
        self._shared_prefix_passes += 1
        return layout

    def _replays_decode_outputs(self) -> bool:
        return self._decode_replay and self._share_prefix and not self._aux_loss_enabled

    def _loss_compares_with_rollout_logps(self, inputs: dict[str, Any]) -> bool:
        """Hook: whether the loss on `inputs` compares the pass's log-probabilities with the rollout's old ones (off
        policy); on-policy, the loss uses the pass's own, detached."""
        return "old_per_token_logps" in inputs

    def _replayed_layer_outputs(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layout: SharedPrefixLayout
    ) -> list[torch.Tensor] | None:
        """The rollout decode's decoder-layer outputs laid out for this gradient-checkpointed loss pass (see
        `utils/decode_replay.py`), or None to run the layers: when nothing was recorded, the pass keeps no graph or
        runs without checkpointing or under autocast, the parameters changed since the decode (an optimizer step,
        or any in-place change), or a token was not decoded by this rollout.

        Only on-policy passes replay (the caller checks, `_loss_compares_with_rollout_logps`): their old
        log-probabilities are the pass's own, detached, so the importance ratio stays exactly 1. Off-policy ones are
        compared with log-probabilities that a pass of the layers computed, and must be computed the same way."""
        recorded = self.__dict__.get("_rollout_layer_outputs")
        if recorded is None or not torch.is_grad_enabled() or not model.training:
            return None
        if not layers_checkpointed(model) or torch.is_autocast_enabled(input_ids.device.type):
            return None
        if recorded.stamp != self._parameters_stamp(model):
            return None
        replayed = replayed_layer_outputs(
            recorded, input_ids, attention_mask, layout.token_index, tuple(layout.input_ids.shape)
        )
        if replayed is not None:
            self._decode_replays += 1
        return replayed

    @torch.no_grad()
    def _batched_logps(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Log-probabilities of a whole rollout batch without gradients, in micro-batch-sized pieces."""
        size = self.args.per_device_train_batch_size if self._mode == "train" else self.args.per_device_eval_batch_size
        keys = (
            "prompt_ids",
            "prompt_mask",
            "completion_ids",
            "completion_mask",
            "completion_attention_mask",
            "vision_rows",
        )
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
