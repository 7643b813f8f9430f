"""On-policy distillation with the teacher behind a vLLM server.

The stable [`~trl.DistillationTrainer`] does the rollouts (the student samples completions on-policy), buffering and
logging; this trainer only replaces the teacher: instead of a local model it is a vLLM server that scores each
prompt + completion and returns, per completion position, its top-k log-probabilities and the log-probability of the
realised token. The divergence is therefore taken on a sparse support
([`~trl.trainer.utils.sparse_divergence`]):

- `beta = 0`: forward KL over the teacher's top-k tokens (plus a tail bucket, or renormalised);
- `beta > 0`: the top-1 sparse support `{teacher top-1, sampled token}` (the sampled token alone at `beta = 1`).
"""

from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from ...generation import vllm_client
from ...trainer.distillation_trainer import DistillationTrainer
from ...trainer.utils.sparse_divergence import (
    build_teacher_request_inputs,
    server_teacher_support,
    sparse_support_divergence,
)
from .server_distillation_config import ServerDistillationConfig


__all__ = ["ServerDistillationTrainer", "build_teacher_request_inputs"]


class ServerDistillationTrainer(DistillationTrainer):
    r"""[`~trl.DistillationTrainer`] whose teacher is a vLLM server returning top-k log-probabilities.

    The loss of a micro-batch is the mean over its completion tokens of the sparse-support divergence between the
    student's distribution (at `temperature`) and the teacher's reported log-probabilities; the default configuration
    (`beta=1`, `loss_top_k=1`, tail bucket) is the reverse KL on the sampled token's support.

    Example:

    ```python
    # trl vllm-serve --model <teacher> --port 8000   (in another shell)
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    args = ServerDistillationConfig(output_dir="server-distill", teacher_model_server_url="http://localhost:8000")
    trainer = ServerDistillationTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", args=args, train_dataset=dataset)
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Student to train (a path, hub id or instance), as for [`~trl.DistillationTrainer`].
        args ([`ServerDistillationConfig`] or `None`, defaults to `None`):
            Configuration; `None` builds `ServerDistillationConfig(output_dir="tmp_server_distillation")`, which fails
            because `teacher_model_server_url` is required.
        train_dataset, eval_dataset, processing_class, callbacks, optimizers, quantization_config, peft_config:
            As for [`~trl.DistillationTrainer`].

    The teacher must use the student's tokenizer: the server scores the student's token ids as they are.
    """

    _tag_names = ["trl", "server-distillation"]
    _name = "Server Distillation"
    _config_class = ServerDistillationConfig

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        args: ServerDistillationConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ):
        if args is None:
            args = ServerDistillationConfig(output_dir="tmp_server_distillation")
        super().__init__(
            model=model,
            teacher_model=None,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.teacher_client = vllm_client.VLLMClient(
            base_url=self.args.teacher_model_server_url, connection_timeout=60.0
        )

    def _require_teacher(self) -> None:
        pass  # the teacher is the server, reached (and checked) when the trainer is built

    def _teacher_support(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ask the server to score the micro-batch; the support ids, teacher log-probs and validity, `(B, T, S)`."""
        input_ids, attention_mask, _ = self._sequence_inputs(inputs)
        sequences, prompt_lengths, _ = build_teacher_request_inputs(
            input_ids, attention_mask, prompt_attention_mask=inputs["prompt_mask"]
        )
        result = self.teacher_client.get_sequence_logprobs(
            sequences, prompt_lengths, top_logprobs=self.args.loss_top_k, temperature=self.temperature
        )
        return server_teacher_support(result, inputs["completion_ids"], self._loss_mask(inputs).bool(), self.beta)

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        mask = self._loss_mask(inputs).bool()
        student_logits, outputs = self._completion_logits(model, inputs)
        student_log_probs = (student_logits.float() / self.temperature).log_softmax(dim=-1)
        support_ids, teacher_log_probs, valid = self._teacher_support(inputs)
        per_token = sparse_support_divergence(
            student_log_probs, support_ids, teacher_log_probs, valid, self.beta, add_tail=self.args.loss_add_tail
        )
        per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
        # Mean over this micro-batch's completion tokens (not the step's token count), then the accumulation steps.
        loss = per_token.sum() / mask.sum().clamp(min=1) / self._gradient_accumulation_divisor()
        return self._add_aux_loss(loss, getattr(outputs, "aux_loss", None))
