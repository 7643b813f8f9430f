"""SSD: simple self-distillation.

The model samples one completion per prompt (transformers' `generate` or vLLM, as in the online trainers) and is
fine-tuned with cross-entropy on its own completions, those that are empty or a short single line left out
(Zhang et al., 2026, https://huggingface.co/papers/2604.01193). Everything but the filter and the loss is the online
core's: prompt sampling, generation rounds buffered over `steps_per_generation` micro-steps, `num_iterations`.
"""

from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback

from ...trainer.online_base import _OnlineTrainer
from ...trainer.online_rewards import _NoRewardsMixin
from .._self_distillation.trainer import keep_last_prompt_tokens
from .ssd_config import SSDConfig


# A single-line completion shorter than this (stripped) is a stub, not a solution.
MIN_SINGLE_LINE_CHARS = 10


def is_substantive(text: str) -> bool:
    """Whether a decoded completion is kept by `filter_empty`: non-empty once stripped, and either spanning several
    lines or at least `MIN_SINGLE_LINE_CHARS` characters long."""
    stripped = text.strip()
    return bool(stripped) and ("\n" in stripped or len(stripped) >= MIN_SINGLE_LINE_CHARS)


def masked_token_mean_nll(per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the sampled tokens: `-sum(mask * logp) / sum(mask)`; a zero attached to the graph when the
    mask is empty."""
    mask = mask.to(per_token_logps.dtype)
    total = mask.sum()
    if total == 0:
        return per_token_logps.sum() * 0.0
    return -(per_token_logps * mask).sum() / total


class SSDTrainer(_NoRewardsMixin, _OnlineTrainer):
    """Simple self-distillation: supervised fine-tuning on the model's own sampled completions.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.ssd import SSDConfig, SSDTrainer

    trainer = SSDTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=SSDConfig(output_dir="ssd-out", per_device_train_batch_size=2, max_completion_length=32, max_steps=2),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Args:
        model: Model to train, or a path / hub id loaded with `args.model_init_kwargs`.
        args: An [`SSDConfig`]; `None` gives `SSDConfig("<model name>-SSD")`.
        train_dataset: Rows with a `prompt` column (text, or a conversation ending with a user turn).
        eval_dataset: Same format, for `evaluate()`.
        processing_class: Tokenizer or processor; loaded from the model's path when omitted (left padding).
        callbacks: Extra callbacks.
        optimizers: Optimizer and scheduler to use instead of the defaults.
        peft_config: Adapter configuration to train adapters instead of the whole model.
    """

    _tag_names = ["trl", "ssd"]
    _name = "SSD"
    _paper = {
        "title": "Embarrassingly Simple Self-Distillation Improves Code Generation",
        "id": "2604.01193",
        "citation": """\
@article{zhang2026ssd,
    title        = {{Embarrassingly Simple Self-Distillation Improves Code Generation}},
    author       = {Ruixiang Zhang and Richard He Bai and Huangjie Zheng and Navdeep Jaitly and Ronan Collobert and Yizhe Zhang},
    year         = 2026,
    eprint       = {arXiv:2604.01193}
}""",
    }
    _config_class = SSDConfig
    config_cls = SSDConfig
    _logs_rewards = False
    _logs_step_time = False
    _batch_counts_loss_tokens = False
    _shuffle_rollout_batch = False

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        args: SSDConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        peft_config: Any = None,
    ):
        super().__init__(
            model=model,
            reward_funcs=None,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def _tokenize_prompts(self, prompts: list) -> tuple[list[list[int]], list | None, dict[str, Any]]:
        prompt_ids, images, fields = super()._tokenize_prompts(prompts)
        return keep_last_prompt_tokens(prompt_ids, self.args.max_prompt_length), images, fields

    def _logprob_temperature(self) -> float:
        return 1.0  # the loss scores the completions under the model itself, whatever the sampling temperature

    def _record_rollout_metrics(self, mode, prompt_mask, completion_mask, terminated, lengths, rewards_per_func):
        """Nothing here: SSD records its metrics once the filter has run (see `_generate_and_score_completions`)."""

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        mask = batch["completion_mask"]
        if self.args.filter_empty:
            kept_ids = [ids[row.bool()] for ids, row in zip(batch["completion_ids"], mask)]
            texts = self._tokenizer.batch_decode(kept_ids, skip_special_tokens=True)
            keep = torch.tensor([is_substantive(text) for text in texts], device=mask.device)
            mask = batch["completion_mask"] = mask * keep.unsqueeze(1).to(mask.dtype)
        gather = self.accelerator.gather
        lengths = gather(mask.sum(dim=1).float())
        active = gather((mask.sum(dim=1) > 0).float())
        metrics = self._metrics[self._mode]
        metrics["completions/mean_length"].append(lengths.mean().item())
        metrics["completions/min_length"].append(lengths.min().item())
        metrics["completions/max_length"].append(lengths.max().item())
        metrics["ssd/active_sample_ratio"].append(active.mean().item())
        return batch

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits_to_keep = inputs["completion_ids"].shape[1]
        per_token_logps = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep)[0]
        loss = masked_token_mean_nll(per_token_logps, inputs["completion_mask"])
        self._record_metric("ssd/cross_entropy_loss", loss.detach())
        return loss / self._gradient_accumulation_divisor()
