"""IW-OPD trainer: importance-weighted on-policy distillation (and GKD-style JSD distillation) on conversations.

Data is a `messages` column. Each generation batch (`per_device_train_batch_size * gradient_accumulation_steps` rows)
is collated once and replayed over the accumulation steps, one slice per micro-step; at the start of each optimizer
step every slice is drawn on-policy with probability `lmbda`, and the on-policy slices get completions sampled from the
student. The teacher is a local model or a vLLM server (`trl vllm-serve` or a plain `vllm serve`).
"""

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer_utils import EvalPrediction

from ...generation import vllm_client
from ...models.peft import AS_LOADED
from ...models.utils import disable_dropout_in_model, unwrap_model_for_generation
from ...trainer.base_trainer import _BaseTrainer
from ...trainer.distillation_trainer import DistillationTrainer, _vocab_size
from ...trainer.fast_paths.small_row_linear import small_row_linear
from ...trainer.online_metrics import log_completion_rows
from ...trainer.utils import model_accepts_argument, pad
from ...trainer.utils.divergence import generalized_jsd_loss as _full_vocab_jsd_loss
from ...trainer.utils.logprobs import small_student_logits
from ...trainer.utils.sparse_divergence import (
    build_teacher_request_inputs,
    server_realised_log_probs,
    server_teacher_support,
    sparse_support_divergence,
    top1_sparse_support,
)
from .._generation_batch import _GenerationBatchMixin
from ..gkd.gkd_trainer import GKDTrainer
from .iw_opd_config import IWOPDConfig


__all__ = ["IWOPDTrainer", "build_teacher_request_inputs", "iw_opd_loss"]


@dataclass
class _DistillationCollator:
    """Tokenise `messages` conversations into a left-padded prompt + completion batch.

    The last message is the off-policy completion when it is an assistant turn following at least one other message;
    otherwise the whole conversation is the prompt and the row has no completion. The prompt is rendered with the
    chat template and its generation prompt and keeps its first `max_prompt_length` tokens; the completion is the rest
    of the rendered conversation, keeping its first `max_length - len(prompt)` tokens.

    Returns `input_ids`, `attention_mask`, `labels` (-100 outside the completion), `prompts` and
    `prompt_attention_mask`, all left-padded.
    """

    tokenizer: PreTrainedTokenizerBase
    max_length: int
    max_prompt_length: int
    messages_key: str = "messages"
    ignore_index: int = -100

    def _tokenize(self, example: dict[str, Any]) -> tuple[list[int], list[int]]:
        messages = example.get(self.messages_key)
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                f"Each IW-OPD example needs a non-empty `{self.messages_key}` list of chat messages; got "
                f"{messages!r}. Convert prompt/completion data to a conversation first."
            )
        kwargs = dict(example.get("chat_template_kwargs") or {})
        if example.get("tools") is not None:
            kwargs["tools"] = example["tools"]
        has_completion = len(messages) > 1 and messages[-1].get("role") == "assistant"
        prompt_messages = messages[:-1] if has_completion else messages
        template = self.tokenizer.apply_chat_template
        prompt_text = template(prompt_messages, tokenize=False, add_generation_prompt=True, **kwargs)
        prompt_ids = self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"][: self.max_prompt_length]
        completion_ids: list[int] = []
        if has_completion:
            full_text = template(messages, tokenize=False, **kwargs)
            completion_text = full_text[len(prompt_text) :] if full_text.startswith(prompt_text) else full_text
            completion_ids = self.tokenizer(completion_text, add_special_tokens=False)["input_ids"]
            completion_ids = completion_ids[: max(self.max_length - len(prompt_ids), 0)]
        return prompt_ids, completion_ids

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        pad_id = self.tokenizer.pad_token_id
        sequences, labels, prompts = [], [], []
        for example in examples:
            prompt_ids, completion_ids = self._tokenize(example)
            sequences.append(torch.tensor(prompt_ids + completion_ids, dtype=torch.long))
            labels.append(torch.tensor([self.ignore_index] * len(prompt_ids) + completion_ids, dtype=torch.long))
            prompts.append(torch.tensor(prompt_ids, dtype=torch.long))
        return {
            "input_ids": pad(sequences, pad_id, "left"),
            "attention_mask": pad([torch.ones_like(s) for s in sequences], 0, "left"),
            "labels": pad(labels, self.ignore_index, "left"),
            "prompts": pad(prompts, pad_id, "left"),
            "prompt_attention_mask": pad([torch.ones_like(p) for p in prompts], 0, "left"),
        }


def _completion_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Completion coordinates of a left-padded batch: for each row, the positions predicting its completion tokens.

    Returns `(positions, tokens, mask)`, each `(B, T)` with `T` the longest completion: `positions[b, t]` is the index
    whose logits predict completion token `t` of row `b` (its first label != -100 is token 0), `tokens` the token ids
    (0 where masked) and `mask` the real completion tokens.
    """
    labelled = labels != -100
    lengths = labelled.sum(dim=1)
    width = max(int(lengths.max()) if lengths.numel() else 0, 1)
    starts = torch.where(lengths > 0, labelled.int().argmax(dim=1), torch.zeros_like(lengths))
    offsets = torch.arange(width, device=labels.device)
    mask = offsets[None, :] < lengths[:, None]
    token_index = (starts[:, None] + offsets[None, :]).clamp(max=labels.shape[1] - 1)
    tokens = labels.gather(1, token_index).masked_fill(~mask, 0)
    positions = (token_index - 1).clamp(min=0)
    return positions, tokens, mask


def iw_opd_loss(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor | None,
    mask: torch.Tensor,
    gamma: float = 0.5,
    epsilon: float = 1e-8,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IW-OPD loss on the sampled tokens of a batch, and its metrics.

    Per valid position `t` of a row: the advantage `a_t = sg(log pi_T(y_t) - log mu(y_t))` (`mu` the sampler, or the
    detached student when no sampler log-probs are given); the prefix weight `w_t = sg(1 + gamma (1 - P_t / S))` with
    `P_t` the sum of `|a_s|` over the row's earlier valid positions and `S = max(sum_s |a_s|, epsilon)`. The loss is
    `-sum_t w_t a_t log pi_theta(y_t) / N`, `N` being `num_items_in_batch` when given, else the number of valid
    positions.

    Args:
        student_log_probs: `(B, T)` student log-probabilities of the sampled tokens (differentiable).
        teacher_log_probs: `(B, T)` teacher log-probabilities of the same tokens.
        sampler_log_probs: `(B, T)` log-probabilities under the sampler (vLLM), or `None`.
        mask: `(B, T)` 1 on completion tokens in the loss.
        gamma: Prefix re-weighting strength (>= 0).
        epsilon: Floor of `S` (> 0).
        num_items_in_batch: Normaliser of the sum (the optimizer step's token count), or `None`.

    Returns:
        `(loss, metrics)`; metrics `mean_advantage` (of `w_t a_t`), `mean_abs_advantage` (of `|a_t|`), `mean_weight`,
        `min_weight`, `max_weight` over the valid positions.

    Raises:
        ValueError: When the teacher log-probability of a valid position is missing (not finite).
    """
    valid = mask.bool()
    if (valid & ~torch.isfinite(teacher_log_probs)).any():
        raise ValueError(
            "The teacher log-probability of a sampled completion token is missing (not finite); IW-OPD needs one for "
            "every token in the loss."
        )
    behaviour = student_log_probs.detach() if sampler_log_probs is None else sampler_log_probs
    zeros = torch.zeros_like(student_log_probs)
    advantage = torch.where(valid, (teacher_log_probs - behaviour).detach(), zeros)
    magnitude = advantage.abs()
    prefix = magnitude.cumsum(dim=-1) - magnitude  # sum over the earlier positions only
    total = magnitude.sum(dim=-1, keepdim=True).clamp(min=epsilon)
    weight = (1.0 + gamma * (1.0 - prefix / total)).detach()
    terms = torch.where(valid, -weight * advantage * student_log_probs, zeros)
    count = valid.sum()
    normaliser = num_items_in_batch if num_items_in_batch is not None else count.clamp(min=1)
    loss = terms.sum() / normaliser
    n = count.clamp(min=1)
    kept_weight = weight[valid]
    metrics = {
        # The weighted advantage `w_t a_t` (what multiplies the log-probability), as TRL logs it.
        "mean_advantage": torch.where(valid, weight * advantage, zeros).sum() / n,
        "mean_abs_advantage": magnitude.sum() / n,
        "mean_weight": kept_weight.sum() / n,
        "min_weight": kept_weight.min() if kept_weight.numel() else weight.new_tensor(float("nan")),
        "max_weight": kept_weight.max() if kept_weight.numel() else weight.new_tensor(float("nan")),
    }
    return loss, metrics


def _slice_batch(batch: dict[str, Any], slices: int) -> list[dict[str, Any]]:
    """Split the tensors of a batch into `slices` consecutive row blocks of equal size."""
    rows = next(iter(batch.values())).shape[0]
    size = rows // slices
    return [{key: value[i * size : (i + 1) * size] for key, value in batch.items()} for i in range(slices)]


class IWOPDTrainer(_GenerationBatchMixin, _BaseTrainer):
    r"""Importance-weighted on-policy distillation (IW-OPD) of a teacher into a student, on conversations.

    With `distillation_objective="iw_opd"` (default) the loss is a policy gradient on the student's sampled tokens
    whose per-token advantage is the teacher-versus-sampler log-ratio, re-weighted towards the start of each completion
    (see [`iw_opd_loss`]). With `"jsd"` it is the generalized JSD of GKD between the two next-token distributions
    (full vocabulary, a top-k support, or the top-1 sparse support), on-policy with probability `lmbda`, otherwise on
    the dataset's completions.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer

    trainer = IWOPDTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        teacher_model=get_model_path("small-Qwen2ForCausalLM"),
        args=IWOPDConfig(output_dir="iw-opd-out", max_steps=5, max_completion_length=16),
        train_dataset=load_test_dataset("conversational_language_modeling", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `None`):
            Student: a path or hub id (loaded with `args.model_init_kwargs`) or a causal LM instance.
        teacher_model (`str`, `PreTrainedModel` or `None`, defaults to `None`):
            Local teacher (a path, hub id or instance), frozen. Required unless `args.use_teacher_server`; the
            config's `teacher_model_name_or_path` is not read. Its embeddings are resized to the student's vocabulary
            when they differ.
        args ([`IWOPDConfig`] or `None`, defaults to `None`):
            Configuration; `None` builds `IWOPDConfig(output_dir="tmp_iw_opd")`.
        data_collator (`Callable` or `None`, defaults to `None`):
            Must return `input_ids`, `attention_mask`, `labels`, `prompts` and `prompt_attention_mask` (left-padded);
            defaults to the `messages` collator described in the module.
        train_dataset, eval_dataset (`Dataset` or `None`):
            Conversations in a `messages` column; a final assistant turn is the off-policy completion.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer with a chat template; loaded from the student when omitted.
        compute_metrics, callbacks, optimizers, preprocess_logits_for_metrics:
            As in [`~transformers.Trainer`].
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapters for the student.
    """

    _tag_names = ["trl", "iw-opd"]
    _name = "IW-OPD"
    _quantized_base = AS_LOADED
    _paper = {
        "title": "On the Position Bias of On-Policy Distillation",
        "id": "2606.22600",
        "citation": (
            "@article{xie2026position,\n"
            "    title        = {{On the Position Bias of On-Policy Distillation}},\n"
            "    author       = {Yan Xie and Sijie Zhu and Tiansheng Wen and Bo Chen and Yifei Wang},\n"
            "    year         = 2026,\n"
            "    eprint       = {arXiv:2606.22600},\n"
            "}"
        ),
    }

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module | None" = None,
        teacher_model: "str | PreTrainedModel | nn.Module | None" = None,
        args: IWOPDConfig | None = None,
        data_collator: Callable[[list[Any]], dict[str, Any]] | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        peft_config: Any = None,
    ):
        if args is None:
            args = IWOPDConfig(output_dir="tmp_iw_opd")
        elif not isinstance(args, IWOPDConfig):
            raise TypeError(f"IWOPDTrainer expects `args` to be an IWOPDConfig, got {type(args).__name__}.")
        if model is None:
            raise ValueError("IWOPDTrainer needs a student `model` (a path, a hub id or a model instance).")
        if not args.use_teacher_server and teacher_model is None:
            raise ValueError(
                "IWOPDTrainer needs a teacher: pass `teacher_model` (a path, a hub id or a model instance), or set "
                "use_teacher_server=True with teacher_model_server_url in the IWOPDConfig."
            )
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            columns = getattr(dataset, "column_names", None)
            if isinstance(columns, list) and "messages" not in columns and data_collator is None:
                raise ValueError(
                    f"IWOPDTrainer reads conversations from a `messages` column; {name} has the columns {columns}. "
                    "Build a `messages` list per row (the last assistant turn, if any, is the off-policy completion)."
                )
        args.remove_unused_columns = False
        model = self._load_trained_model(model, args, peft_config)
        if processing_class is None:
            processing_class = self._load_processing_class(self._model_id(model), args, tokenizer_only=True)
        tokenizer = self._ensure_pad_token(processing_class)
        model = self._wrap_peft(model, peft_config, args)
        if data_collator is None:
            data_collator = _DistillationCollator(tokenizer, args.max_length, args.max_prompt_length)
        teacher = None if args.use_teacher_server else DistillationTrainer._load_teacher(teacher_model, args)
        self._init_metrics()
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        if args.disable_dropout:
            disable_dropout_in_model(self.model)
        self.teacher_model, self.teacher_client = None, None
        if teacher is not None:
            student_size = _vocab_size(self.model)
            if student_size is not None and _vocab_size(teacher) != student_size:
                teacher.resize_token_embeddings(student_size)
            if args.disable_dropout:
                disable_dropout_in_model(teacher)
            self.teacher_model = self._prepare_ref_model(self._freeze(teacher))
        else:
            self.teacher_client = vllm_client.VLLMClient(
                base_url=args.teacher_model_server_url, connection_timeout=60.0
            )
        self.lmbda, self.beta, self.temperature = args.lmbda, args.beta, args.temperature
        self.generation_config = GenerationConfig(
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            do_sample=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        self._completion_end_ids = GKDTrainer._eos_token_ids_of(self.model, tokenizer)
        self.vllm_generation = None
        if args.use_vllm:  # student samples from vLLM (server or colocated), weights pushed every vllm_sync_frequency
            from ...generation.vllm_generation import VLLMGeneration

            self.vllm_generation = VLLMGeneration(
                self.model,
                self.accelerator,
                args,
                eos_token_ids=self._completion_end_ids,
                max_tokens=args.max_completion_length,
            )
        self._micro_step = 0
        self._window: tuple[list[dict[str, Any]], list[bool]] | None = None
        self._window_losses: dict[str, list[float]] = {}
        self._completion_rows: list[dict[str, str]] = []
        self._add_model_tags(self.model)

    # ------------------------------------------------------------------------------------------------------------
    # Data: one collated generation batch per optimizer step, replayed over the accumulation steps
    # ------------------------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompts", "prompt_attention_mask", "messages", "chat_template_kwargs", "tools"]

    def _on_policy_draw(self) -> list[bool]:
        """One draw per accumulation slice (main process, shared with the others): on-policy with probability
        `lmbda`."""
        flags = [random.random() < self.lmbda for _ in range(self.args.gradient_accumulation_steps)]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            flags = broadcast_object_list([flags], from_process=0)[0]
        return flags

    def _sample_slice(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """The slice with its completions replaced by the student's samples (GKD's on-policy generation)."""
        extra = {}
        if self.vllm_generation is not None:
            input_ids, attention_mask, labels, sampling = GKDTrainer.vllm_on_policy_outputs(
                self.vllm_generation,
                self.model_wrapped,
                inputs,
                self._completion_end_ids,
                self.processing_class.pad_token_id,
                weights_version=self.state.global_step // self.args.vllm_sync_frequency,
            )
            if self.args.distillation_objective == "iw_opd":  # the behaviour policy of the importance weights
                extra["rollout_logprobs"] = sampling
        else:
            with (
                unwrap_model_for_generation(
                    model, self.accelerator, gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
                ) as unwrapped,
                small_row_linear(unwrapped),
            ):
                input_ids, attention_mask, labels = GKDTrainer.generate_on_policy_outputs(
                    unwrapped, inputs, self.generation_config
                )
        sampled = {**inputs, "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, **extra}
        if self.args.log_completions:
            self._store_completion_rows(sampled)
        return sampled

    def _store_completion_rows(self, inputs: dict[str, Any]) -> None:
        """Keep the decoded on-policy prompts and completions of all processes for the next completions table."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        prompts = [
            tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(inputs["prompts"], inputs["prompt_attention_mask"], strict=True)
        ]
        completions = [tokenizer.decode(row[row != -100], skip_special_tokens=True) for row in inputs["labels"]]
        rows = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions, strict=True)]
        self._completion_rows.extend(gather_object(rows))

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        steps = self.args.gradient_accumulation_steps
        micro = self._micro_step % steps
        if micro == 0 or self._window is None:
            slices, flags = _slice_batch(inputs, steps), self._on_policy_draw()
            slices = [self._sample_slice(model, s) if on else s for s, on in zip(slices, flags, strict=True)]
            self._window, self._window_losses = (slices, flags), {}
        inputs, on_policy = self._window[0][micro], self._window[1][micro]
        kind = "on_policy" if on_policy else "off_policy"
        loss = super().training_step(model, inputs, num_items_in_batch)
        lengths = (inputs["labels"] != -100).sum(dim=1).float()
        self._record_metric(f"completions/{kind}_mean_length", lengths.mean())
        self._record_metric(f"completions/{kind}_max_length", lengths.max())
        self._record_metric(f"completions/{kind}_min_length", lengths.min())
        if on_policy:
            truncated = (lengths >= self.generation_config.max_new_tokens).float().mean()
            self._record_metric("completions/truncated_fraction", truncated)
        self._window_losses.setdefault(kind, []).append(loss.detach())
        if micro == steps - 1:
            for name, values in self._window_losses.items():
                total = self.accelerator.reduce(torch.stack(values).sum(), reduction="mean")
                self._record_metric(f"{name}_loss", round(float(total), 4))
        self._micro_step += 1
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        # A completions table of the latest on-policy samples every `log_completions_steps` steps.
        due = self.state.global_step % self.args.log_completions_steps == 0
        if self._mode == "train" and self._completion_rows and due:
            if self.accelerator.is_main_process:
                log_completion_rows(self, self._completion_rows, "train", unique_prompts=False)
            self._completion_rows = []

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def generalized_jsd_loss(
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        beta: float = 0.5,
        temperature: float = 1.0,
        reduction: str = "batchmean",
        top_k: int = 0,
        add_tail: bool = True,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Generalized JSD between student and teacher logits, on the full vocabulary or a top-k support.

        `top_k=0` is GKD's full-vocabulary divergence ([`~trl.trainer.utils.generalized_jsd_loss`]). Otherwise the
        support of each position is the teacher's top-k (`beta=0`), the student's top-k (`beta=1`) or the union of
        both (deduplicated); both distributions get a tail bucket (`add_tail`) or are renormalised over it.

        Args:
            student_logits, teacher_logits: `(B, T, V)` logits aligned with `labels`.
            labels: `(B, T)`, -100 on positions left out; `None` keeps all.
            beta: 0 forward KL, 1 reverse KL, in between the generalized JSD.
            temperature: Divides both sides' logits.
            reduction: `"batchmean"` (per kept position), `"sum"`, `"mean"` or `"none"`, as in GKD.
            top_k: Support size (0: full vocabulary).
            add_tail: Tail bucket instead of renormalising over the support.
            num_items_in_batch: When given, the sum is divided by it instead.
        """
        if top_k == 0:
            return _full_vocab_jsd_loss(
                student_logits, teacher_logits, labels, beta, temperature, reduction, num_items_in_batch
            )
        log_s = (student_logits.float() / temperature).log_softmax(dim=-1)
        log_t = (teacher_logits.float() / temperature).log_softmax(dim=-1)
        support = _top_k_support(log_s, log_t, top_k, beta)
        valid = torch.ones_like(support, dtype=torch.bool)
        if beta not in (0.0, 1.0):  # a token in both top-k lists counts once
            first = support.unsqueeze(-1) == support.unsqueeze(-2)
            valid = ~torch.tril(first, diagonal=-1).any(dim=-1)
        per_token = sparse_support_divergence(log_s, support, log_t.gather(-1, support), valid, beta, add_tail)
        return _reduce(per_token, labels, reduction, num_items_in_batch)

    def _teacher_log_probs(self, inputs: dict[str, Any], positions: torch.Tensor) -> torch.Tensor:
        """`(B, T, V)` local teacher log-probabilities (at `temperature`) at the completion positions."""
        with torch.no_grad():
            logits = _logits_at(self.teacher_model, inputs, positions)
            return (logits.float() / self.temperature).log_softmax(dim=-1)

    def _score_with_server(self, inputs: dict[str, Any], top_k: int) -> dict[str, list]:
        sequences, prompt_lengths, _ = build_teacher_request_inputs(
            inputs["input_ids"], inputs["attention_mask"], labels=inputs["labels"]
        )
        return self.teacher_client.get_sequence_logprobs(
            sequences, prompt_lengths, top_logprobs=top_k, temperature=self.temperature
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        positions, tokens, mask = _completion_positions(inputs["labels"])
        # A local teacher runs first: its working memory is gone while the student's activations are held, and what
        # the loss holds next to them is declared (gradient checkpointing may keep the last layers within it).
        teacher_log_probs = self._teacher_log_probs(inputs, positions) if self.teacher_client is None else None
        if return_outputs:  # the caller reads every position's logits
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False)
            logits = outputs.logits.gather(1, positions[..., None].expand(-1, -1, outputs.logits.shape[-1]))
        else:
            declared = small_student_logits(model, teacher_log_probs) if teacher_log_probs is not None else None
            with declared or contextlib.nullcontext():
                logits, outputs = _logits_at(model, inputs, positions, with_outputs=True)
        student_log_probs = (logits.float() / self.temperature).log_softmax(dim=-1)
        args = self.args
        if args.distillation_objective == "iw_opd":
            if self.teacher_client is not None:
                result = self._score_with_server(inputs, max(args.loss_top_k, 1))
                teacher = server_realised_log_probs(result, tokens.shape[1], tokens.device)
            else:
                teacher = teacher_log_probs.gather(-1, tokens[..., None])[..., 0]
            sampled = student_log_probs.gather(-1, tokens[..., None])[..., 0]
            behaviour = None
            if "rollout_logprobs" in inputs:  # vLLM's log-probabilities of its samples, at the tokens' positions
                behaviour = inputs["rollout_logprobs"].gather(1, positions + 1)
            loss, metrics = iw_opd_loss(
                sampled, teacher, behaviour, mask, args.iw_opd_gamma, args.iw_opd_epsilon, num_items_in_batch
            )
            for name, value in metrics.items():
                self._record_metric(f"iw_opd/{name}", value)
        elif self.teacher_client is not None:
            result = self._score_with_server(inputs, args.loss_top_k)
            support, teacher, valid = server_teacher_support(result, tokens, mask, self.beta)
            per_token = sparse_support_divergence(
                student_log_probs, support, teacher, valid, self.beta, args.loss_add_tail
            )
            loss = _reduce(per_token, torch.where(mask, tokens, -100), "batchmean", None)
        else:
            if self.beta > 0 and args.loss_top_k == 1:
                reverse = tokens if args.reverse_kl_top_1_mode == "sampled" else student_log_probs.argmax(dim=-1)
                top1 = teacher_log_probs.max(dim=-1)
                support, teacher, valid = top1_sparse_support(
                    top1.indices,
                    top1.values,
                    reverse,
                    teacher_log_probs.gather(-1, reverse[..., None])[..., 0],
                    self.beta,
                )
                per_token = sparse_support_divergence(
                    student_log_probs, support, teacher, valid, self.beta, args.loss_add_tail
                )
                loss = _reduce(per_token, torch.where(mask, tokens, -100), "batchmean", num_items_in_batch)
            else:
                loss = self.generalized_jsd_loss(
                    student_log_probs,
                    teacher_log_probs,
                    labels=torch.where(mask, tokens, -100),
                    beta=self.beta,
                    temperature=1.0,
                    top_k=args.loss_top_k,
                    add_tail=args.loss_add_tail,
                    num_items_in_batch=num_items_in_batch,
                )
        return (loss, outputs) if return_outputs else loss


def _logits_at(model: nn.Module, inputs: dict[str, Any], positions: torch.Tensor, with_outputs: bool = False) -> Any:
    """`(B, T, V)` logits of `model` at `positions` (`(B, T)` indices into the sequence), and its outputs when
    `with_outputs`.

    When the model takes `logits_to_keep`, its LM head runs only at the positions some row reads: the same values as
    slicing the full logits, without the head's work (and its gradient) on the prompt."""
    forward = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "use_cache": False}
    if model_accepts_argument(model, "logits_to_keep"):
        kept = torch.unique(positions)  # sorted
        forward["logits_to_keep"] = kept
        positions = torch.searchsorted(kept, positions)
    outputs = model(**forward)
    logits = outputs.logits.gather(1, positions[..., None].expand(-1, -1, outputs.logits.shape[-1]))
    return (logits, outputs) if with_outputs else logits


def _top_k_support(log_s: torch.Tensor, log_t: torch.Tensor, top_k: int, beta: float) -> torch.Tensor:
    """Support ids `(..., K)`: the teacher's top-k (beta 0), the student's (beta 1), or both concatenated."""
    if beta == 0.0:
        return log_t.topk(top_k, dim=-1).indices
    if beta == 1.0:
        return log_s.topk(top_k, dim=-1).indices
    return torch.cat([log_t.topk(top_k, dim=-1).indices, log_s.topk(top_k, dim=-1).indices], dim=-1)


def _reduce(
    per_token: torch.Tensor, labels: torch.Tensor | None, reduction: str, num_items_in_batch: Any
) -> torch.Tensor:
    """GKD's reductions of per-position divergences over the positions whose label is not -100."""
    mask = torch.ones_like(per_token, dtype=torch.bool) if labels is None else labels != -100
    total = torch.where(mask, per_token, torch.zeros_like(per_token)).sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    if reduction == "sum":
        return total
    if reduction == "none":
        return per_token[mask]
    return total / mask.sum().clamp(min=1)
