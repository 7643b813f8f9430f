"""The online self-distillation core shared by SDFT and SDPO.

Rollouts are those of the online trainers (`_OnlineTrainer`: prompt sampling, generation, buffering over
`steps_per_generation * num_iterations` micro-steps). What is added: a teacher prompt per row (built by the subclass
from privileged context), a teacher that is the student itself or a copy/adapter of it, and a per-token
self-distillation loss on the student's completions ([`loss_utils`]).
"""

import contextlib
from typing import Any

import torch
import torch.nn as nn
from datasets import IterableDataset

from ...models.peft import AS_LOADED, use_adapter
from ...trainer.fast_paths.last_layer_selection import last_layer_before_end
from ...trainer.fast_paths.prefix_sharing import SharedPrefixLayout, shared_prefix_logits_at
from ...trainer.online_base import _OnlineTrainer
from ...trainer.utils import model_accepts_argument, pad
from ...trainer.utils.logprobs import small_student_logits
from .loss_utils import (
    apply_importance_sampling_clipping,
    compute_full_logit_self_distillation_loss,
    compute_sampled_token_self_distillation_loss,
    compute_topk_self_distillation_loss,
    token_log_probs,
)
from .teacher_server import check_teacher_server_args, score_on_server, server_self_distillation_per_token
from .teacher_sync import PEFTAdapterEMACallback, SyncTeacherModelCallback, is_pure_lora_training


TEACHER_ADAPTER = "teacher"
# Logits-sized float32 tensors the loss holds with the student's activations, the teacher's logits counted: both
# temperature-scaled logits and log-softmaxes, the top-k or full-vocabulary terms and their gradients (at 24 layers of
# Qwen2.5-0.5B's shape, declaring four left SDFT's peak 500 MB higher than with none kept).
_LOSS_LOGITS_COPIES = 8
# Metrics the shared online core records that TRL's self-distillation trainers do not log.
_NOT_LOGGED = ("num_tokens", "step_time")


def completion_logits(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    layout: SharedPrefixLayout | None = None,
) -> torch.Tensor:
    """`(B, C, V)` logits predicting each completion token after `prompt`, divided by `temperature`.

    As TRL's self-distillation trainers: one forward over the whole left-padded sequence with the model's default
    positions (no `position_ids`), the LM head only on the last `C + 1` positions (`logits_to_keep`, when the model
    takes it), then the completion positions are sliced. RoPE makes the attention invariant to the padding offset, so
    this equals the padding-aware positions up to float rounding. The last decoder layer then runs only at the `C`
    positions read ([`last_layer_before_end`]).

    With `layout` (the [`share_prefixes`] layout of the prompt + completion rows, see
    [`_SelfDistillationTrainer._completion_layout`]) the rows that share a prompt run it once instead
    ([`shared_prefix_logits_at`]): the same logits up to float rounding at every position that predicts a completion
    token. A position after a completion's end (its input is padding, and every loss masks it) reads the logits of
    its row's last token instead.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    width = completion_ids.shape[1]
    if layout is not None:
        mask = attention_mask.bool()
        positions = torch.arange(mask.shape[1], device=mask.device)
        columns = (prompt_ids.shape[1] - 1 + torch.arange(width, device=mask.device)).expand(len(mask), width)
        last_real = (positions * mask).argmax(dim=1, keepdim=True)
        columns = torch.where(mask.gather(1, columns), columns, last_real)
        rows = torch.arange(len(mask), device=mask.device).unsqueeze(1).expand_as(columns)
        return shared_prefix_logits_at(model, layout, rows, columns) / temperature
    kwargs, selection = {}, contextlib.nullcontext()
    if model_accepts_argument(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = width + 1
        selection = last_layer_before_end(model, input_ids, width)
    with selection:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
    return logits[:, -(width + 1) : -1] / temperature


def self_distillation_per_token_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, completion_ids: torch.Tensor, args: Any
) -> torch.Tensor:
    """`(B, C)` per-token loss of `args.distillation_mode` (see [`loss_utils`])."""
    if args.distillation_mode == "sampled_token":
        return compute_sampled_token_self_distillation_loss(
            student_logits, teacher_logits, completion_ids, distillation_alpha=args.distillation_alpha
        )
    if args.distillation_mode == "full_logits":
        return compute_full_logit_self_distillation_loss(
            student_logits, teacher_logits, distillation_alpha=args.distillation_alpha
        )
    return compute_topk_self_distillation_loss(
        student_logits,
        teacher_logits,
        distillation_topk=args.distillation_topk,
        distillation_alpha=args.distillation_alpha,
        distillation_add_tail=args.distillation_add_tail,
    )


def keep_last_prompt_tokens(prompt_ids: list[list[int]], limit: int | None) -> list[list[int]]:
    """Each prompt cut to its last `limit` tokens (`None` keeps them all)."""
    if limit is None:
        return prompt_ids
    return [ids[-limit:] if len(ids) > limit else ids for ids in prompt_ids]


def sequence_mean_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each sequence's masked token mean; an empty mask gives a zero attached to the graph."""
    mask = mask.to(per_token_loss.dtype)
    if mask.sum() == 0:
        return per_token_loss.sum() * 0.0
    return ((per_token_loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()


class _SelfDistillationTrainer(_OnlineTrainer):
    """Online trainer whose signal is the model's own distribution given a richer (teacher) prompt.

    Subclasses add `teacher_prompt_ids` / `teacher_prompt_mask` to the rollout batch (in
    `_generate_and_score_completions`) and implement `_compute_loss` with `_student_logits`, `_teacher_logits` and
    `_distillation_loss` / `_distillation_per_token`.
    """

    loss_is_scaled_for_ga = True
    _logs_rewards = False
    _quantized_base = AS_LOADED
    _undefined_metric_value = None
    _shuffle_rollout_batch = False
    _loss_name: str = ""
    _log_copies_logs = True

    def __init__(self, model, args, train_dataset, eval_dataset, peft_config, reward_funcs=None, **kwargs):
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if isinstance(dataset, IterableDataset):
                raise NotImplementedError(f"{type(self).__name__} does not support an IterableDataset {name}.")
        if train_dataset is None:
            raise ValueError(f"{type(self).__name__} needs a train_dataset (rows with a `prompt` column).")
        if args.use_teacher_server:
            check_teacher_server_args(args, getattr(args, "distillation_weight", None))
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            **kwargs,
        )
        self._setup_teacher(model)

    # ------------------------------------------------------------------------------------------------------------
    # Teacher
    # ------------------------------------------------------------------------------------------------------------
    def _setup_teacher(self, model_argument: Any) -> None:
        """Pick the teacher of `args.teacher_model_kind` (see the configs) and its update callback."""
        kind = self.args.teacher_model_kind
        self.teacher_model = None
        self._teacher_adapter: str | None = None  # PEFT: run the teacher with this adapter (None: adapters off)
        self._teacher_is_student = kind == "live"
        peft = self._is_peft_model(self.model)
        if kind == "live":
            return
        if kind == "ema" and peft:
            if not is_pure_lora_training(self.model):
                raise ValueError(
                    "teacher_model_kind='ema' with a PEFT model needs pure LoRA training (only `lora_` parameters "
                    "trainable); use teacher_model_kind='base' or 'live', or train LoRA adapters only."
                )
            self._teacher_adapter = TEACHER_ADAPTER
            self.add_callback(
                PEFTAdapterEMACallback(
                    self.model,
                    teacher_adapter_name=TEACHER_ADAPTER,
                    update_rate=self.args.teacher_update_rate,
                    sync_steps=self.args.teacher_sync_steps,
                    accelerator=self.accelerator,
                )
            )
            return
        if peft:
            return  # "base": the student with its adapters disabled
        source = model_argument if isinstance(model_argument, str) else self.model
        teacher = self._build_ref_model(source, self.accelerator.unwrap_model(self.model), None, self.args)
        self.teacher_model = self._prepare_ref_model(teacher)
        if kind == "ema":
            self.add_callback(SyncTeacherModelCallback(self.teacher_model, accelerator=self.accelerator))

    @contextlib.contextmanager
    def _teacher(self, model: nn.Module):
        """The teacher to run inside the block (no gradient flows through it)."""
        if self._teacher_is_student:
            yield model
        elif self.teacher_model is not None:
            yield self.teacher_model
        else:
            with use_adapter(self.accelerator.unwrap_model(model), self._teacher_adapter):
                yield model

    def _teacher_logits(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad(), self._teacher(model) as teacher:
            prompt_ids, prompt_mask = inputs["teacher_prompt_ids"], inputs["teacher_prompt_mask"]
            return completion_logits(
                teacher,
                prompt_ids,
                prompt_mask,
                inputs["completion_ids"],
                inputs["completion_mask"],
                self.args.temperature,
                self._completion_layout(teacher, prompt_ids, prompt_mask, inputs),
            )

    def _completion_layout(
        self, model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, inputs: dict[str, Any]
    ) -> SharedPrefixLayout | None:
        """The shared-prefix layout of the prompt + completion rows whose prompts are the same (the completions of
        one prompt: their teacher prompts too), or None to run whole rows ([`_shared_prompt_layout`])."""
        if not bool(prompt_mask[:, -1].all()):  # an empty prompt: its first prediction reads no token of its own
            return None
        input_ids = torch.cat([prompt_ids, inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([prompt_mask, inputs["completion_mask"].long()], dim=1)
        return self._shared_prompt_layout(model, input_ids, attention_mask, prompt_ids.shape[1])

    # ------------------------------------------------------------------------------------------------------------
    # Hooks of the online core: no reward functions by default, no reference model
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _needs_ref_model(args: Any) -> bool:
        return False

    def _needs_rollout_logps(self) -> bool:
        return not self._is_on_policy() and not getattr(self.args, "generate_from_teacher", False)

    def _tokenize_prompts(self, prompts: list) -> tuple[list[list[int]], list | None, dict[str, Any]]:
        prompt_ids, images, fields = super()._tokenize_prompts(prompts)
        return keep_last_prompt_tokens(prompt_ids, self.args.max_prompt_length), images, fields

    def _padded_prompts(self, prompts: list, max_length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask of prompts rendered like the student's, keeping the last `max_length` tokens."""
        ids = keep_last_prompt_tokens(super()._tokenize_prompts(prompts)[0], max_length)
        device = self.accelerator.device
        tensors = [torch.tensor(row, dtype=torch.long, device=device) for row in ids]
        return pad(tensors, self.pad_token_id, "left"), pad([torch.ones_like(t) for t in tensors], 0, "left")

    # ------------------------------------------------------------------------------------------------------------
    # Loss pieces
    # ------------------------------------------------------------------------------------------------------------
    def _student_logits(
        self, model: nn.Module, inputs: dict[str, Any], teacher_logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The student's `(B, C, V)` completion logits on its own prompt, divided by the temperature.

        Given the teacher's logits (computed first, so that the teacher's working memory is gone while the student's
        activations are held), the student's are declared as small as those ([`small_student_logits`]): gradient
        checkpointing may then keep its last layers' activations instead of recomputing them."""
        declared = contextlib.nullcontext()
        if teacher_logits is not None:
            declared = small_student_logits(model, teacher_logits, copies=_LOSS_LOGITS_COPIES)
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        layout = self._completion_layout(model, prompt_ids, prompt_mask, inputs)
        with declared:
            return completion_logits(
                model,
                prompt_ids,
                prompt_mask,
                inputs["completion_ids"],
                inputs["completion_mask"],
                self.args.temperature,
                layout,
            )

    def _teacher_logits_first(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor | None:
        """The teacher's logits, computed before the student's forward; None when the teacher server scores the
        completions in the loss instead."""
        return None if self.args.use_teacher_server else self._teacher_logits(model, inputs)

    def _distillation_per_token(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`(B, C)` self-distillation loss of each completion token, importance-weighted when old log-probs exist.

        The teacher's logits are computed here unless given; with `use_teacher_server` the generation server scores
        the completions instead ([`teacher_server`])."""
        args = self.args
        completion_ids = inputs["completion_ids"]
        if args.use_teacher_server:
            per_token, abs_diff = server_self_distillation_per_token(
                student_logits, completion_ids, inputs["completion_mask"], score_on_server(self, inputs), args
            )
            self._record_metric("self_distillation/server_logprob_abs_diff", abs_diff.detach())
        else:
            if teacher_logits is None:
                teacher_logits = self._teacher_logits(model, inputs)
            per_token = self_distillation_per_token_loss(student_logits, teacher_logits, completion_ids, args)
        old = inputs.get("old_per_token_logps")
        if args.distillation_is_clip is not None and old is not None:
            student_logps = token_log_probs(student_logits, completion_ids)
            per_token = apply_importance_sampling_clipping(per_token, student_logps, old, args.distillation_is_clip)
        return per_token

    def _distillation_loss(
        self, model: nn.Module, inputs: dict[str, Any], loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The self-distillation loss (sequence mean of the masked token mean) and the student's `(B, C)` logits."""
        teacher_logits = self._teacher_logits_first(model, inputs)
        student_logits = self._student_logits(model, inputs, teacher_logits)
        per_token = self._distillation_per_token(model, inputs, student_logits, teacher_logits)
        return sequence_mean_loss(per_token, loss_mask), student_logits

    def _dispatch_self_distillation_callback(self, event_name: str, **payload: Any) -> None:
        """Call the hook `event_name` of every callback that defines it (TRL's self-distillation events), with the
        usual `args, state, control, model, processing_class` keywords plus `payload`."""
        for callback in self.callback_handler.callbacks:
            hook = getattr(callback, event_name, None)
            if callable(hook):
                hook(
                    args=self.args,
                    state=self.state,
                    control=self.control,
                    model=self.model,
                    processing_class=self.processing_class,
                    **payload,
                )

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """The online core's micro-batch; after a new generation round TRL's `on_generation_batch_built` event."""
        previous = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self._mode == "train" and self._buffered_inputs is not previous:
            steps = self.args.steps_per_generation
            self._dispatch_self_distillation_callback(
                "on_generation_batch_built",
                generate_every=steps * self.args.num_iterations,
                steps_per_generation=steps,
            )
        return inputs

    def _announce_generation_prompts(self, prompts: list) -> None:
        """TRL's `on_generation_prompts_selected` event: the prompts (dataset values) about to be sampled from."""
        self._dispatch_self_distillation_callback(
            "on_generation_prompts_selected", generation_prompts=prompts, generation_prompt_text=None
        )

    def _announce_batch_prepared(self, batch: dict[str, Any], **extra: Any) -> None:
        """TRL's `on_self_distillation_batch_prepared` event for a built round (SDPO adds its distillation mask)."""
        teacher_input_ids, teacher_attention_mask = self._teacher_inputs(batch)
        self._dispatch_self_distillation_callback(
            "on_self_distillation_batch_prepared",
            old_per_token_logps=batch.get("old_per_token_logps"),
            prompt_ids=batch["prompt_ids"],
            completion_ids=batch["completion_ids"],
            teacher_input_ids=teacher_input_ids,
            teacher_attention_mask=teacher_attention_mask,
            **extra,
        )

    @staticmethod
    def _teacher_inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's whole input (its prompt, then the completion) and attention mask, as TRL's hooks get it."""
        ids = torch.cat([batch["teacher_prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["teacher_prompt_mask"], batch["completion_mask"].long()], dim=1)
        return ids, mask

    def _record_distillation_loss(self, value: torch.Tensor) -> None:
        self._record_metric("self_distillation/distillation_loss", value.detach())
        self._record_metric(f"{self._loss_name}/distillation_loss", value.detach())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        metrics = self._metrics[self._mode]
        for key in _NOT_LOGGED:
            metrics.pop(key, None)
        # As TRL's SDFT: the caller's dict is left as it is (`train()`'s summary keeps `total_flos` and gets no
        # `epoch`); TRL's SDPO logs it in place.
        super().log(dict(logs) if self._log_copies_logs else logs, start_time)
