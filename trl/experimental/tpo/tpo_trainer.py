"""Triple Preference Optimization (TPO) trainer: DPO's offline preference pipeline, except that there is no reference
model, each example also carries a gold `reference` completion, and the loss adds the cross-entropy of that gold
completion to a reference-free preference term (the CPO loss family, plus TPO-L)."""

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer_utils import EvalPrediction

from ...data_utils import extract_prompt, is_conversational
from ...models.peft import AS_LOADED
from ...trainer.fast_paths.prefix_sharing import supports_prefix_sharing
from ...trainer.preference_base import _PreferenceTrainer
from ...trainer.utils import (
    PromptCompletionTokenizer,
    collate_prompt_completions,
    disable_dropout_in_model,
    map_kwargs_with_desc,
    scored_completion_tokens,
)
from ..cpo.cpo_trainer import cpo_loss
from .tpo_config import TPOConfig


logger = logging.getLogger(__name__)

_COMPLETIONS = ("chosen", "rejected", "reference")
_TOKENIZED_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids", "reference_ids")
# Losses computed on per-token mean log-probabilities instead of sums.
_LENGTH_NORMALIZED_LOSSES = ("ipo", "tpo-l")


def tpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    loss_type: str = "sigmoid",
    beta: float = 0.01,
    label_smoothing: float = 0.0,
    tpo_l_gamma: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Per-triple preference term of TPO and the implicit rewards, from the policy's sequence log-probabilities.

    With $\Delta = s_c - s_r$ (summed log-probs, or per-token means for `ipo` and `tpo-l`) and $\varepsilon$ =
    `label_smoothing`:

    - `sigmoid`: $-(1-\varepsilon)\log\sigma(\beta\Delta) - \varepsilon\log\sigma(-\beta\Delta)$
    - `hinge`: $\max(0, 1 - \beta\Delta)$
    - `ipo`: $(\Delta - \frac{1}{2\beta})^2$
    - `tpo-l`: the sigmoid form on $\Delta - \gamma/\beta$ ($\gamma$ = `tpo_l_gamma`)

    These are CPO's losses (`tpo-l` is its `simpo`), see [`experimental.cpo.cpo_trainer.cpo_loss`]. The rewards are
    $\beta s_c$ and $\beta s_r$. The gold completion's cross-entropy is added by the trainer.

    Returns:
        `(losses, chosen_rewards, rejected_rewards)`, each `(n,)`.
    """
    return cpo_loss(
        chosen_logps,
        rejected_logps,
        loss_type="simpo" if loss_type == "tpo-l" else loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=tpo_l_gamma,
    )


@dataclass
class DataCollatorForTriplePreference:
    """Collate tokenized triples into one right-padded batch: the `n` sequences `prompt + chosen`, then the `n`
    `prompt + rejected`, then (unless `include_reference=False`) the `n` `prompt + reference`.

    Each example holds `prompt_ids`, `chosen_ids`, `rejected_ids` and `reference_ids` (lists of token ids). Every
    sequence is truncated to `max_length` (per `truncation_mode`) before padding.

    Args:
        pad_token_id (`int`):
            Token used to pad `input_ids`.
        max_length (`int` or `None`, defaults to `None`):
            Keep at most this many tokens of each `prompt + completion` sequence.
        truncation_mode (`str`, defaults to `"keep_start"`):
            `"keep_start"` keeps the first `max_length` tokens, `"keep_end"` the last ones.
        pad_to_multiple_of (`int` or `None`, defaults to `None`):
            Pad the sequence length to a multiple of this value.
        return_tensors (`str`, defaults to `"pt"`):
            Only `"pt"` is supported.
        include_reference (`bool`, defaults to `True`):
            Add the `prompt + reference` rows (the trainer leaves them out when `tpo_alpha == 0`).

    Returns:
        `input_ids`, `attention_mask` and `completion_mask` (1 on completion tokens), each `(2n, T)` or `(3n, T)`.

    Example:
    ```python
    >>> collator = DataCollatorForTriplePreference(pad_token_id=0)
    >>> batch = collator([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5], "reference_ids": [6]}])
    >>> batch["input_ids"]
    tensor([[1, 2, 3, 0],
            [1, 2, 4, 5],
            [1, 2, 6, 0]])
    ```
    """

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"
    include_reference: bool = True

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.return_tensors != "pt":
            raise ValueError(f"Only return_tensors='pt' is supported; got {self.return_tensors!r}.")
        keys = ("chosen_ids", "rejected_ids", "reference_ids") if self.include_reference else _TOKENIZED_COLUMNS[1:3]
        return collate_prompt_completions(
            [example["prompt_ids"] for example in examples] * len(keys),
            [example[key] for key in keys for example in examples],
            self.pad_token_id,
            self.max_length,
            self.truncation_mode,
            self.pad_to_multiple_of,
        )


class TPOTrainer(_PreferenceTrainer):
    """Trainer for Triple Preference Optimization (TPO).

    TPO learns from triples: a preferred (`chosen`) and a dispreferred (`rejected`) completion, as in DPO, plus a gold
    `reference` completion. Its loss is a reference-free preference term on the policy's own log-probabilities of
    chosen and rejected (sigmoid, hinge, IPO or the length-normalised TPO-L) plus `tpo_alpha` times the cross-entropy
    of the gold completion, so one stage does what SFT followed by DPO would. No reference model is loaded: the three
    sequences of each example go through the policy in one forward pass (their shared prompt once, when the model
    supports it).

    Example:

    ```python
    from datasets import Dataset

    from trl.assets import get_model_path
    from trl.experimental.tpo import TPOConfig, TPOTrainer

    dataset = Dataset.from_dict(
        {"prompt": ["2 + 2 ="], "chosen": [" 4"], "rejected": [" 5"], "reference": [" 4, since 2 + 2 = 4"]}
    )
    trainer = TPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=TPOConfig(output_dir="tpo-out", max_steps=5),
        train_dataset=dataset,
    )
    trainer.train()
    ```

    Args:
        model (`str`, `PreTrainedModel` or `PeftModel`):
            Causal language model to train, or a path / hub id loaded with `args.model_init_kwargs`.
        args (`TPOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `TPOConfig(f"{model_name}-TPO")`.
        data_collator (`Callable` or `None`, defaults to `None`):
            Batch collator. Defaults to [`DataCollatorForTriplePreference`]; a custom one must return the same keys
            (chosen rows, then rejected rows, then reference rows unless `tpo_alpha == 0`).
        train_dataset (`Dataset` or `IterableDataset`):
            Triples: `chosen`, `rejected`, `reference` and an optional `prompt` (otherwise the shared beginning of
            chosen and rejected, which must also begin `reference`), standard or conversational, with optional
            `tools` and `chat_template_kwargs` columns; or pre-tokenized `prompt_ids`, `chosen_ids`, `rejected_ids`,
            `reference_ids`.
        eval_dataset (`Dataset`, `IterableDataset`, dict of them or `None`, defaults to `None`):
            Evaluation data in the same formats.
        processing_class (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            Tokenizer; loaded from the model's path when omitted (a missing pad token is set to the eos token).
            Text only: another processing class is refused.
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Metric function for evaluation; it receives the policy's logits over each batch's padded rows as
            predictions and their token ids as labels.
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration; the model is wrapped with `peft.get_peft_model`.
    """

    _tag_names = ["trl", "tpo"]
    _name = "TPO"
    _quantized_base = AS_LOADED
    _template_file = "lm_model_card.md"
    _paper = {
        "title": "Triple Preference Optimization: Achieving Better Alignment using a Single Step Optimization",
        "id": "2405.16681",
        "citation": (
            "@misc{saeidi2025triplepreferenceoptimizationachieving,\n"
            "    title        = {{Triple Preference Optimization: Achieving Better Alignment using a Single Step "
            "Optimization}},\n"
            "    author       = {Amir Saeidi and Shivanshu Verma and Aswin RRV and Kashif Rasul and Chitta Baral},\n"
            "    year         = 2025,\n"
            "    eprint       = {2405.16681},\n"
            "    archivePrefix= {arXiv},\n"
            "    primaryClass = {cs.CL},\n"
            "    url          = {https://arxiv.org/abs/2405.16681},\n"
            "}"
        ),
    }

    def __init__(
        self,
        model: "str | PreTrainedModel | nn.Module",
        args: TPOConfig | None = None,
        data_collator: Callable[[list[Any]], dict[str, Any]] | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        peft_config: Any = None,
    ):
        if args is None:
            args = self._default_args(TPOConfig, model)
        elif not isinstance(args, TPOConfig):
            raise TypeError(f"TPOTrainer needs args of type TPOConfig; got {type(args).__name__}.")
        self._check_train_dataset(train_dataset, "TPOTrainer")
        self._prepare_iterable_args(args, train_dataset)
        self._check_reference_options(args, "TPOTrainer")
        if args.loss_type in ("hinge", "ipo") and args.label_smoothing > 0:
            warnings.warn(
                f"loss_type={args.loss_type!r} does not use label smoothing; label_smoothing={args.label_smoothing} "
                "is ignored. Set label_smoothing=0.0 to silence this warning.",
                UserWarning,
                stacklevel=2,
            )

        # ---- Model, tokenizer, PEFT (no reference model: TPO needs none) ---------------------------------------
        if processing_class is not None:
            _check_tokenizer(processing_class)
        model, processing_class, tokenizer = self._load_policy(model, None, processing_class, args, peft_config)
        _check_tokenizer(processing_class)
        if args.disable_dropout:
            disable_dropout_in_model(model)
        self.pad_token_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
        self._layout = self._choose_layout(model, False)
        # The rows of one example share their prompt: run it once (see `supports_prefix_sharing`).
        self._share_prefix = not self._aux_loss_enabled and supports_prefix_sharing(model)
        self._include_reference = args.tpo_alpha != 0
        if data_collator is None:
            data_collator = DataCollatorForTriplePreference(
                pad_token_id=self.pad_token_id,
                max_length=args.max_length,
                truncation_mode=args.truncation_mode,
                pad_to_multiple_of=args.pad_to_multiple_of,
                include_reference=self._include_reference,
            )

        # ---- Datasets ------------------------------------------------------------------------------------------
        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")
        eval_dataset = self._prepare_eval_datasets(
            eval_dataset, lambda dataset, name: self._prepare_dataset(dataset, processing_class, args, name)
        )
        self._init_trainer(
            None,
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._add_model_tags(self.model)

    # ------------------------------------------------------------------------------------------------------------
    # Dataset preparation
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """A dataset given to `evaluate()`, prepared as the constructor's `eval_dataset` (unchanged when already
        tokenized)."""
        return self._prepare_dataset(dataset, self.processing_class, self.args, name)

    def _prepare_dataset(
        self, dataset: Dataset | IterableDataset, processing_class: Any, args: TPOConfig, dataset_name: str
    ) -> Dataset | IterableDataset:
        dataset, first, columns, map_kwargs, is_iterable = self._open_dataset(
            dataset,
            args,
            dataset_name,
            {},
            f"The {dataset_name} dataset is empty; TPOTrainer needs at least one triple.",
        )
        if all(c in columns for c in _TOKENIZED_COLUMNS):
            tokenized = dataset
        else:
            if "chosen" not in columns or "rejected" not in columns:
                raise ValueError(
                    f"TPO needs triple-preference data with 'chosen', 'rejected' and 'reference' columns, but the "
                    f"{dataset_name} dataset is missing 'chosen' or 'rejected'. Got columns: {columns}."
                )
            if "reference" not in columns:
                raise ValueError(
                    f"TPO needs triple-preference data with 'chosen', 'rejected' and 'reference' columns, but the "
                    f"{dataset_name} dataset is missing the 'reference' (gold) column. Got columns: {columns}."
                )
            conversational = is_conversational(first)
            if conversational:
                self._check_chat_template(processing_class, dataset_name)
            if "prompt" not in columns:
                dataset = dataset.map(
                    _extract_triple_prompt,
                    **map_kwargs_with_desc(map_kwargs, f"Extracting prompt in {dataset_name}"),
                )
            tokenize = _TripleTokenizer(processing_class, conversational)
            tokenized = dataset.map(tokenize, **map_kwargs_with_desc(map_kwargs, f"Tokenizing {dataset_name}"))

        # As in TRL, triples left without a chosen or rejected token by truncation are kept (their log-probs are
        # 0); a warning says how many there are.
        if not is_iterable:
            keep_fn = _HasPreferenceTargets(args.max_length, args.truncation_mode)
            lengths = zip(tokenized["prompt_ids"], tokenized["chosen_ids"], tokenized["rejected_ids"])
            empty = sum(not keep_fn.check(len(p), len(c), len(r)) for p, c, r in lengths)
            if empty:
                logger.warning(
                    "%d of %d %s triples keep no chosen or rejected completion token within max_length=%s "
                    "(truncation_mode=%r); they add nothing to the preference term.",
                    empty,
                    len(tokenized),
                    dataset_name,
                    args.max_length,
                    args.truncation_mode,
                )
        return tokenized

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(_TOKENIZED_COLUMNS)

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    def _triple_groups(self, rows: int) -> list[list[int]]:
        """Rows of one example (chosen, rejected and reference rows sit `n` apart)."""
        parts = 3 if self._include_reference else 2
        n = rows // parts
        return [[row + k * n for k in range(parts)] for row in range(n)]

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        args = self.args
        mode = self._mode
        rows = inputs["input_ids"].shape[0]
        n = rows // (3 if self._include_reference else 2)
        target_mask = self._target_mask(inputs)
        groups = self._triple_groups(rows) if self._share_prefix else None
        policy = self._token_logps(model, inputs, self._layout, with_stats=True, prefix_groups=groups)
        token_logps = policy.logps.float()
        mask = target_mask.to(token_logps.dtype)
        sums, counts = (token_logps * mask).sum(dim=1), mask.sum(dim=1)
        if args.loss_type in _LENGTH_NORMALIZED_LOSSES:
            sequence_logps = sums / counts.clamp(min=1)
        else:
            sequence_logps = sums
        chosen_logps, rejected_logps = sequence_logps[:n], sequence_logps[n : 2 * n]
        losses, chosen_rewards, rejected_rewards = tpo_loss(
            chosen_logps,
            rejected_logps,
            loss_type=args.loss_type,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            tpo_l_gamma=args.tpo_l_gamma,
        )
        loss = losses.mean()
        if self._include_reference:
            # Token-mean cross-entropy of the gold completions of the batch.
            reference_tokens = mask[2 * n :].sum()
            nll = -(token_logps[2 * n :] * mask[2 * n :]).sum() / reference_tokens.clamp(min=1)
            loss = loss + args.tpo_alpha * nll
        aux_loss = getattr(policy.outputs, "aux_loss", None) if self._aux_loss_enabled else None
        if aux_loss is not None:
            loss = loss + self._aux_loss_coef * aux_loss

        with torch.no_grad():
            chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
            chosen_mask, rejected_mask = mask[:n], mask[n : 2 * n]
            mean_logit = policy.stats["mean_logit"]
            means = {
                "rewards/chosen": chosen_rewards.mean(),
                "rewards/rejected": rejected_rewards.mean(),
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                "logps/chosen": chosen_logps.detach().mean(),
                "logps/rejected": rejected_logps.detach().mean(),
            }
            if aux_loss is not None:
                means["aux_loss"] = aux_loss.detach().float()
            ratios = {
                "entropy": ((policy.entropy.float() * mask).sum(), mask.sum()),
                "logits/chosen": ((mean_logit[:n] * chosen_mask).sum(), chosen_mask.sum()),
                "logits/rejected": ((mean_logit[n : 2 * n] * rejected_mask).sum(), rejected_mask.sum()),
                "mean_token_accuracy": ((policy.stats["correct"][:n] * chosen_mask).sum(), chosen_mask.sum()),
            }
            self._record_batch_metrics(mode, means=means, ratios=ratios, num_tokens=inputs["attention_mask"].sum())
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss


def _check_tokenizer(processing_class: Any) -> None:
    if not isinstance(processing_class, PreTrainedTokenizerBase):
        raise TypeError(
            "TPOTrainer trains on text only and needs a tokenizer (PreTrainedTokenizerBase) as processing_class; got "
            f"{type(processing_class).__name__}. Pass processing_class=AutoTokenizer.from_pretrained(...)."
        )


# ----------------------------------------------------------------------------------------------------------------
# Dataset-map helpers (picklable, so that `dataset_num_proc` works)
# ----------------------------------------------------------------------------------------------------------------
def _extract_triple_prompt(example: dict[str, Any]) -> dict[str, Any]:
    """The shared beginning of `chosen` and `rejected` as `prompt`, removed from all three completions; `reference`
    must begin with it too."""
    extracted = extract_prompt({"chosen": example["chosen"], "rejected": example["rejected"]})
    prompt, reference = extracted["prompt"], example["reference"]
    if reference[: len(prompt)] != prompt:
        raise ValueError(
            "The `reference` completion does not start with the implicit prompt extracted from `chosen`/`rejected` "
            f"({str(prompt)[:200]!r}). Add an explicit `prompt` column, or make the `reference` completion start with "
            "the same prompt as `chosen` and `rejected`."
        )
    return {**extracted, "reference": reference[len(prompt) :]}


class _TripleTokenizer:
    """Turns one `{prompt, chosen, rejected, reference}` example into `prompt_ids` and the three completion id lists
    (see `PromptCompletionTokenizer`: each sequence is tokenized whole and split at the prompt they all share)."""

    def __init__(self, processing_class: Any, conversational: bool):
        self.tokenize = PromptCompletionTokenizer(processing_class, conversational)

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        prompt_ids, completion_ids = self.tokenize(
            example, example.get("prompt"), [example[key] for key in _COMPLETIONS], ("prompt", *_COMPLETIONS)
        )
        output: dict[str, Any] = {"prompt_ids": prompt_ids}
        output.update({f"{key}_ids": ids for key, ids in zip(_COMPLETIONS, completion_ids)})
        # The kept text columns show the completions as tokenized: with the EOS token appended.
        eos = self.tokenize.tokenizer.eos_token
        if not self.tokenize.conversational and eos:
            for key in _COMPLETIONS:
                if isinstance(example[key], str) and not example[key].endswith(eos):
                    output[key] = example[key] + eos
        return output


class _HasPreferenceTargets:
    """Whether the chosen and the rejected completion of a triple keep at least one scored token after truncation."""

    def __init__(self, max_length: int | None, mode: str):
        self.max_length = max_length
        self.mode = mode

    def check(self, prompt_len: int, chosen_len: int, rejected_len: int) -> bool:
        return all(
            scored_completion_tokens(prompt_len, length, self.max_length, self.mode) > 0
            for length in (chosen_len, rejected_len)
        )
