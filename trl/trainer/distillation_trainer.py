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
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from ..kernels.log_softmax import selective_log_softmax_and_entropy
from .distillation_config import DistillationConfig
from .fast_paths.last_layer_selection import last_layer_before_end
from .online_base import _OnlineTrainer
from .online_math import masked_mean
from .online_rewards import _NoRewardsMixin
from .tool_calling import _ToolCallingMixin
from .utils import create_model_from_path, disable_dropout_in_model
from .utils.divergence import per_token_generalized_jsd
from .utils.logprobs import model_accepts_argument, small_student_logits


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
        "_get_last_hidden_state": "from _compute_loss for the student's and the teacher's hidden states",
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

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        mask = self._loss_mask(inputs).bool()
        # Teacher forward once per micro-batch, without gradients; its logits cover the completion positions only. It
        # runs first, so that its working memory is gone while the student's activations are held.
        with torch.no_grad():
            teacher_logits, _ = self._completion_logits(self.teacher_model, inputs)
        with small_student_logits(model, teacher_logits):
            student_logits, outputs = self._completion_logits(model, inputs)
        per_token = per_token_generalized_jsd(
            student_logits, teacher_logits, mask, beta=self.beta, temperature=self.temperature
        )
        # Token mean over the whole optimizer step on every process (`num_items_in_batch`); DDP then averages the
        # processes' gradients, hence the factor of the number of processes.
        normaliser = torch.as_tensor(self._step_token_count(inputs), dtype=per_token.dtype, device=per_token.device)
        normaliser = (normaliser / self.accelerator.num_processes).clamp(min=1.0)
        loss = per_token.sum() / normaliser
        loss = self._add_aux_loss(loss, getattr(outputs, "aux_loss", None))

        with torch.no_grad():
            _, entropy = selective_log_softmax_and_entropy(
                student_logits.detach(), inputs["completion_ids"], temperature=self.temperature, row_mask=mask
            )
            self._record_metric("entropy", masked_mean(entropy.float(), mask.float()))
        return loss
