"""SDFT: self-distillation fine-tuning.

The student samples completions of a prompt; the teacher is the same model (or a frozen / EMA copy of it) reading the
prompt together with privileged context, e.g. a demonstration or the answer. The student learns to match the
teacher's next-token distribution on its own completions, so that it behaves as if it had seen the context
(SDFT, https://huggingface.co/papers/2601.19897). The loss and the teacher are shared with SDPO.
"""

from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from ...trainer.online_rewards import _NoRewardsMixin
from .._self_distillation.prompts import message_text, with_teacher_text
from .._self_distillation.teacher_server import build_teacher_request_inputs  # noqa: F401 (TRL module name)
from .._self_distillation.trainer import _SelfDistillationTrainer
from .sdft_config import SDFTConfig


def _context_text(privileged_context: Any) -> str:
    """The privileged context as text: a string as is, a list of messages as their text parts joined by newlines."""
    if privileged_context is None:
        raise ValueError("SDFT needs a non-null `privileged_context` for every row (the teacher's extra context).")
    if isinstance(privileged_context, str):
        return privileged_context
    parts = []
    for message in privileged_context:
        content = message.get("content") if isinstance(message, dict) else message
        if isinstance(content, list):
            parts.extend(part.get("text", "") for part in content if part.get("type", "text") == "text")
        elif content is not None:
            parts.append(str(content))
    return "\n".join(parts)


def teacher_prompt(prompt: Any, privileged_context: Any, template: str) -> Any:
    """The teacher's prompt: `template` filled with the prompt text and the context.

    A conversational prompt keeps its earlier messages; its last user message is replaced by a user message holding
    the filled template.
    """
    context = _context_text(privileged_context)
    text = prompt if isinstance(prompt, str) else message_text(prompt[-1]["content"])
    return with_teacher_text(prompt, template.format(prompt=text, privileged_context=context))


class SDFTTrainer(_NoRewardsMixin, _SelfDistillationTrainer):
    """Self-distillation fine-tuning: the model given privileged context teaches the model without it.

    Example:

    ```python
    from datasets import Dataset

    from trl.assets import get_model_path
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    dataset = Dataset.from_dict({"prompt": ["The capital of France is"], "privileged_context": ["Paris"]})
    trainer = SDFTTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=SDFTConfig(output_dir="sdft-out", num_generations=2, per_device_train_batch_size=2, max_steps=2),
        train_dataset=dataset,
    )
    trainer.train()
    ```

    Args:
        model: The student: a path or an instantiated causal LM.
        args: An [`SDFTConfig`].
        train_dataset: Rows with `prompt` (text or a conversation ending with a user turn) and `privileged_context`
            (text, or messages whose text parts are joined). IterableDatasets are not supported.
        eval_dataset: Same columns, for `evaluate()`.
        processing_class: Tokenizer; loaded from the model's path when omitted.
        callbacks: Extra callbacks.
        optimizers: Optimizer and scheduler to use instead of the defaults.
        peft_config: Adapter configuration; with it the `"base"` teacher is the model with adapters disabled.
    """

    _tag_names = ["trl", "sdft"]
    _name = "SDFT"
    _paper = {
        "title": "Self-Distillation Enables Continual Learning",
        "id": "2601.19897",
        "citation": "@article{sdft2026,\n    title = {{Self-Distillation Enables Continual Learning}},\n"
        "    year = 2026,\n    eprint = {arXiv:2601.19897}\n}",
    }
    _config_class = SDFTConfig
    _loss_name = "sdft"

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        args: SDFTConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        peft_config: Any = None,
    ):
        super().__init__(
            model,
            args,
            train_dataset,
            eval_dataset,
            peft_config,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "privileged_context"]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        template = self.args.teacher_prompt_template
        teacher_prompts = [teacher_prompt(row["prompt"], row.get("privileged_context"), template) for row in inputs]
        if self.args.generate_from_teacher:
            self._announce_generation_prompts(teacher_prompts)
            batch = super()._generate_and_score_completions(
                [{**row, "prompt": prompt} for row, prompt in zip(inputs, teacher_prompts)]
            )
            batch["prompt_ids"], batch["prompt_mask"] = self._padded_prompts(
                [row["prompt"] for row in inputs], self.args.max_prompt_length
            )
        else:
            self._announce_generation_prompts([row["prompt"] for row in inputs])
            batch = super()._generate_and_score_completions(inputs)
        batch["teacher_prompt_ids"], batch["teacher_prompt_mask"] = self._padded_prompts(
            teacher_prompts, self.args.max_prompt_length
        )
        self._announce_batch_prepared(batch)
        return batch

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        mask = self._loss_mask(inputs).clone()
        skip = self.args.num_loss_tokens_to_skip
        if skip > 0:
            mask[:, :skip] = 0
        loss, _ = self._distillation_loss(model, inputs, mask)
        self._record_distillation_loss(loss)
        return loss / self._gradient_accumulation_divisor()
