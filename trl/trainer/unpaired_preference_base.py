"""The machinery every unpaired-preference trainer shares ([`KTOTrainer`], the experimental `BCOTrainer`).

Each example is a prompt, one completion and a boolean label (True = desirable). [`_UnpairedPreferenceTrainer`] adds
to [`_PreferenceTrainer`]: dataset preparation (unpairing of paired data, tokenization, label checks, the mismatched
"KL" completions), the policy / reference log-probability passes and the per-class metrics (TRL's per-batch means for
KTO, interval-wide sums and counts for BCO);
[`DataCollatorForUnpairedPreference`] collates the tokenized examples (it is also importable from
`trl.trainer.kto_trainer`, its public path).
"""

import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from datasets import Dataset, IterableDataset, Value

from ..data_utils import get_dataset_column_names, is_conversational, maybe_extract_prompt, unpair_preference_dataset
from .preference_base import _PreferenceTrainer
from .utils import (
    PromptCompletionTokenizer,
    collate_prompt_completions,
    common_packed_width,
    map_kwargs_with_desc,
    packed_sequence_logps_in_one_pass,
    scored_completion_tokens,
)
from .utils.forward_randomness import forward_is_deterministic
from .utils.vision import VISION_INPUT_KEYS


logger = logging.getLogger(__name__)

# Columns of a tokenized unpaired dataset (the collator's input).
_TOKENIZED_COLUMNS = ("prompt_ids", "completion_ids", "label")
# Completion of another example paired with this example's prompt, for the KL reference point (TRL's spelling).
_KL_COLUMN = "KL_completion_ids"
# Batch keys of the KL sequences (`prompt + KL completion`), collated apart from the main sequences.
_KL_PREFIX = "KL_"
# Precomputed reference log-probs of the completion and of the KL completion.
_REF_COLUMNS = ("ref_logps", "ref_KL_logps")
# Column names used by older TRL releases for pre-tokenized data, renamed on the way in.
_LEGACY_TOKENIZED_COLUMNS = {
    "prompt_input_ids": "prompt_ids",
    "completion_input_ids": "completion_ids",
    "answer_input_ids": "completion_ids",
}
# Weighted desirable:undesirable ratio recommended by the KTO authors.
_RECOMMENDED_RATIO = (1.0, 4.0 / 3.0)
# Rows of paired data unpaired per `map` batch (each batch is then re-interleaved chosen/rejected).
_UNPAIR_BATCH_SIZE = 1000


# ----------------------------------------------------------------------------------------------------------------
# Collator
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class DataCollatorForUnpairedPreference:
    """Collate tokenized unpaired examples (and their KL sequences) into right-padded batches.

    Each example is a dict with `prompt_ids`, `completion_ids` (lists of token ids) and a boolean `label`, and
    optionally `KL_completion_ids` (the completion of another example, scored after this example's prompt to estimate
    the KL reference point of KTO) and precomputed reference log-probs `ref_logps` / `ref_KL_logps`. Whether the
    optional keys are collated is decided by the first example.

    Returned keys: `input_ids`, `attention_mask`, `completion_mask` (1 on completion tokens) of the sequences
    `prompt + completion`; when the examples have `KL_completion_ids`, `KL_input_ids`, `KL_attention_mask` and
    `KL_completion_mask` of the sequences `prompt + KL completion` (padded on their own); `ref_logps` / `ref_KL_logps`
    (`(n,)` float) when present; and `label` (`(n,)` bool).

    Args:
        pad_token_id (`int`):
            Token used to pad `input_ids`.
        max_length (`int` or `None`, defaults to `None`):
            Keep only the first `max_length` tokens of every sequence.
        pad_to_multiple_of (`int` or `None`, defaults to `None`):
            Pad the sequence length to a multiple of this value.
        return_tensors (`str`, defaults to `"pt"`):
            Only `"pt"` is supported.

    Example:
    ```python
    >>> collator = DataCollatorForUnpairedPreference(pad_token_id=0)
    >>> batch = collator([{"prompt_ids": [1, 2], "completion_ids": [3], "label": True, "KL_completion_ids": [4, 5]}])
    >>> batch["input_ids"], batch["KL_input_ids"]
    (tensor([[1, 2, 3]]), tensor([[1, 2, 4, 5]]))
    >>> batch["KL_completion_mask"]
    tensor([[0, 0, 1, 1]])
    >>> batch["label"]
    tensor([True])
    ```
    """

    pad_token_id: int
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.return_tensors != "pt":
            raise ValueError(f"Only return_tensors='pt' is supported; got {self.return_tensors!r}.")
        first = examples[0] if examples else {}
        prompts = [example["prompt_ids"] for example in examples]
        batch = self._collate(prompts, [example["completion_ids"] for example in examples])
        if _KL_COLUMN in first:
            kl_batch = self._collate(prompts, [example[_KL_COLUMN] for example in examples])
            batch.update({_KL_PREFIX + key: value for key, value in kl_batch.items()})
        for key in _REF_COLUMNS:
            if key in first:
                batch[key] = torch.tensor([float(example[key]) for example in examples], dtype=torch.float32)
        batch["label"] = torch.tensor([bool(example["label"]) for example in examples], dtype=torch.bool)
        return batch

    def _collate(self, prompts: list[list[int]], completions: list[list[int]]) -> dict[str, torch.Tensor]:
        return collate_prompt_completions(
            prompts, completions, self.pad_token_id, self.max_length, pad_to_multiple_of=self.pad_to_multiple_of
        )


# ----------------------------------------------------------------------------------------------------------------
# Shared machinery of the unpaired-preference trainers (KTO, BCO)
# ----------------------------------------------------------------------------------------------------------------
class PolicyPass(NamedTuple):
    """Policy outputs of an unpaired batch (only the `n` main rows; KL rows reduced to their sums)."""

    logps: torch.Tensor  # (n,) summed completion log-probs, with gradient
    kl_logps: torch.Tensor | None  # (n,) summed log-probs of the KL completions, detached
    target_mask: torch.Tensor  # (n, T - 1) scored positions of the main rows
    entropy: torch.Tensor | None  # (n, T - 1)
    mean_logit: torch.Tensor | None  # (n, T - 1)
    outputs: Any  # raw model outputs (aux_loss of MoE models)


_SEQUENCE_KEYS = ("input_ids", "attention_mask", "completion_mask")


def _image_inputs(inputs: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Image entries of a batch (vision datasets): the KL rows share the prompt's pixel values, but have their own
    per-token image ids (`KL_mm_token_type_ids`, ...)."""
    out = {}
    for key in VISION_INPUT_KEYS:
        source = prefix + key if key.endswith("token_type_ids") else key
        if source in inputs:
            out[key] = inputs[source]
    return out


def _kl_rows(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The KL sequences of a collated batch (`KL_input_ids`, ... under their plain names), or None."""
    if _KL_PREFIX + "input_ids" not in inputs:
        return None
    return {**{key: inputs[_KL_PREFIX + key] for key in _SEQUENCE_KEYS}, **_image_inputs(inputs, _KL_PREFIX)}


def _main_rows(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**{key: inputs[key] for key in _SEQUENCE_KEYS}, **_image_inputs(inputs, "")}


def _stack_rows(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows of two collated sequence batches in one batch, right-padded to the wider one (pads are masked)."""
    width = max(first["input_ids"].shape[1], second["input_ids"].shape[1])
    return {
        key: torch.cat(
            [nn.functional.pad(part[key], (0, width - part[key].shape[1]), value=0) for part in (first, second)]
        )
        for key in _SEQUENCE_KEYS
    }


def _keys_values_capturable_once_switched(model: nn.Module) -> bool:
    """Whether `model` will attend through the key/value-recording attention function while training (it attends
    with SDPA, or already with that function) over full-attention layers, with a head the fused LM head replaces."""
    from ..models.utils import _base_transformers_model
    from .fast_paths.prefix_sharing import PACKED_SDPA, supports_prefix_sharing
    from .utils.packing import packed_sdpa_applicable

    implementation = getattr(getattr(_base_transformers_model(model), "config", None), "_attn_implementation", None)
    switchable = packed_sdpa_applicable(model) or implementation == PACKED_SDPA
    return switchable and supports_prefix_sharing(model)


class _UnpairedPreferenceTrainer(_PreferenceTrainer):
    """Private base of [`KTOTrainer`] and the experimental `BCOTrainer`: unpaired data, log-probs, metrics.

    A subclass sets, before `Trainer.__init__`: `pad_token_id`, `_layout`, `_ref_layout`, `_needs_kl`,
    `_ref_adapter_name`, `_aux_loss_enabled`, `_aux_loss_coef`; and afterwards `ref_model`.
    """

    _needs_kl: bool = False
    _ref_adapter_name: str | None = None
    # Whether the prepared datasets keep the raw columns (`prompt`, `completion`, ...) beside the token ids, as TRL's
    # KTO trainer does.
    _keep_raw_columns: bool = False
    # Whether unpaired-from-paired rows are re-interleaved (chosen, rejected, chosen, ...); see `_unpair`.
    _interleave_unpaired: bool = True
    # Whether the policy scores the KL sequences in the same (gradient) forward as the main sequences. That saves a
    # model call, but the backward pass then also spans the KL tokens (with zero gradient) and keeps their
    # activations: `benchmarks/bench_kto.py --ab` measured it 20-25% slower per step (and with a higher peak memory)
    # than a separate no-grad forward of the KL rows on an idle CPU (0.6M and 28M models). It only won on a heavily
    # oversubscribed machine, where fewer, larger calls matter more than FLOPs. Set True on a trainer to use it.
    _kl_in_policy_forward: bool = False
    # Whether the reference scores main and KL sequences in one forward (packed layouts, no images). Each part is
    # packed on its own, as in the policy's KL pass, before their rows are stacked: the KL estimate stays exactly 0
    # while policy == reference (stacking the padded parts and packing them together gave ~1e-7 instead: other rows,
    # widths and summation orders than the policy's KL pass).
    _kl_in_reference_forward: bool = True
    # Whether the KL rows (same prompt as the main row, another completion) are scored from the main rows' prompt
    # keys/values, recorded during their forward pass (so also under gradient checkpointing), by the policy and the
    # reference alike (set by a subclass whose models support it; `_kl_prefix_fallback_reason` decides per batch).
    _share_kl_prefix: bool = False

    # ------------------------------------------------------------------------------------------------------------
    # Dataset preparation
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_dataset(
        self,
        dataset: Dataset | IterableDataset,
        processing_class: Any,
        args: Any,
        dataset_name: str,
    ) -> Dataset | IterableDataset:
        """Tokenize an unpaired (or paired, then unpaired) dataset and attach the KL completions when needed (TRL's
        hook and signature)."""
        if self._is_vision_dataset:  # the vision collator renders and processes the raw rows (KL rows included)
            return dataset
        trainer_name = type(self).__name__
        dataset, first, columns, map_kwargs, is_iterable = self._open_dataset(
            dataset,
            args,
            dataset_name,
            _LEGACY_TOKENIZED_COLUMNS,
            f"The {dataset_name} dataset is empty; {trainer_name} needs at least one example.",
        )
        if all(c in columns for c in _TOKENIZED_COLUMNS):
            self._check_labels(dataset, first, dataset_name)
            tokenized = dataset
        else:
            if "chosen" in columns and "rejected" in columns:
                dataset, first = self._unpair(dataset, map_kwargs, dataset_name, self._interleave_unpaired)
                columns = list(get_dataset_column_names(dataset) or first.keys())
            missing = [c for c in ("prompt", "completion", "label") if c not in columns]
            if missing:
                hint = (
                    " Unpaired data needs an explicit prompt: put the shared beginning of each conversation or text "
                    "in a 'prompt' column and the rest in 'completion'."
                    if missing == ["prompt"]
                    else ""
                )
                raise ValueError(
                    f"The {dataset_name} dataset has columns {columns}, but {trainer_name} needs unpaired preference "
                    f"data with 'prompt', 'completion' and a boolean 'label' column (missing: {missing}), paired "
                    "preference data ('chosen', 'rejected' and optionally 'prompt'), or pre-tokenized "
                    f"'prompt_ids', 'completion_ids' and 'label'.{hint}"
                )
            self._check_labels(dataset, first, dataset_name)
            conversational = is_conversational(first)
            if conversational:
                self._check_chat_template(processing_class, dataset_name)
            keep = {"label", *_REF_COLUMNS}
            remove = [] if self._keep_raw_columns else [c for c in columns if c not in keep]
            tokenized = dataset.map(
                _UnpairedTokenizer(processing_class, conversational),
                remove_columns=remove,
                **map_kwargs_with_desc(map_kwargs, f"Tokenizing {dataset_name}"),
            )

        tokenized = self._drop_examples_without_targets(tokenized, args.max_length, dataset_name, is_iterable)
        if self._needs_kl and _KL_COLUMN not in (get_dataset_column_names(tokenized) or []):
            # One process, so that the chunks are consecutive batch-sized slices of the whole dataset.
            desc = {} if is_iterable else {"desc": f"Pairing KL completions in {dataset_name}"}
            kl_chunk_size = self._kl_chunk_size(args, dataset_name)
            tokenized = tokenized.map(_KLCompletions(), batched=True, batch_size=kl_chunk_size, **desc)
        return tokenized

    @staticmethod
    def _kl_chunk_size(args: Any, dataset_name: str) -> int:
        """Rows per chunk whose completions are rotated by one to form the mismatched KL pairs: a training or an
        evaluation batch, as TRL pairs them."""
        return args.per_device_train_batch_size if dataset_name == "train" else args.per_device_eval_batch_size

    @staticmethod
    def _unpair(
        dataset: Any, map_kwargs: dict[str, Any], dataset_name: str, interleave: bool = True
    ) -> tuple[Any, dict[str, Any]]:
        """Paired -> unpaired (chosen: label True, rejected: False).

        `unpair_preference_dataset` writes, per map batch of 1000 pairs, all chosen rows then all rejected rows (as
        TRL's KTO trainer keeps them, `interleave=False`); with `interleave=True` the rows are re-interleaved, each
        chosen row followed by its rejected row, so that a sequential sampler does not give batches of one label.
        """
        dataset = dataset.map(
            maybe_extract_prompt, **map_kwargs_with_desc(map_kwargs, f"Extracting prompt in {dataset_name}")
        )
        if isinstance(dataset, IterableDataset):
            # A streaming map batch of one pair keeps chosen and rejected next to each other.
            dataset = unpair_preference_dataset(dataset, batch_size=1)
        elif not interleave:
            dataset = unpair_preference_dataset(
                dataset, batch_size=_UNPAIR_BATCH_SIZE, desc=f"Unpairing {dataset_name}"
            )
        else:
            num_pairs = len(dataset)
            # One process: the re-interleaving below relies on map batches of exactly `_UNPAIR_BATCH_SIZE` pairs,
            # which sharding over `num_proc` processes would break (unpairing is cheap anyway).
            dataset = unpair_preference_dataset(
                dataset, batch_size=_UNPAIR_BATCH_SIZE, desc=f"Unpairing {dataset_name}"
            )
            order = []
            for start in range(0, num_pairs, _UNPAIR_BATCH_SIZE):
                size = min(_UNPAIR_BATCH_SIZE, num_pairs - start)
                for i in range(size):
                    order.extend((2 * start + i, 2 * start + size + i))
            dataset = dataset.select(order)
        return dataset, next(iter(dataset))

    @staticmethod
    def _check_labels(dataset: Any, first: dict[str, Any], dataset_name: str) -> None:
        feature = (getattr(dataset, "features", None) or {}).get("label")
        if feature is not None:
            ok = isinstance(feature, Value) and feature.dtype == "bool"
            found = getattr(feature, "dtype", type(feature).__name__)
        else:
            ok = isinstance(first.get("label"), bool)
            found = type(first.get("label")).__name__
        if not ok:
            raise ValueError(
                f"The 'label' column of the {dataset_name} dataset must hold booleans (True = desirable, False = "
                f"undesirable); found {found} values such as {first.get('label')!r}. Convert it, e.g. "
                "dataset.cast_column('label', datasets.Value('bool')) for 0/1 integers."
            )

    def _drop_examples_without_targets(
        self, dataset: Any, max_length: int | None, dataset_name: str, is_iterable: bool
    ) -> Any:
        """Remove examples whose prompt fills `max_length`, leaving no completion token to train on."""
        if is_iterable:
            return dataset.filter(
                lambda ex: scored_completion_tokens(len(ex["prompt_ids"]), len(ex["completion_ids"]), max_length) > 0
            )
        flags = [
            scored_completion_tokens(len(p), len(c), max_length) > 0
            for p, c in zip(dataset["prompt_ids"], dataset["completion_ids"])
        ]
        shortest = min(len(p) for p in dataset["prompt_ids"])
        none_left = (
            f"No {dataset_name} example has a completion token left to train on: with max_length={max_length}, every "
            f"prompt fills the whole length (the shortest prompt is {shortest} tokens, expected fewer than "
            "max_length) or a completion is empty. Raise max_length or shorten the prompts."
        )
        return self._keep_flagged(dataset, flags, dataset_name, "examples", max_length, none_left)

    @staticmethod
    def _warn_if_unbalanced(dataset: Any, desirable_weight: float, undesirable_weight: float) -> None:
        """Warn about data with a single label (TRL trains on it) and when the weighted desirable:undesirable ratio
        leaves the [1, 4/3] band, suggesting weights."""
        if not isinstance(dataset, Dataset):
            return
        labels = dataset["label"]
        num_desirable = sum(1 for label in labels if label)
        num_undesirable = len(labels) - num_desirable
        if num_desirable == 0 or num_undesirable == 0:
            present, missing = ("desirable", "undesirable") if num_undesirable == 0 else ("undesirable", "desirable")
            warnings.warn(
                f"The training dataset holds only {present} examples ({len(labels)} with label="
                f"{num_undesirable == 0}) and no {missing} one, so the loss can only push in one direction. Training "
                f"goes on as in TRL; add {missing} examples (label={num_undesirable != 0}), or pass paired preference "
                "data (prompt/chosen/rejected), which gives one example of each label per pair.",
                UserWarning,
                stacklevel=3,
            )
            return
        if num_desirable == num_undesirable:
            return
        ratio = desirable_weight * num_desirable / (undesirable_weight * num_undesirable)
        low, high = _RECOMMENDED_RATIO
        if low <= ratio <= high:
            return
        # Either weight alone can bring the ratio back into the band.
        undesirable_range = (
            desirable_weight * num_desirable / (high * num_undesirable),
            desirable_weight * num_desirable / (low * num_undesirable),
        )
        desirable_range = (
            low * undesirable_weight * num_undesirable / num_desirable,
            high * undesirable_weight * num_undesirable / num_desirable,
        )
        warnings.warn(
            f"The training data has {num_desirable} desirable and {num_undesirable} undesirable examples; with "
            f"desirable_weight={desirable_weight} and undesirable_weight={undesirable_weight} the weighted "
            f"desirable:undesirable ratio is {ratio:.3f}, outside the recommended range [1, 4/3]. Set "
            f"undesirable_weight between {undesirable_range[0]:.3f} and {undesirable_range[1]:.3f}, or "
            f"desirable_weight between {desirable_range[0]:.3f} and {desirable_range[1]:.3f}.",
            UserWarning,
            stacklevel=3,
        )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = [
                *_TOKENIZED_COLUMNS,
                _KL_COLUMN,
                *_REF_COLUMNS,
                *self._extra_signature_columns(),
            ]
            if self._is_vision_dataset:
                self._signature_columns += ["prompt", "completion", "label", "images", "image"]

    def _extra_signature_columns(self) -> list[str]:
        return []

    # ------------------------------------------------------------------------------------------------------------
    # Log-probabilities
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _sums(token_logps: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
        return (token_logps.float() * target_mask).sum(dim=1)

    def _policy_pass(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> PolicyPass:
        """Policy log-probs of the main sequences (with gradient) and of the KL sequences (detached), when used."""
        main = _main_rows(inputs)
        # (A batch may carry KL rows the loss does not use, e.g. `kto`-prepared data trained with `apo_zero_unpaired`.)
        kl_rows = _kl_rows(inputs) if self._needs_kl else None
        if kl_rows is not None and self._kl_from_cached_prefix(inputs, main, kl_rows):
            result = self._prefix_cached_logps(model, main, kl_rows, with_stats=True, layout=self._layout)
            target_mask = self._target_mask(main)
            return PolicyPass(
                logps=self._sums(result.main.logps, target_mask),
                kl_logps=self._sums(result.continuation_logps, self._target_mask(kl_rows)),
                target_mask=target_mask,
                entropy=result.main.entropy,
                mean_logit=result.main.stats["mean_logit"],
                outputs=result.main.outputs,
            )
        if kl_rows is not None and self._kl_in_policy_forward:
            # One forward over main + KL rows (packed together when the attention allows it).
            n = main["input_ids"].shape[0]
            both = _stack_rows(main, kl_rows)
            result = self._token_logps(model, both, self._layout, with_stats=True)
            target_mask = self._target_mask(both)
            sums = self._sums(result.logps, target_mask)
            return PolicyPass(
                logps=sums[:n],
                kl_logps=sums[n:].detach(),
                target_mask=target_mask[:n],
                entropy=result.entropy[:n],
                mean_logit=result.stats["mean_logit"][:n],
                outputs=result.outputs,
            )
        # Rows as wide as in the reference's single pass over main + KL rows, so that the policy's values are the
        # reference's bit for bit while the two are equal (rewards and KL estimate exactly 0 at the first step).
        width = {}
        if kl_rows is not None and self._kl_in_one_pass(inputs, self._layout):
            masks = [main["attention_mask"], kl_rows["attention_mask"]]
            width["min_width"] = common_packed_width(
                masks, self._layout, getattr(self.args, "pad_to_multiple_of", None)
            )
        kl_logps = None
        if kl_rows is not None:
            # TRL's order: the KL rows first. It matters when the forward draws random numbers (dropout, NEFTune's
            # noise on the embeddings), and the no-grad pass then runs before any activation is kept for the backward.
            with torch.no_grad():
                kl_result = self._token_logps(model, kl_rows, self._layout, with_stats=False, **width)
            kl_logps = self._sums(kl_result.logps, self._target_mask(kl_rows))
        result = self._token_logps(model, main, self._layout, with_stats=True, **width)
        target_mask = self._target_mask(main)
        return PolicyPass(
            logps=self._sums(result.logps, target_mask),
            kl_logps=kl_logps,
            target_mask=target_mask,
            entropy=result.entropy,
            mean_logit=result.stats["mean_logit"],
            outputs=result.outputs,
        )

    def compute_ref_log_probs(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Reference log-probabilities of the completions (and KL completions) of a collated batch.

        The reference is the reference model, the PEFT policy with its adapters disabled or, while precomputing
        before training, the untrained policy itself. In packed layouts the main and KL sequences go through one
        forward pass, each packed on its own into rows as wide as in the policy's passes (`_policy_pass`), so that
        the KL estimate is exactly 0 while the policy equals the reference; otherwise through two.

        Args:
            model: The policy (used for the PEFT reference and for precomputation).
            inputs: A batch from [`DataCollatorForUnpairedPreference`].

        Returns:
            `{"ref_logps": (n,)}`, plus `"ref_KL_logps": (n,)` when the batch holds KL sequences and the loss uses
            them.
        """
        layout = self._ref_layout if self.ref_model is not None else self._layout
        main = _main_rows(inputs)
        kl_rows = _kl_rows(inputs) if self._needs_kl else None
        n = main["input_ids"].shape[0]
        parts = [main] if kl_rows is None else [main, kl_rows]
        with self._reference_module(model, self._ref_adapter_name) as reference:
            if kl_rows is not None and self._kl_from_cached_prefix(inputs, main, kl_rows):
                result = self._prefix_cached_logps(reference, main, kl_rows, with_stats=False, layout=layout)
                logps = [result.main.logps, result.continuation_logps]
                sums = torch.cat(
                    [self._sums(part_logps, self._target_mask(part)) for part_logps, part in zip(logps, parts)]
                )
            elif kl_rows is not None and self._kl_in_one_pass(inputs, layout):
                logps = self._main_and_kl_logps(reference, main, kl_rows, layout)
                sums = torch.cat(
                    [self._sums(part_logps, self._target_mask(part)) for part_logps, part in zip(logps, parts)]
                )
            else:
                sums = torch.cat(
                    [
                        self._sums(
                            self._token_logps(reference, part, layout, with_stats=False).logps, self._target_mask(part)
                        )
                        for part in parts
                    ]
                )
        out = {"ref_logps": sums[:n]}
        if kl_rows is not None:
            out["ref_KL_logps"] = sums[n:]
        return out

    def _can_share_kl_prefix(self, model: nn.Module, ref_model: nn.Module | None, args: Any) -> bool:
        """Whether `_share_kl_prefix` may be set: both models attend with SDPA (switched to the attention function
        that records keys/values while training, see `_training_kernels`) over full-attention layers only, and
        nothing needs whole-row forwards (MoE router loss, precomputed reference values)."""
        if self._aux_loss_enabled or getattr(args, "precompute_ref_log_probs", False):
            return False
        return all(_keys_values_capturable_once_switched(m) for m in (model, ref_model) if m is not None)

    def _kl_from_cached_prefix(
        self, inputs: dict[str, torch.Tensor], main: dict[str, torch.Tensor], kl_rows: dict[str, torch.Tensor]
    ) -> bool:
        """Whether this batch's KL rows are scored from the main rows' prompt keys/values (`_share_kl_prefix`,
        text-only right-padded rows, models attending through the recording attention function, enough tokens
        saved); a function of the batch and the models, so policy and reference agree."""
        return self._kl_prefix_fallback_reason(inputs, main, kl_rows) is None

    def _kl_prefix_fallback_reason(
        self, inputs: dict[str, torch.Tensor], main: dict[str, torch.Tensor], kl_rows: dict[str, torch.Tensor]
    ) -> str | None:
        """Why this batch's KL rows run as whole rows instead (see `_kl_from_cached_prefix`), or None."""
        from .fast_paths.prefix_sharing import (
            MIN_SHARED_SAVING,
            keys_values_capturable,
            prefix_cached_saving,
            sharing_possible_now,
        )

        if not self._share_kl_prefix:
            return "the trainer does not share KL prefixes (MoE router loss, precomputed reference, attention)"
        if any(key in inputs for key in VISION_INPUT_KEYS):
            return "the batch has images"
        if not forward_is_deterministic(self.model):
            # The KL rows would reuse the main rows' keys/values, drawn with other random numbers than their own pass.
            return "the policy's forward draws random numbers (dropout, NEFTune's noise on the embeddings)"
        if getattr(self, "model_wrapped", self.model) is not self.model or not sharing_possible_now(self.model):
            return "the model is wrapped or sharded for distributed training"
        ref_model = self.ref_model
        if not keys_values_capturable(self.model) or (ref_model is not None and not keys_values_capturable(ref_model)):
            return "a model does not attend through the key/value-recording attention function now"
        if not bool(main["attention_mask"][:, 0].all() and kl_rows["attention_mask"][:, 0].all()):
            return "the rows are not right-padded"
        saving = prefix_cached_saving(
            main["input_ids"],
            main["attention_mask"],
            kl_rows["input_ids"],
            kl_rows["attention_mask"],
            self._target_mask(kl_rows),
            self._layout,
        )
        if saving < MIN_SHARED_SAVING:
            return f"it would save {saving:.0%} of the tokens (less than {MIN_SHARED_SAVING:.0%})"
        return None

    def _prefix_cached_logps(
        self,
        model: nn.Module,
        main: dict[str, torch.Tensor],
        kl_rows: dict[str, torch.Tensor],
        with_stats: bool,
        layout: str,
    ):
        """Main rows' token log-probs (forward pass in `layout`) and the KL rows' (detached), continued from the main
        rows' recorded prompt keys/values."""
        from .fast_paths.prefix_sharing import prefix_cached_token_logps

        self._shared_prefix_passes = self._shared_prefix_passes + 1
        return prefix_cached_token_logps(
            model,
            main["input_ids"],
            main["attention_mask"],
            self._target_mask(main),
            kl_rows["input_ids"],
            kl_rows["attention_mask"],
            self._target_mask(kl_rows),
            layout=layout,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=getattr(self.args, "pad_to_multiple_of", None),
            compute_entropy=with_stats,
            logits_stats_fn=self._logits_stats if with_stats else None,
        )

    def _kl_in_one_pass(self, inputs: dict[str, torch.Tensor], layout: str) -> bool:
        """Whether the reference scores the main and KL rows of `inputs` in one forward pass (packed layouts only,
        batches without images)."""
        return (
            self._kl_in_reference_forward
            and layout in ("packed", "padding_free")
            and not any(key in inputs for key in VISION_INPUT_KEYS)
        )

    def _main_and_kl_logps(
        self, model: nn.Module, main: dict[str, torch.Tensor], kl_rows: dict[str, torch.Tensor], layout: str
    ) -> list[torch.Tensor]:
        """Token log-probs of the main and KL rows in one forward pass (see `packed_sequence_logps_in_one_pass`)."""
        return packed_sequence_logps_in_one_pass(
            model,
            [(part["input_ids"], part["attention_mask"], self._target_mask(part)) for part in (main, kl_rows)],
            layout,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=getattr(self.args, "pad_to_multiple_of", None),
        )

    def _reference_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Precomputed reference values of the batch when present, otherwise computed now."""
        if "ref_logps" in inputs and (not self._needs_kl or "ref_KL_logps" in inputs):
            return {key: inputs[key].float() for key in _REF_COLUMNS if key in inputs}
        rows = [_main_rows(inputs)]
        kl_rows = _kl_rows(inputs) if self._needs_kl else None
        if kl_rows is not None:
            rows.append(kl_rows)
        parts = [(part["input_ids"], part["attention_mask"], part.get("completion_mask")) for part in rows]
        compute = functools.partial(self.compute_ref_log_probs, model, inputs)
        return self._reference_values(model, compute, parts, rows[0]["input_ids"].shape[0])

    def _precompute_columns(self) -> tuple[str, ...]:
        return _REF_COLUMNS if self._needs_kl else _REF_COLUMNS[:1]

    # ------------------------------------------------------------------------------------------------------------
    # Metrics
    # ------------------------------------------------------------------------------------------------------------
    def _record_class_metrics(
        self,
        mode: str,
        label: torch.Tensor,
        logps: torch.Tensor,
        rewards: torch.Tensor,
        policy: PolicyPass,
        means: dict[str, torch.Tensor] | None = None,
        num_tokens: torch.Tensor | None = None,
    ) -> None:
        """Store the batch's metrics as TRL's KTO logs them, each averaged over the batches at log time.

        Per batch (all processes together): `logits/<class>` is the mean logit over every completion token of the
        class's examples (a token-weighted mean), `rewards/<class>` and `logps/<class>` the mean over the class's
        examples of the reward and of the summed completion log-prob; a class absent from the batch records nothing
        for that batch, and `rewards/margins` (`rewards/chosen - rewards/rejected`) is recorded only for batches
        with both classes. `entropy` is the mean over the completion tokens; `means` are averaged over processes.
        """
        means = means or {}
        mask = policy.target_mask.float()
        token_logits = (policy.mean_logit.float() * mask).sum(dim=1)
        token_counts = mask.sum(dim=1)
        values = [torch.as_tensor(v).detach().float().reshape(()) for v in means.values()]
        entropy = policy.entropy.float() if policy.entropy is not None else torch.zeros_like(mask)
        values += [(entropy * mask).sum(), mask.sum()]
        values.append(torch.as_tensor(num_tokens if num_tokens is not None else 0).float().reshape(()))
        for weight in (label.float(), (~label).float()):
            values += [
                weight.sum(),
                (rewards.float() * weight).sum(),
                (logps.float() * weight).sum(),
                (token_logits * weight).sum(),
                (token_counts * weight).sum(),
            ]
        stacked = torch.stack([v.to(self.accelerator.device) for v in values])
        gathered = self.accelerator.gather(stacked.unsqueeze(0)).reshape(-1, stacked.numel())
        averaged, summed = gathered.mean(dim=0).tolist(), gathered.sum(dim=0).tolist()
        metrics = self._metrics[mode]
        for index, name in enumerate(means):
            metrics[name].append(averaged[index])
        index = len(means)
        if policy.entropy is not None:
            metrics["entropy"].append(summed[index] / summed[index + 1] if summed[index + 1] > 0 else float("nan"))
        if num_tokens is not None:
            self._record_num_tokens(mode, summed[index + 2])
        index += 3
        classes = {}
        for split in ("chosen", "rejected"):
            count, reward_sum, logps_sum, logit_sum, token_count = summed[index : index + 5]
            index += 5
            if count > 0:
                classes[split] = (reward_sum / count, logps_sum / count, logit_sum / max(token_count, 1.0))
        for split, (_, _, logit) in classes.items():
            metrics[f"logits/{split}"].append(logit)
        for split, (reward, logp, _) in classes.items():
            metrics[f"rewards/{split}"].append(reward)
            metrics[f"logps/{split}"].append(logp)
        if len(classes) == 2:
            metrics["rewards/margins"].append(classes["chosen"][0] - classes["rejected"][0])


class _UnpairedTokenizer:
    """Turns one `{prompt, completion, label}` example into `prompt_ids` and `completion_ids` (label kept)."""

    def __init__(self, processing_class: Any, conversational: bool):
        self.tokenize = PromptCompletionTokenizer(processing_class, conversational)

    def __call__(self, example: dict[str, Any]) -> dict[str, list[int]]:
        if not isinstance(example["label"], bool):
            raise ValueError(f"The 'label' column must hold booleans (True = desirable); found {example['label']!r}.")
        prompt_ids, (completion_ids,) = self.tokenize(example, example["prompt"], [example["completion"]])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}


class _KLCompletions:
    """Batched map over chunks of a batch's size: each example gets the completion of the previous example of its
    chunk (the first one that of the chunk's last example), TRL's mismatched pairs for the KL reference point."""

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        completions = batch["completion_ids"]
        return {_KL_COLUMN: [list(completion) for completion in completions[-1:] + completions[:-1]]}
