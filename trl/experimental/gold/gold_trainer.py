"""GOLD trainer: GKD-style on/off-policy distillation, also across different tokenizers (Universal Logit Distillation)."""

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from accelerate.utils import gather_object
from datasets import Dataset, IterableDataset
from transformers import (
    AutoTokenizer,
    BaseImageProcessor,
    FeatureExtractionMixin,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    TrainerCallback,
)
from transformers.trainer_utils import EvalPrediction

from ...trainer.online_metrics import log_completion_rows
from ...trainer.utils.ignored_options import GOLD_IGNORED_OPTIONS
from .._chatml_collator import DataCollatorForChatML, _completion_byte_offsets
from .._generation_batch import _GenerationBatchMixin
from ..gkd import GKDTrainer
from .gold_config import GOLDConfig
from .uld import ULDLoss, build_teacher_inputs_from_texts, print_prompt_completions_sample_uld


__all__ = ["GOLDTrainer", "ULDLoss", "build_teacher_inputs_from_texts", "print_prompt_completions_sample_uld"]


class _GOLDCollator(DataCollatorForChatML):
    """[`DataCollatorForChatML`] whose batch also carries each example's prompt and completion texts
    (`original_prompt_text`, `original_completion_text`), which the teacher tokenizes with its own tokenizer."""

    _PREPARED = ("original_prompt_text", "original_completion_text", "input_ids", "completion_mask")

    def prepared_columns(self, example: dict[str, Any]) -> dict[str, Any]:
        """The columns GOLD adds to a dataset up front (as TRL): the prompt and completion texts, the conversation's
        `input_ids` / `attention_mask`, `completion_mask` (1 on the completion's tokens) and `byte_offsets` (each
        completion token's byte span in the completion text, `[0, 0]` on the prompt)."""
        prompt_text, full_text = self._texts(example)
        ids, prompt_len = self._tokenize_texts(prompt_text, full_text)
        completion = ids[prompt_len:]
        spans = [(0, 0)] * prompt_len + _completion_byte_offsets(self.tokenizer, completion, self._byte_level)
        return {
            "original_prompt_text": prompt_text,
            "original_completion_text": full_text[len(prompt_text) :],
            "input_ids": ids,
            "attention_mask": [1] * len(ids),
            "byte_offsets": [list(span) for span in spans],
            "completion_mask": [0] * prompt_len + [1] * len(completion),
        }

    def _is_prepared(self, example: dict[str, Any]) -> bool:
        return all(example.get(key) is not None for key in self._PREPARED)

    def _token_ids(self, example: dict[str, Any]) -> tuple[list[int], int]:
        if self._is_prepared(example):  # tokenized up front: no second pass through the tokenizer
            mask = example["completion_mask"]
            return list(example["input_ids"]), len(mask) - sum(mask)
        return super()._token_ids(example)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().__call__(examples)
        texts = []
        for example in examples:
            if self._is_prepared(example):
                texts.append((example["original_prompt_text"], example["original_completion_text"]))
            else:
                prompt, full = self._texts(example)
                texts.append((prompt, full[len(prompt) :]))
        batch["original_prompt_text"] = [prompt for prompt, _ in texts]
        batch["original_completion_text"] = [completion for _, completion in texts]
        return batch


class GOLDTrainer(_GenerationBatchMixin, GKDTrainer):
    """General Online Logit Distillation: [`experimental.gkd.GKDTrainer`] that also distills across tokenizers.

    With `use_uld_loss=False` the loss is GKD's generalized JSD (both models must share the vocabulary), with the
    logits divided by `temperature`. With `use_uld_loss=True` the teacher reads the same prompt + completion texts
    through its own tokenizer and the loss is [`~experimental.gold.ULDLoss`] (sorted-probability distance between
    aligned positions, optionally hybrid with the JSD on the shared vocabulary). With probability `lmbda` a batch's
    completions are the student's own samples (transformers `generate` or vLLM), else with `seq_kd` the teacher's
    (same tokenizer only), else the dataset's. Training logs add `on_policy_loss` / `off_policy_loss`.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.gold import GOLDConfig, GOLDTrainer

    trainer = GOLDTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        teacher_model=get_model_path("tiny-LlamaForCausalLM"),  # another tokenizer
        args=GOLDConfig(output_dir="gold-out", max_steps=5, use_uld_loss=True, max_completion_length=16),
        train_dataset=load_test_dataset("conversational_language_modeling", split="train"),
    )
    trainer.train()
    ```

    Args:
        model: Student: a path or hub id (loaded with `args.model_init_kwargs`) or a causal LM instance.
        teacher_model: Teacher: a path or hub id (loaded with `args.teacher_model_init_kwargs` and
            `args.teacher_model_revision`) or an instance; None uses `args.teacher_model_name_or_path`. Frozen.
        args: The [`GOLDConfig`]; None builds `GOLDConfig(f"{model_name}-GOLD")`.
        data_collator: Defaults to a [`~trl.experimental.utils.DataCollatorForChatML`] that also returns the prompt
            and completion texts (`original_prompt_text`, `original_completion_text`), needed by the ULD loss.
        train_dataset: Conversations (`messages`) or `prompt` / `completion` pairs.
        eval_dataset: Same formats.
        processing_class: Student tokenizer with a chat template; loaded from the student's path when omitted.
        compute_metrics: Metric function for evaluation, as in `Trainer`.
        callbacks: Extra callbacks.
        optimizers: Optimizer and scheduler to use instead of the defaults.
        preprocess_logits_for_metrics: Transform logits before they are cached for `compute_metrics`.
        peft_config: Adapter configuration for the student.
    """

    _tag_names = ["trl", "gold"]
    _ignored_options = GOLD_IGNORED_OPTIONS
    _name = "GOLD"
    _config_class = GOLDConfig
    _paper = {
        "title": "Towards Cross-Tokenizer Distillation: the Universal Logit Distillation Loss for LLMs",
        "id": "2402.12030",
        "citation": (
            "@article{boizard2024towards,\n"
            "    title        = {{Towards Cross-Tokenizer Distillation: the Universal Logit Distillation Loss for "
            "LLMs}},\n"
            "    author       = {Nicolas Boizard and Kevin El Haddad and C{\\'e}line Hudelot and Pierre Colombo},\n"
            "    year         = 2024,\n"
            "    journal      = {arXiv preprint arXiv:2402.12030},\n"
            "}"
        ),
    }

    def __init__(
        self,
        model: "PreTrainedModel | nn.Module | str | None" = None,
        teacher_model: "PreTrainedModel | nn.Module | str" = None,
        args: GOLDConfig | None = None,
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
    ):
        if isinstance(args, GOLDConfig):
            self._check_supported(args, teacher_model)
            if args.teacher_model_revision is not None and not isinstance(teacher_model, nn.Module):
                init_kwargs = args.teacher_model_init_kwargs
                init_kwargs = json.loads(init_kwargs) if isinstance(init_kwargs, str) else dict(init_kwargs or {})
                args.teacher_model_init_kwargs = {**init_kwargs, "revision": args.teacher_model_revision}
        super().__init__(
            model,
            teacher_model=teacher_model,
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
        args = self.args
        self._add_prepared_columns()
        self.use_uld_loss = args.use_uld_loss
        self.teacher_tokenizer = None
        self.uld_loss_fn = None
        if self.use_uld_loss:
            self.teacher_tokenizer = self._load_teacher_tokenizer(teacher_model, args)
            self.uld_loss_fn = ULDLoss(args, self.processing_class, self.teacher_tokenizer)
        self.vllm_generation = None
        if args.use_vllm:
            from ...generation.vllm_generation import VLLMGeneration

            self.vllm_generation = VLLMGeneration(
                self.model,
                self.accelerator,
                args,
                eos_token_ids=self._completion_end_ids,
                max_tokens=args.max_completion_length,
            )
        self._batch_on_policy = False
        self._micro_step = 0  # training micro-steps so far: which slice of the generation batch comes next
        self._completion_rows: list[dict[str, str]] = []
        self._completion_rows_step: int | None = None

    # ------------------------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_supported(args: GOLDConfig, teacher_model: Any) -> None:
        if args.callbacks:
            raise ValueError(
                f"GOLDConfig.callbacks names callbacks ({args.callbacks}), which this trainer does not resolve by name. "
                "Pass callback instances through the trainer's `callbacks` argument and leave GOLDConfig.callbacks empty."
            )
        if args.use_uld_loss and args.seq_kd:
            raise ValueError(
                "seq_kd=True trains the student on teacher generations, which are in the teacher's tokens; with "
                "use_uld_loss=True the tokenizers differ. Set seq_kd=False, or use a teacher sharing the student's "
                "tokenizer with use_uld_loss=False."
            )
        if args.uld_use_hybrid_loss and not args.use_uld_loss:
            raise ValueError(
                "uld_use_hybrid_loss=True only applies to the ULD loss; set use_uld_loss=True as well, or drop it."
            )

    def _add_prepared_columns(self) -> None:
        """Tokenize the datasets up front, as TRL: the texts, ids, completion mask and byte offsets become columns
        (the raw columns stay), which the default collator then reads instead of tokenizing again."""
        helper = _GOLDCollator(tokenizer=self.processing_class, max_length=self.args.max_length)

        def prepare(dataset: Any, name: str) -> Any:
            if not isinstance(dataset, (Dataset, IterableDataset)):
                return dataset
            kwargs = {} if isinstance(dataset, IterableDataset) else {"desc": f"Tokenizing {name} dataset"}
            return dataset.map(helper.prepared_columns, **kwargs)

        self.train_dataset = prepare(self.train_dataset, "train")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {key: prepare(value, key) for key, value in self.eval_dataset.items()}
        else:
            self.eval_dataset = prepare(self.eval_dataset, "eval")

    @staticmethod
    def _default_collator(tokenizer: Any, args: GOLDConfig) -> Callable[[list[Any]], dict[str, Any]]:
        return _GOLDCollator(tokenizer=tokenizer, max_length=args.max_length)

    @staticmethod
    def _sampling_settings(args: GOLDConfig) -> dict[str, Any]:
        return {"max_new_tokens": args.max_completion_length, "top_k": args.top_k, "top_p": args.top_p}

    def _divergence_temperature(self) -> float:
        return self.args.temperature

    def _check_same_vocabulary(self, student, teacher, tokenizer, teacher_arg, args) -> None:
        if args.use_uld_loss:
            return  # the ULD loss needs no shared vocabulary
        super()._check_same_vocabulary(student, teacher, tokenizer, teacher_arg, args)

    def _load_teacher_tokenizer(self, teacher_model: Any, args: GOLDConfig) -> PreTrainedTokenizerBase:
        source = args.teacher_tokenizer_name_or_path
        if source is None:
            source = teacher_model if isinstance(teacher_model, str) else args.teacher_model_name_or_path
        if source is None and teacher_model is not None:
            source = getattr(getattr(teacher_model, "config", None), "_name_or_path", None) or None
        if source is None:
            raise ValueError(
                "use_uld_loss=True needs the teacher's tokenizer: set `teacher_tokenizer_name_or_path` in the "
                "GOLDConfig (or pass the teacher as a path, next to which its tokenizer is saved)."
            )
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=args.teacher_model_revision, trust_remote_code=args.trust_remote_code
        )
        if tokenizer.eos_token_id is None:
            raise ValueError(f"The teacher tokenizer ({source}) has no eos token; the ULD loss appends it.")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    # ------------------------------------------------------------------------------------------------------------
    # Training data: one dataloader batch per optimizer step, sliced into its micro-batches (as TRL)
    # ------------------------------------------------------------------------------------------------------------
    def _micro_batch(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """This micro-step's slice of the step's generation batch (rows `k * per_device_train_batch_size` on).

        The slice keeps the generation batch's (left) padding, as TRL: dropping it would move the tokens' position
        ids and change the numbers."""
        steps = self.args.gradient_accumulation_steps
        if steps == 1:
            return generation_batch
        index = self._micro_step % steps
        self._micro_step += 1
        size = self.args.per_device_train_batch_size
        return {key: value[index * size : (index + 1) * size] for key, value in generation_batch.items()}

    # ------------------------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------------------------
    def _replace_completions(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        on_policy = model is not self.teacher_model
        if on_policy and self.vllm_generation is not None:
            self._generate_with_vllm(inputs)
        else:
            super()._replace_completions(model, inputs)
        self._batch_on_policy = on_policy
        self._refresh_completion_texts(inputs)
        return inputs

    def _generate_with_vllm(self, inputs: dict[str, Any]) -> None:
        """Sample the batch's completions with vLLM (weights pushed every `vllm_sync_frequency` steps)."""
        version = self.state.global_step // self.args.vllm_sync_frequency
        input_ids, attention_mask, labels, _ = GKDTrainer.vllm_on_policy_outputs(
            self.vllm_generation,
            self.model_wrapped,
            inputs,
            self._completion_end_ids,
            self.processing_class.pad_token_id,
            weights_version=version,
        )
        inputs.update(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def _refresh_completion_texts(self, inputs: dict[str, Any]) -> None:
        """After generation: the completions' texts (for the teacher's tokenizer) and byte spans (for alignment)."""
        tokenizer = self.processing_class
        texts, offsets = [], []
        for row_labels in inputs["labels"]:
            positions = (row_labels != -100).nonzero().squeeze(-1)
            ids = row_labels[positions].tolist()
            texts.append(tokenizer.decode(ids, skip_special_tokens=False))
            spans = torch.zeros(len(row_labels), 2, dtype=torch.long)
            if ids:
                spans[positions.cpu()] = torch.tensor(_completion_byte_offsets(tokenizer, ids), dtype=torch.long)
            offsets.append(spans)
        inputs["original_completion_text"] = texts
        inputs["byte_offsets"] = torch.stack(offsets).to(inputs["labels"].device)
        if self.args.log_completions and self._batch_on_policy:
            self._store_completion_rows(inputs)

    def _store_completion_rows(self, inputs: dict[str, Any]) -> None:
        """Keep the current optimizer step's generated (prompt, completion) texts of all processes for `log`."""
        prompts = gather_object(list(inputs["original_prompt_text"]))
        completions = gather_object(list(inputs["original_completion_text"]))
        rows = [{"prompt": prompt, "completion": text} for prompt, text in zip(prompts, completions, strict=True)]
        step = self.state.global_step
        if self._completion_rows_step != step:  # a new step: the previous step's rows have been logged
            self._completion_rows, self._completion_rows_step = [], step
        self._completion_rows.extend(rows)

    # ------------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------------
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        self._batch_on_policy = False
        # A new dict: the Trainer counts the step's FLOPs from the batch it fetched (the whole generation batch).
        inputs = self._micro_batch(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        name = "on_policy_loss" if self._batch_on_policy else "off_policy_loss"
        # The step's loss is the sum of what its micro-batches return: averaged over a logging window, each
        # micro-batch stands for its share times the number of micro-batches.
        self._record_metric(name, loss * self.current_gradient_accumulation_steps, mode="train")
        return loss

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, None, None]:
        """The evaluation loss of a batch. As in TRL, GOLD hands no predictions or labels to `compute_metrics` (nor
        returns them from `predict()`)."""
        loss, _, _ = super().prediction_step(model, inputs, True, ignore_keys)
        return loss, None, None

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: int | torch.Tensor | None = None,
    ):
        if not self.use_uld_loss:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        teacher_ids, teacher_labels, teacher_mask, teacher_offsets = build_teacher_inputs_from_texts(
            self.teacher_tokenizer,
            inputs["original_prompt_text"],
            inputs["original_completion_text"],
            use_extended_uld=self.args.use_extended_uld,
        )
        device = inputs["input_ids"].device
        student = {key: inputs[key] for key in ("input_ids", "labels", "byte_offsets")}
        teacher = {"input_ids": teacher_ids, "labels": teacher_labels, "byte_offsets": teacher_offsets}
        teacher = {key: value.to(device) for key, value in teacher.items()}
        # ULD reads the logits at completion positions only; the cross-entropy term needs the preceding ones too.
        trim = self.args.uld_crossentropy_weight == 0 and not return_outputs
        forward = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "use_cache": False}
        teacher_forward = {"input_ids": teacher["input_ids"], "attention_mask": teacher_mask.to(device).long()}
        shift = self.uld_loss_fn.logit_shift
        student_keep = self._completion_positions(student, trim and self._forward_accepts_logits_to_keep, shift)
        teacher_keep = self._completion_positions(teacher, trim and self._teacher_accepts_logits_to_keep, shift)
        outputs = model(**forward, **({} if student_keep is None else {"logits_to_keep": student_keep}))
        with torch.no_grad():
            if teacher_keep is not None:
                teacher_forward["logits_to_keep"] = teacher_keep
            teacher_logits = self.teacher_model(**teacher_forward, use_cache=False).logits
        # Unshifted, as in TRL: the logits at a completion token's position are the distribution of what follows
        # that token. Aligned groups end at the same byte of the text, so the student's and the teacher's
        # distributions there both predict the text after that byte.
        loss = self.uld_loss_fn(
            outputs.logits,
            teacher_logits,
            student["labels"],
            teacher["labels"],
            student["input_ids"],
            teacher["input_ids"],
            student["byte_offsets"],
            teacher["byte_offsets"],
        )
        if self.args.uld_use_hybrid_loss:
            # As TRL: the batch's last sequence's terms, from every loss computation (evaluation's included),
            # averaged into the next training log.
            for name, values in self.uld_loss_fn.last_hybrid_terms.items():
                if values:
                    self._record_metric(name, values[-1], mode="train")
        # Not divided by the gradient-accumulation steps (the training loop leaves it as is since a token count is
        # given): as in TRL, the step's loss and gradient are the sum of its micro-batches' means.
        return (loss, outputs) if return_outputs else loss

    @staticmethod
    def _completion_positions(side: dict[str, torch.Tensor], trim: bool, shift: int = 0) -> torch.Tensor | None:
        """With `trim`, keep only the positions where some row has a completion token, and the `shift` positions
        before each (whose logits the loss reads), in place on `side`'s position-indexed tensors, and return them for
        `logits_to_keep`; otherwise None."""
        if not trim:
            return None
        needed = (side["labels"] != -100).any(dim=0)
        if shift:
            needed[:-shift] |= needed[shift:].clone()
        positions = needed.nonzero().squeeze(-1)
        for key in ("input_ids", "labels", "byte_offsets"):
            side[key] = side[key][:, positions]
        return positions

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._mode == "train" and hasattr(self, "_metrics"):
            # TRL reports these rounded to 4 decimals.
            for name in ("on_policy_loss", "off_policy_loss", "matched_loss", "unmatched_loss"):
                values = self._metrics["train"].pop(name, None)
                if values:
                    logs[name] = round(sum(values) / len(values), 4)
        super().log(logs, start_time)
        # As TRL: the latest step's completions, every `log_completions_steps` steps (and again at the end of training).
        due = self.state.global_step % self.args.log_completions_steps == 0
        if self._mode == "train" and self._completion_rows and due and self.accelerator.is_main_process:
            log_completion_rows(
                self, self._completion_rows, "train", unique_prompts=self.args.wandb_log_unique_prompts
            )
