"""On-policy knowledge distillation trainer.

The student samples one completion per prompt (transformers `generate`, vLLM, or multi-turn tool calling: the shared
online rollout machinery of `online_base.py`), and is trained to match a frozen teacher's next-token distribution at
every completion position with the generalized Jensen-Shannon divergence of GKD (Agarwal et al., 2024). What differs
from the reward-driven online trainers: no reward functions, advantages or reference model; the loss runs both models
on the rollout and compares their distributions chunk by chunk ([`per_token_generalized_jsd`]).
"""

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from ..kernels.log_softmax import selective_log_softmax_and_entropy
from ..models.peft import BF16_ADAPTERS
from .distillation_config import DistillationConfig
from .fast_paths.last_layer_selection import last_layer_before_end
from .online_base import _OnlineTrainer
from .online_math import masked_mean, positions_from_mask
from .online_rewards import _NoRewardsMixin
from .tool_calling import _ToolCallingMixin
from .utils import create_model_from_path, disable_dropout_in_model
from .utils.divergence import frozen_head_generalized_jsd, head_is_frozen, per_token_generalized_jsd
from .utils.logprobs import (
    capture_lm_head_inputs,
    fusable_lm_head,
    model_accepts_argument,
    small_student_logits,
)


def _vocab_size(model: nn.Module) -> int | None:
    """The vocabulary size a causal LM predicts over (from its text config), or None when it cannot be told."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "vocab_size", None)


class DistillationTrainer(_NoRewardsMixin, _ToolCallingMixin, _OnlineTrainer):
    r"""Trainer for on-policy knowledge distillation (GKD with on-policy student data).

    For each prompt the student generates a completion; the loss of a batch is the generalized JSD between the
    student's and the teacher's next-token distributions at temperature `T`, summed over the completion tokens and
    divided by their number (over the whole optimizer step):

    $$
    \mathcal{L} = \frac{1}{N} \sum_{i,t} D_{\beta}\big(p_T(\cdot \mid x_i, y_{i,<t}) \,\|\, p_S(\cdot \mid x_i,
    y_{i,<t})\big), \quad y_i \sim p_S(\cdot \mid x_i).
    $$

    Example:

    ```python
    from trl import DistillationConfig, DistillationTrainer
    from trl.assets import get_model_path, load_test_dataset

    trainer = DistillationTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        teacher_model=get_model_path("small-Qwen2ForCausalLM"),
        args=DistillationConfig(output_dir="distill-out", per_device_train_batch_size=4, max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Student to train: a path or hub id (loaded with `args.model_init_kwargs`; float32 unless a dtype is
            given) or an instantiated causal language model.
        teacher_model (`str`, `PreTrainedModel` or `None`, defaults to `None`):
            Frozen teacher: a path or hub id (loaded with `args.teacher_model_init_kwargs` and
            `args.teacher_model_revision`) or an instantiated causal LM. `None` loads
            `args.teacher_model_name_or_path`. It must predict over the student's vocabulary (same `vocab_size`).
        args (`DistillationConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `DistillationConfig(f"{model_name}-Distillation")`.
        train_dataset (`Dataset` or `IterableDataset`):
            Prompt-only data: a `prompt` column (text, or a list of chat messages rendered with the chat template).
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation prompts; `evaluate()` generates completions for them and reports the divergence as `eval_loss`.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer of the student (and teacher); loaded from the student's path (left padding) when omitted.
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        quantization_config (`BitsAndBytesConfig` or `None`, defaults to `None`):
            Quantization of the student when `model` is a string.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration: only the student's adapters are trained.
        tools (`list[Callable]` or `None`, defaults to `None`):
            Functions the student may call during its rollouts, as for [`GRPOTrainer`]: tool calls are executed and
            their results appended (attended to, outside the loss), up to `args.max_tool_calling_iterations` rounds.
            Needs conversational prompts and a chat template that supports tool calling.
    """

    _tag_names = ["trl", "distillation"]
    _name = "Distillation"
    _quantized_base = BF16_ADAPTERS
    _template_file = "lm_model_card.md"
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
    _config_class = DistillationConfig
    _undefined_metric_value = None
    # The teacher is the signal: no reward functions, no advantages, no reward columns in the completions table.
    _logs_rewards = False
    # One completion per prompt, then a teacher pass: a second backward pass would cost ~1.5x the step (24 layers).
    _clips_in_two_backward_passes = False

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        teacher_model: "str | PreTrainedModel | nn.Module | None" = None,
        args: DistillationConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable] | None = None,
    ):
        if args is None:
            args = self._default_args(DistillationConfig, model)
        # The teacher is loaded first, so that a bad teacher path fails before the student is set up.
        # The same path twice loads two models; only one module object for both is a mistake.
        if isinstance(teacher_model, nn.Module) and teacher_model is model:
            raise ValueError(
                "teacher_model is the same object as model; the student is trained and the teacher must stay frozen. "
                "Pass a separate teacher (a path or another model instance)."
            )
        teacher = self._load_teacher(teacher_model, args)
        tool_setup = self._prepare_tool_setup(tools, None, None, args, train_dataset, None)
        super().__init__(
            model=model,
            reward_funcs=None,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self._init_tools(tool_setup)
        self.beta = self.args.beta
        self.temperature = self.args.temperature
        if teacher is not None:
            self._check_vocabularies(self.model, teacher)
            if self.args.disable_dropout:
                disable_dropout_in_model(teacher)
            teacher = self._prepare_ref_model(self._freeze(teacher))
        self.teacher_model = teacher

    # ------------------------------------------------------------------------------------------------------------
    # Teacher
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _load_teacher(teacher_model: Any, args: DistillationConfig) -> nn.Module | None:
        """The teacher instance: `teacher_model` as given, or loaded from it (or `args.teacher_model_name_or_path`)
        with `args.teacher_model_init_kwargs`, `args.teacher_model_revision` and `args.trust_remote_code`."""
        if teacher_model is None:
            teacher_model = args.teacher_model_name_or_path
        if teacher_model is None:
            return None
        init_kwargs = dict(args.teacher_model_init_kwargs or {})
        if not isinstance(teacher_model, str):
            if init_kwargs or args.teacher_model_revision is not None:
                warnings.warn(
                    "args.teacher_model_init_kwargs and args.teacher_model_revision are only used when the teacher is "
                    "given as a string (a path or hub id); the teacher you passed is already instantiated, so they are "
                    "ignored.",
                    UserWarning,
                    stacklevel=3,
                )
            return teacher_model
        if args.teacher_model_revision is not None:
            init_kwargs.setdefault("revision", args.teacher_model_revision)
        if args.trust_remote_code:
            init_kwargs.setdefault("trust_remote_code", True)
        return create_model_from_path(teacher_model, **init_kwargs)

    @staticmethod
    def _check_vocabularies(student: nn.Module, teacher: nn.Module) -> None:
        student_size, teacher_size = _vocab_size(student), _vocab_size(teacher)
        if student_size is not None and teacher_size is not None and student_size != teacher_size:
            raise ValueError(
                f"The student model has vocab_size {student_size} but the teacher model has vocab_size "
                f"{teacher_size}. Distillation compares the teacher's full next-token distribution, which requires a "
                "shared vocabulary. Use a teacher with the same vocab_size, or GOLD for cross-tokenizer distillation. "
                "(The teacher should also share the student's tokenizer, or resize one model's embeddings to match; "
                "GOLD lives in trl.experimental.gold.)"
            )

    def _require_teacher(self) -> None:
        if self.teacher_model is None:
            raise ValueError(
                "DistillationTrainer has no teacher: pass teacher_model=<path or model> to the trainer, or set "
                "teacher_model_name_or_path in the DistillationConfig."
            )

    def get_train_dataloader(self):
        self._require_teacher()  # fail before the first rollout, not inside the loss
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None):
        self._require_teacher()
        return super().get_eval_dataloader(eval_dataset)

    # ------------------------------------------------------------------------------------------------------------
    # Hooks of the online core: no rewards, advantages or reference model
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def _rollout_settings(cls, args: DistillationConfig) -> dict[str, Any]:
        return {
            "num_generations": 1,
            "num_generations_eval": 1,
            "max_completion_length": args.max_completion_length,
            "chat_template_kwargs": dict(args.chat_template_kwargs or {}),
        }

    _generate_outputs = ("prompt_ids", "completion_ids", "tool_mask", "images", "tool_images")
    _uncalled_trl_hooks = {
        "_tool_call_loop": "from _generate for each tool-calling rollout",
        "_get_tool_suffix_ids": "from _tool_call_loop to tokenize the text around tool results",
    }

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        """TRL's hook: one student completion per row of `prompt_ids` (unpadded ids); returns the completion ids."""
        return self._sample_completions(prompt_ids, images, multimodal_fields)[0]

    @staticmethod
    def _needs_ref_model(args: Any) -> bool:
        return False  # `beta` here interpolates the divergence; it is not a KL coefficient to a reference

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    def _completion_logits(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        """Logits predicting each completion token, `(B, T, V)`, and the model outputs.

        Only the last `T + 1` positions go through the LM head (the prompt's logits are never computed) when the
        model accepts `logits_to_keep`; the last decoder layer then runs at the `T` positions read
        ([`last_layer_before_end`]).
        """
        input_ids, attention_mask, position_ids = self._sequence_inputs(inputs)
        completion_length = inputs["completion_ids"].shape[1]
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        kwargs["use_cache"] = False
        selection = contextlib.nullcontext()
        if model_accepts_argument(model, "logits_to_keep"):
            kwargs["logits_to_keep"] = completion_length + 1
            selection = last_layer_before_end(model, input_ids, completion_length)
        with selection:
            outputs = model(**kwargs)
        # Position t predicts token t + 1: the completion's T tokens are predicted from the T positions before them.
        logits = outputs.logits[:, -(completion_length + 1) : -1]
        return logits, outputs

    def _get_last_hidden_state(
        self,
        unwrapped_model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """TRL's hook: the final hidden states `(B, logits_to_keep, H)` from which the model's LM head predicts the
        last `logits_to_keep` tokens of each row (the last position, which predicts nothing, dropped).

        Called for the student and, without gradients, the teacher when both LM heads are plain linear layers
        ([`fusable_lm_head`]): the head runs inside the divergence. The forward pass stops before the head
        ([`capture_lm_head_inputs`]) and runs the last decoder layer only at the positions read
        ([`last_layer_before_end`]); positions count from each row's first attended token."""
        head = fusable_lm_head(unwrapped_model)
        if head is None:
            raise ValueError(
                f"{type(unwrapped_model).__name__}'s LM head is not a plain linear layer (a soft cap, a logit scale, a "
                "hook or a wrapper on it): its hidden states do not give its logits through the head's weight."
            )
        position_ids = positions_from_mask(attention_mask)
        multimodal_inputs = {
            "pixel_values": pixel_values,
            "image_grid_thw": image_grid_thw,
            "pixel_attention_mask": pixel_attention_mask,
            "spatial_shapes": spatial_shapes,
            "image_sizes": image_sizes,
            "token_type_ids": token_type_ids,
            "mm_token_type_ids": mm_token_type_ids,
            "image_position_ids": image_position_ids,
        }
        kwargs = {key: value for key, value in multimodal_inputs.items() if value is not None}
        kwargs.update(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        kwargs["logits_to_keep"] = logits_to_keep + 1
        with last_layer_before_end(unwrapped_model, input_ids, logits_to_keep), capture_lm_head_inputs(head) as seen:
            unwrapped_model(**kwargs)
        return seen[-1][:, -(logits_to_keep + 1) : -1]

    def _hidden_state_path(self, model: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
        """The student's and the teacher's LM heads when the loss can run from both models' hidden states (plain
        linear heads, a model that takes `logits_to_keep`, no router loss to collect from the outputs); else None."""
        if self._aux_loss_enabled or not model_accepts_argument(model, "logits_to_keep"):
            return None
        if not model_accepts_argument(self.teacher_model, "logits_to_keep"):
            return None
        heads = fusable_lm_head(model), fusable_lm_head(self.teacher_model)
        return heads if None not in heads else None

    def _warn_hidden_state_hook_unused(self, model: nn.Module) -> None:
        """Once per run: a subclass's `_get_last_hidden_state` is not called when the loss runs from logits."""
        overridden = type(self)._get_last_hidden_state is not DistillationTrainer._get_last_hidden_state
        if not overridden or getattr(self, "_warned_hidden_state_hook", False):
            return
        self._warned_hidden_state_hook = True
        reasons = []
        if self._aux_loss_enabled:
            reasons.append("the router loss is collected from the model's outputs")
        for name, candidate in (("student", model), ("teacher", self.teacher_model)):
            if not model_accepts_argument(candidate, "logits_to_keep"):
                reasons.append(f"the {name} model's forward takes no `logits_to_keep`")
            elif fusable_lm_head(candidate) is None:
                reasons.append(
                    f"the {name}'s LM head is not a plain linear layer (soft cap, logit scale, hook, wrapper)"
                )
        warnings.warn(
            f"{type(self).__name__} overrides _get_last_hidden_state, but this run computes the loss from the models' "
            f"logits, so the override is not called: {'; '.join(reasons)}.",
            UserWarning,
            stacklevel=3,
        )

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        mask = self._loss_mask(inputs).bool()
        heads = self._hidden_state_path(model)
        if heads is not None:
            per_token, entropy, aux_loss = self._divergence_from_hidden_states(model, inputs, mask, *heads)
        else:
            self._warn_hidden_state_hook_unused(model)
            per_token, entropy, aux_loss = self._divergence_from_logits(model, inputs, mask)
        # Token mean over the whole optimizer step on every process (`num_items_in_batch`); DDP then averages the
        # processes' gradients, hence the factor of the number of processes.
        normaliser = torch.as_tensor(self._step_token_count(inputs), dtype=per_token.dtype, device=per_token.device)
        normaliser = (normaliser / self.accelerator.num_processes).clamp(min=1.0)
        loss = per_token.sum() / normaliser
        loss = self._add_aux_loss(loss, aux_loss)
        self._record_metric("entropy", masked_mean(entropy.float(), mask.float()))
        return loss

    def _divergence_from_hidden_states(
        self, model: nn.Module, inputs: dict[str, Any], mask: torch.Tensor, head: nn.Linear, teacher_head: nn.Linear
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Per-token divergence and student entropy `(B, T)`, from both models' hidden states at the completion
        positions (TRL's `_get_last_hidden_state`), each model's head applied to all of them at once.

        (`ChunkedDivergenceFunction`, which projects a block of rows at a time, holds less: at 4 x 256 completion
        tokens and Qwen2.5's vocabulary 1.4 instead of 2.1 GB of working memory, but 3.4x the loss's CPU time.)"""
        ids, attention_mask, _ = self._sequence_inputs(inputs)
        width = inputs["completion_ids"].shape[1]
        with torch.no_grad():
            teacher_hidden = self._get_last_hidden_state(self.teacher_model, ids, attention_mask, width)
            teacher_logits = F.linear(teacher_hidden, teacher_head.weight, teacher_head.bias)
        # The teacher ran first: its working memory is gone while the student's activations are held, and what the
        # loss holds next to them is declared (gradient checkpointing may keep the last layers within it).
        with small_student_logits(model, teacher_logits):
            hidden = self._get_last_hidden_state(model, ids, attention_mask, width)
        if head_is_frozen(head):  # PEFT: the gradient is computed in the forward, no logits kept for the backward
            per_token, entropy = frozen_head_generalized_jsd(
                hidden, head, teacher_logits, mask, beta=self.beta, temperature=self.temperature
            )
            return per_token, entropy, None
        logits = F.linear(hidden, head.weight, head.bias)
        per_token = per_token_generalized_jsd(
            logits, teacher_logits, mask, beta=self.beta, temperature=self.temperature
        )
        return per_token, self._entropy(logits, inputs, mask), None

    def _divergence_from_logits(
        self, model: nn.Module, inputs: dict[str, Any], mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per-token divergence and student entropy `(B, T)`, and the router loss, from both models' logits."""
        # Teacher forward once per micro-batch, without gradients; its logits cover the completion positions only. It
        # runs first, so that its working memory is gone while the student's activations are held.
        with torch.no_grad():
            teacher_logits, _ = self._completion_logits(self.teacher_model, inputs)
        with small_student_logits(model, teacher_logits):
            student_logits, outputs = self._completion_logits(model, inputs)
        per_token = per_token_generalized_jsd(
            student_logits, teacher_logits, mask, beta=self.beta, temperature=self.temperature
        )
        return per_token, self._entropy(student_logits, inputs, mask), getattr(outputs, "aux_loss", None)

    def _entropy(self, logits: torch.Tensor, inputs: dict[str, Any], mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            _, entropy = selective_log_softmax_and_entropy(
                logits.detach(), inputs["completion_ids"], temperature=self.temperature, row_mask=mask
            )
        return entropy
