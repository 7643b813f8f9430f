"""Generalized Knowledge Distillation (GKD) trainer: SFT where the target is the teacher's distribution."""

import json
import os
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset
from transformers import (
    BaseImageProcessor,
    FeatureExtractionMixin,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    TrainerCallback,
)
from transformers.trainer_utils import EvalPrediction

from ...models.utils import disable_dropout_in_model, unwrap_model_for_generation
from ...trainer.fast_paths.small_row_linear import small_row_linear
from ...trainer.online_math import completion_mask_from_ids
from ...trainer.sft_trainer import SFTTrainer
from ...trainer.utils import create_model_from_path, generalized_jsd_loss, model_accepts_argument, pad
from ...trainer.utils.ignored_options import GKD_IGNORED_OPTIONS
from ..utils import DataCollatorForChatML
from .gkd_config import GKDConfig


class GKDTrainer(SFTTrainer):
    """Generalized Knowledge Distillation (Agarwal et al., 2024) of a teacher into a student.

    An [`SFTTrainer`] whose loss is the generalized Jensen-Shannon divergence between the student's and the teacher's
    next-token distributions on the completion tokens (see [`~trl.trainer.utils.generalized_jsd_loss`]). At every
    training batch, with probability `lmbda` the completions are replaced by the student's own samples (on-policy);
    otherwise, with `seq_kd=True`, by the teacher's samples; otherwise the dataset's completions are used. Evaluation
    always uses the dataset's completions.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    trainer = GKDTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        teacher_model=get_model_path("small-Qwen2ForCausalLM"),
        args=GKDConfig(output_dir="gkd-out", max_steps=5, max_new_tokens=16),
        train_dataset=load_test_dataset("conversational_language_modeling", split="train"),
    )
    trainer.train()
    ```

    Args:
        model: Student: a path or hub id (loaded with `args.model_init_kwargs`) or a causal LM instance.
        teacher_model: Teacher: a path or hub id (loaded with `args.teacher_model_init_kwargs`) or an instance; None
            uses `args.teacher_model_name_or_path`. It must share the student's vocabulary; it is frozen.
        args: The [`GKDConfig`]; None builds `GKDConfig(f"{model_name}-GKD")`.
        data_collator: Defaults to [`~trl.experimental.utils.DataCollatorForChatML`] (the collator must provide
            `input_ids`, `attention_mask`, `labels`, `prompts` and `prompt_attention_mask`).
        train_dataset: Conversations (`messages`, the last assistant turn being the completion) or conversational /
            plain `prompt` + `completion` pairs.
        eval_dataset: Same formats.
        processing_class: Tokenizer with a chat template; loaded from the student's path when omitted.
        compute_metrics: Metric function for evaluation, as in `Trainer`.
        callbacks: Extra callbacks.
        optimizers: Optimizer and scheduler to use instead of the defaults.
        preprocess_logits_for_metrics: Transform logits before they are cached for `compute_metrics`.
        peft_config: Adapter configuration for the student.
        formatting_func: Not supported (the collator renders conversations with the chat template); must be None.
    """

    _accepts_images = False  # the distillation collators are text-only

    _tag_names = ["trl", "gkd"]
    _ignored_options = GKD_IGNORED_OPTIONS
    _name = "GKD"
    # Hook for subclasses (GOLD): the config class `args` must be an instance of.
    _config_class: type = GKDConfig
    _paper = {
        "title": "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
        "id": "2306.13649",
        "citation": (
            "@inproceedings{agarwal2024on-policy,\n"
            "    title        = {{On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes}},\n"
            "    author       = {Rishabh Agarwal and Nino Vieillard and Yongchao Zhou and Piotr Stanczyk and Sabela "
            "Ramos Garea and Matthieu Geist and Olivier Bachem},\n"
            "    year         = 2024,\n"
            "    booktitle    = {The Twelfth International Conference on Learning Representations, {ICLR} 2024},\n"
            "}"
        ),
    }

    def __init__(
        self,
        model: "PreTrainedModel | nn.Module | str | None" = None,
        teacher_model: "PreTrainedModel | nn.Module | str" = None,
        args: GKDConfig | None = None,
        data_collator: Callable[[list[Any]], dict[str, Any]] | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: PreTrainedTokenizerBase
        | BaseImageProcessor
        | FeatureExtractionMixin
        | ProcessorMixin
        | None = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        peft_config: Any = None,
        formatting_func: Callable | None = None,
    ):
        trainer, config = type(self).__name__, self._config_class.__name__
        if model is None:
            raise ValueError(f"{trainer} needs a student `model` (a path, a hub id or a model instance).")
        if args is None:
            args = self._default_args(self._config_class, model)
        elif not isinstance(args, self._config_class):
            raise TypeError(
                f"{trainer} expects `args` to be a {config}, got {type(args).__name__}. Build a {config} (it accepts "
                "every SFTConfig field) instead."
            )
        if formatting_func is not None:
            raise ValueError(
                "GKDTrainer does not support `formatting_func`: its collator renders each conversation with the chat "
                "template and trains on the last assistant turn. Format the dataset into `messages` (or `prompt` / "
                "`completion`) beforehand and pass formatting_func=None."
            )
        if args.packing or args.padding_free:
            raise ValueError(
                "GKDTrainer does not support packing or padding_free: each batch is a left-padded set of prompts that "
                "may be regenerated. Set packing=False and padding_free=False."
            )
        # The collator tokenizes the raw conversations; the dataset is used as given.
        args.remove_unused_columns = False
        args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}

        self._teacher_given = teacher_model is not None
        teacher = self._load_teacher(teacher_model, args)
        if processing_class is None:
            processing_class = self._load_processing_class(self._model_id(model), args)
        tokenizer = self._ensure_pad_token(processing_class)
        if data_collator is None:
            data_collator = self._default_collator(tokenizer, args)

        super().__init__(
            model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config,
        )
        self._check_same_vocabulary(self.model, teacher, tokenizer, teacher_model, args)
        if args.disable_dropout:
            disable_dropout_in_model(self.model)
            disable_dropout_in_model(teacher)
        self.teacher_model = self._prepare_ref_model(self._freeze(teacher))
        self._teacher_accepts_logits_to_keep = model_accepts_argument(teacher, "logits_to_keep")

        self.lmbda = args.lmbda
        self.beta = args.beta
        self.temperature = args.temperature
        self.seq_kd = args.seq_kd
        self.generation_config = self._build_generation_config(args, tokenizer)
        # Ends of a generated completion: the tokenizer's eos and the student's own end-of-generation tokens.
        self._completion_end_ids = self._eos_token_ids_of(self.model, tokenizer)

    def _ignored_option_facts(self) -> dict[str, Any]:
        # The distillation loss is GKD's own: transformers' label smoothing does not reach it (as in TRL).
        return {**super()._ignored_option_facts(), "teacher_given": self._teacher_given, "label_smoothing": False}

    # ------------------------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def _load_teacher(cls, teacher_model: Any, args: GKDConfig) -> nn.Module:
        if teacher_model is None:
            teacher_model = args.teacher_model_name_or_path
        if teacher_model is None:
            raise ValueError(
                "GKDTrainer needs a teacher: pass `teacher_model` (a path, a hub id or a model instance) or set "
                "`teacher_model_name_or_path` in the GKDConfig."
            )
        init_kwargs = args.teacher_model_init_kwargs
        if isinstance(init_kwargs, str):
            init_kwargs = json.loads(init_kwargs)
        if not isinstance(teacher_model, str):
            if init_kwargs:
                raise ValueError(
                    "You passed teacher_model_init_kwargs to the GKDConfig, but your teacher_model is already "
                    "instantiated: the kwargs would be ignored. Pass the teacher as a path, or drop "
                    "teacher_model_init_kwargs."
                )
            return teacher_model
        init_kwargs = dict(init_kwargs or {})
        if args.trust_remote_code:
            init_kwargs.setdefault("trust_remote_code", True)
        return create_model_from_path(teacher_model, **init_kwargs)

    @staticmethod
    def _default_collator(tokenizer: Any, args: GKDConfig) -> Callable[[list[Any]], dict[str, Any]]:
        """Collator used when none is passed (hook: GOLD's also carries the texts for the teacher's tokenizer)."""
        return DataCollatorForChatML(tokenizer=tokenizer, max_length=args.max_length)

    @staticmethod
    def _sampling_settings(args: GKDConfig) -> dict[str, Any]:
        """Length and filters of the generations (hook: GOLD reads `max_completion_length`, `top_p`, `top_k`)."""
        return {"max_new_tokens": args.max_new_tokens, "top_k": 0, "top_p": 1.0}

    def _build_generation_config(self, args: GKDConfig, tokenizer: Any) -> GenerationConfig:
        """Sampling settings of the on-policy and sequence-level generations."""
        return GenerationConfig(
            **self._sampling_settings(args),
            temperature=args.temperature,
            do_sample=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )

    def _divergence_temperature(self) -> float:
        """Temperature dividing both models' logits in the divergence (hook: GKD uses 1, GOLD its `temperature`)."""
        return 1.0

    @staticmethod
    def _vocab_size(model: nn.Module) -> int | None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and getattr(head, "weight", None) is not None:
            return int(head.weight.shape[0])
        return getattr(getattr(model, "config", None), "vocab_size", None)

    def _check_same_vocabulary(
        self, student: nn.Module, teacher: nn.Module, tokenizer: Any, teacher_arg: Any, args: GKDConfig
    ) -> None:
        """The divergence compares distributions entry by entry, so both models must index the same tokens."""
        student_size, teacher_size = self._vocab_size(student), self._vocab_size(teacher)
        hint = (
            "GKD compares the two next-token distributions position by position and token by token, so the teacher "
            "must use the student's tokenizer. Use a teacher built on the student's tokenizer; distilling across "
            "tokenizers needs a cross-tokenizer method (TRL's GOLD), which GKD is not."
        )
        if student_size is not None and teacher_size is not None and student_size != teacher_size:
            raise ValueError(
                f"The teacher's vocabulary has {teacher_size} entries but the student's has {student_size}. {hint}"
            )
        teacher_path = teacher_arg if isinstance(teacher_arg, str) else args.teacher_model_name_or_path
        if teacher_arg is not None and not isinstance(teacher_arg, str):
            teacher_path = None
        if teacher_path is None:
            return
        from transformers import AutoTokenizer

        tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
        if os.path.isdir(teacher_path) and not any(
            os.path.isfile(os.path.join(teacher_path, name)) for name in tokenizer_files
        ):
            return  # weights only: the sizes were all there was to check
        try:
            teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_path, trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError):
            return  # no tokenizer next to the teacher's weights: only the sizes can be checked
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"The teacher's tokenizer ({teacher_path}) differs from the student's. {hint}")

    @staticmethod
    def _eos_token_ids_of(model: nn.Module, tokenizer: Any) -> list[int]:
        ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if extra is not None:
            ids.extend([extra] if isinstance(extra, int) else list(extra))
        return list(dict.fromkeys(ids))

    def _check_skipped_dataset(self, dataset: Any, name: str) -> None:
        """The collator tokenizes raw conversations: no `input_ids` column is needed."""

    # ------------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------------
    # TRL exposes the loss as a static method; it is the shared chunked implementation.
    generalized_jsd_loss = staticmethod(generalized_jsd_loss)

    @staticmethod
    @torch.no_grad()
    def generate_on_policy_outputs(
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        generation_config: GenerationConfig,
        pad_token_id: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample a completion for each prompt of the batch with `model` (an unwrapped causal LM).

        A completion ends at its first end-of-sequence token: `generation_config.eos_token_id` (the model's own
        `generation_config` when unset, as `generate` reads it), or `pad_token_id` (or `generation_config`'s) when no
        end-of-sequence token is known.

        Args:
            model: The model to sample from.
            inputs: A batch of [`DataCollatorForChatML`] with left-padded `prompts` and `prompt_attention_mask`.
            generation_config: Sampling settings.
            pad_token_id: Padding id marking the end of a completion when no end-of-sequence token is set (older
                TRL releases took it as a fourth argument; TRL 1.16 takes three).

        Returns:
            `(input_ids, attention_mask, labels)` of prompt + completion: the prompt and everything after a
            completion's first end-of-sequence token get label -100, and attention 0 after it.
        """
        prompts, prompt_mask = inputs["prompts"], inputs["prompt_attention_mask"]
        sequences = model.generate(input_ids=prompts, attention_mask=prompt_mask, generation_config=generation_config)
        completion = sequences[:, prompts.shape[1] :]
        end_ids = generation_config.eos_token_id
        if end_ids is None:
            end_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if end_ids is None:
            end_ids = pad_token_id if pad_token_id is not None else generation_config.pad_token_id
        end_ids = [] if end_ids is None else [end_ids] if isinstance(end_ids, int) else list(end_ids)
        completion_mask, _ = completion_mask_from_ids(completion, end_ids)
        attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
        labels = torch.full_like(sequences, -100)
        labels[:, prompts.shape[1] :] = completion.masked_fill(completion_mask == 0, -100)
        return sequences, attention_mask, labels

    @staticmethod
    def vllm_on_policy_outputs(
        vllm_generation: Any,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        end_ids: list[int],
        pad_token_id: int,
        weights_version: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample a completion for each prompt of the batch with vLLM ([`~trl.generation.VLLMGeneration`]).

        Args:
            vllm_generation: The generation engine (server client or colocated engine).
            model: The accelerator-prepared policy its weights are pushed from when stale.
            inputs: A batch with left-padded `prompts` and `prompt_attention_mask`.
            end_ids: End-of-sequence ids closing a completion (the pad id when empty).
            pad_token_id: Padding id.
            weights_version: The policy's weights identifier; a new value triggers a push.

        Returns:
            `(input_ids, attention_mask, labels, sampling_logprobs)` of prompt + completion, as
            [`generate_on_policy_outputs`] lays them out; `sampling_logprobs` holds the sampler's log-probability of each
            completion token at its position in `input_ids` (0 on the prompt and after the completion).
        """
        prompts, prompt_mask = inputs["prompts"], inputs["prompt_attention_mask"]
        prompt_lists = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask, strict=True)]
        output = vllm_generation.generate(prompt_lists, model=model, weights_version=weights_version)
        completions = pad(
            [torch.tensor(ids, dtype=torch.long) for ids in output["completion_ids"]], padding_value=pad_token_id
        ).to(prompts.device)
        logprobs = pad([torch.tensor(lps, dtype=torch.float32) for lps in output["logprobs"]], padding_value=0.0).to(
            prompts.device
        )[:, : completions.shape[1]]
        completion_mask, _ = completion_mask_from_ids(completions, end_ids or [pad_token_id])
        input_ids = torch.cat([prompts, completions], dim=1)
        labels = torch.full_like(input_ids, -100)
        labels[:, prompts.shape[1] :] = completions.masked_fill(completion_mask == 0, -100)
        attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
        sampling = torch.zeros(input_ids.shape, dtype=torch.float32, device=prompts.device)
        sampling[:, prompts.shape[1] : prompts.shape[1] + logprobs.shape[1]] = logprobs * completion_mask[
            :, : logprobs.shape[1]
        ].to(logprobs.dtype)
        return input_ids, attention_mask, labels, sampling

    def _replace_completions(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Replace the batch's completions, in place, by samples from `model` (student or teacher).

        In place because the training loop counts the step's FLOPs from its batch dict after `training_step`: the
        count then reflects the sequences actually trained on (as in TRL)."""
        with (
            unwrap_model_for_generation(
                model, self.accelerator, gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
            ) as unwrapped,
            small_row_linear(unwrapped),
        ):
            # TRL's three-argument call, so that a subclass overriding it with TRL's signature is used as is.
            input_ids, attention_mask, labels = self.generate_on_policy_outputs(
                unwrapped, inputs, self.generation_config
            )
        inputs.update(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return inputs

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        # One draw per batch, as TRL does, so the on-policy batches are the same for the same seed.
        if random.random() < self.lmbda:
            inputs = self._replace_completions(model, inputs)
        elif self.seq_kd:
            inputs = self._replace_completions(self.teacher_model, inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: int | torch.Tensor | None = None,
    ):
        # Position t predicts token t + 1: only positions where some row has a completion token need logits.
        shift_labels = inputs["labels"][:, 1:]
        forward_kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        positions = None
        if self._forward_accepts_logits_to_keep and self._teacher_accepts_logits_to_keep and not return_outputs:
            positions = (shift_labels != -100).any(dim=0).nonzero().squeeze(-1)
            forward_kwargs["logits_to_keep"] = positions
        outputs = model(**forward_kwargs, use_cache=False)
        with torch.no_grad():
            teacher_logits = self.teacher_model(**forward_kwargs, use_cache=False).logits
        if positions is None:
            student_logits, teacher_logits, targets = outputs.logits[:, :-1], teacher_logits[:, :-1], shift_labels
        else:
            student_logits, targets = outputs.logits, shift_labels[:, positions]
        in_training = self._mode == "train"
        loss = generalized_jsd_loss(
            student_logits,
            teacher_logits,
            labels=targets,
            beta=self.beta,
            temperature=self._divergence_temperature(),
            num_items_in_batch=num_items_in_batch if in_training else None,
        )
        if in_training and num_items_in_batch is not None:
            loss = self._scale_for_token_average(loss, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss
