"""Config options that a trainer accepts but that have no effect in a given run, and the warning that says so.

TRL 1.16 accepts these combinations without a word (for example `SFTConfig(completion_only_loss=True)` on plain
`text` data trains on every token). This project keeps them legal, as TRL does, but each trainer checks its table
once, when it is built, and warns about every option the user set that the run will not use, naming the option and
the reason. Combinations that TRL refuses are refused by the trainers themselves, not listed here.

A table is a tuple of [`IgnoredOption`] rows. Trainers pick theirs through the class attribute
`_ignored_options` of [`~trl.trainer.base_trainer._BaseTrainer`]; the facts a condition reads about the run (the
format of the training data, whether an evaluation set was given, ...) come from `_ignored_option_facts()`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any


Facts = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class IgnoredOption:
    """One row of a table: `field` has no effect when `ignored_when(args, facts)` holds.

    Attributes:
        field: Name of the config field.
        ignored_when: Predicate on the config and the run's facts (see `run_facts`).
        reason: Why the field does nothing, completed with `str.format(args=args, facts=facts)`.
        only_if_set: Warn only when the user changed the field from its declared default (a default that does
            nothing is not worth a warning).
    """

    field: str
    ignored_when: Callable[[Any, Facts], bool]
    reason: str
    only_if_set: bool = True


def was_set(args: Any, name: str) -> bool:
    """Whether the user gave `name` a value other than its declared default."""
    recorded = getattr(args, "_fields_set_by_user", None)
    if recorded is not None:
        return name in recorded
    for config_field in dataclasses.fields(args) if dataclasses.is_dataclass(args) else ():
        if config_field.name == name and config_field.default is not dataclasses.MISSING:
            return getattr(args, name, None) != config_field.default
    return False


def ignored_options(args: Any, facts: Facts, table: tuple[IgnoredOption, ...]) -> list[tuple[str, str]]:
    """The `(field, reason)` pairs of `table` that apply to `args` in a run described by `facts` (first row per
    field only; fields the config does not have are skipped)."""
    found: dict[str, str] = {}
    for row in table:
        if row.field in found or not hasattr(args, row.field):
            continue
        if row.only_if_set and not was_set(args, row.field):
            continue
        if row.ignored_when(args, facts):
            found[row.field] = row.reason.format(args=args, facts=facts)
    return list(found.items())


def warn_ignored_options(args: Any, facts: Facts, table: tuple[IgnoredOption, ...], trainer_name: str) -> None:
    """Emit one `UserWarning` per option of `table` that has no effect in this run."""
    for name, reason in ignored_options(args, facts, table):
        warnings.warn(
            f"{trainer_name}: {name}={getattr(args, name)!r} has no effect here: {reason}",
            UserWarning,
            stacklevel=4,
        )


# ---------------------------------------------------------------------------------------------------------------
# Facts and small predicates shared by the tables
# ---------------------------------------------------------------------------------------------------------------
def _losses(args: Any) -> set[str]:
    loss_type = getattr(args, "loss_type", None)
    return set(loss_type) if isinstance(loss_type, (list, tuple)) else {loss_type}


def _no_split(args: Any, facts: Facts) -> bool:
    """The SFT data has no prompt/completion split the loss could be restricted to."""
    if facts.get("format") == "tokenized":
        return "completion_mask" not in facts.get("columns", ())
    return facts.get("format") == "language_modeling"


def _text_field_unused(args: Any, facts: Facts) -> bool:
    columns = facts.get("columns", ())
    return (
        facts.get("format") in ("prompt_completion", "tokenized")
        or "messages" in columns
        or "conversations" in (columns)
    )


def _truncation_unused(args: Any, facts: Facts) -> bool:
    if args.max_length is None:
        return True
    packs_eval = getattr(args, "eval_packing", None) is not False
    return bool(getattr(args, "packing", False)) and (not facts.get("eval_dataset") or packs_eval)


_ITERABLE = IgnoredOption(
    "dataset_num_proc",
    lambda args, facts: facts.get("iterable", False),
    "the training dataset is an IterableDataset, which is prepared on the fly in the training process.",
)
_NO_EVAL_GENERATION = IgnoredOption(
    "generate_during_eval",
    lambda args, facts: not facts.get("eval_dataset"),
    "no eval_dataset was given, so nothing is evaluated and nothing is generated.",
)
_DECODER_ONLY_COMPLETION_LENGTH = IgnoredOption(
    "max_completion_length",
    lambda args, facts: not facts.get("encoder_decoder"),
    "the model is decoder-only; prompt and completion are limited together by max_length "
    "(max_completion_length only limits encoder-decoder completions).",
)

# Every trainer's table (added by `_BaseTrainer`): transformers applies `label_smoothing_factor` in its own
# `compute_loss`, which only SFT's plain negative log-likelihood goes through in TRL; the fact says whether it does.
LABEL_SMOOTHING = IgnoredOption(
    "label_smoothing_factor",
    lambda args, facts: not facts.get("label_smoothing", False),
    "this trainer computes its own loss, which transformers' label smoothing does not reach (as in TRL: only "
    "SFTTrainer's loss_type='nll' without compute_loss_func applies it).",
)


# ---------------------------------------------------------------------------------------------------------------
# SFT (and the distillation trainers built on it)
# ---------------------------------------------------------------------------------------------------------------
_SKIPPED = "dataset_kwargs={{'skip_prepare_dataset': True}} uses the dataset as given (no tokenization, truncation or labels)."

SFT_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = (
    IgnoredOption(
        "completion_only_loss",
        lambda args, facts: args.completion_only_loss is True and facts.get("skip_prepare_dataset", False),
        _SKIPPED,
    ),
    IgnoredOption(
        "completion_only_loss",
        lambda args, facts: args.completion_only_loss is True and _no_split(args, facts),
        "the training data is {facts[format]} data without a prompt/completion split, so the loss covers every "
        "token. Use `prompt` + `completion` columns to train on completions only (or assistant_only_loss=True on "
        "conversations).",
    ),
    IgnoredOption(
        "dataset_text_field",
        lambda args, facts: facts.get("skip_prepare_dataset", False) or _text_field_unused(args, facts),
        "the training data is not plain text (columns {facts[columns]}); the text column is only read from "
        "language-modeling data that is not conversational.",
    ),
    IgnoredOption(
        "packing_strategy",
        lambda args, facts: not args.packing and not args.eval_packing,
        "packing=False (and eval_packing is not True), so nothing is packed.",
    ),
    IgnoredOption(
        "eval_packing",
        lambda args, facts: not facts.get("eval_dataset"),
        "no eval_dataset was given.",
    ),
    IgnoredOption(
        "truncation_mode",
        lambda args, facts: facts.get("skip_prepare_dataset", False) or _truncation_unused(args, facts),
        "nothing is truncated: max_length={args.max_length}, packing={args.packing} (packing cuts rows itself), or "
        "the dataset preparation is skipped.",
    ),
    IgnoredOption(
        "max_length",
        lambda args, facts: facts.get("skip_prepare_dataset", False) and not facts.get("vision", False),
        _SKIPPED,
    ),
    IgnoredOption(
        "dataset_num_proc",
        lambda args, facts: facts.get("skip_prepare_dataset", False),
        _SKIPPED,
    ),
    _ITERABLE,
)

# GKD renders conversations in its own collator (the SFT preparation is skipped) and has its own loss.
_GKD_OWN_DATA = (
    "GKD's collator renders each conversation with the chat template and trains on its last assistant turn."
)
_DISTILLATION_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = (
    IgnoredOption("completion_only_loss", lambda args, facts: args.completion_only_loss is not None, _GKD_OWN_DATA),
    IgnoredOption("assistant_only_loss", lambda args, facts: bool(args.assistant_only_loss), _GKD_OWN_DATA),
    IgnoredOption("dataset_text_field", lambda args, facts: True, _GKD_OWN_DATA),
    IgnoredOption("packing_strategy", lambda args, facts: True, "packing is not supported by this trainer."),
    IgnoredOption("eval_packing", lambda args, facts: True, "packing is not supported by this trainer."),
    IgnoredOption(
        "truncation_mode",
        lambda args, facts: True,
        "the collator always keeps the end of each conversation (it cuts the prompt from the left).",
    ),
    IgnoredOption("dataset_num_proc", lambda args, facts: True, _GKD_OWN_DATA),
    IgnoredOption(
        "loss_type",
        lambda args, facts: True,
        "the loss is the divergence between student and teacher, not an SFT loss.",
    ),
    IgnoredOption(
        "teacher_model_name_or_path",
        lambda args, facts: facts.get("teacher_given", False),
        "a teacher_model was passed to the trainer, which takes precedence.",
    ),
)
GKD_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = _DISTILLATION_IGNORED_OPTIONS + (
    IgnoredOption(
        "max_new_tokens",
        lambda args, facts: args.lmbda == 0 and not args.seq_kd,
        "lmbda=0 and seq_kd=False: nothing is ever generated, the dataset's completions are used.",
    ),
    IgnoredOption(
        "temperature",
        lambda args, facts: args.lmbda == 0 and not args.seq_kd,
        "lmbda=0 and seq_kd=False: nothing is ever sampled (GKD's divergence does not use the temperature).",
    ),
    IgnoredOption(
        "seq_kd",
        lambda args, facts: args.seq_kd and args.lmbda >= 1,
        "lmbda=1 makes every batch on-policy (student generations), so the teacher never generates.",
    ),
)
GOLD_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = _DISTILLATION_IGNORED_OPTIONS


# ---------------------------------------------------------------------------------------------------------------
# Preference trainers (DPO, KTO, BCO) and the reference-free ones (CPO, ORPO)
# ---------------------------------------------------------------------------------------------------------------
_SMOOTHED_DPO_LOSSES = {"robust", "exo_pair", "aot", "aot_unpaired"}
_F_DIVERGENCE_DPO_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop"}

_REFERENCE_ROWS: tuple[IgnoredOption, ...] = (
    IgnoredOption(
        "precompute_ref_batch_size",
        lambda args, facts: not args.precompute_ref_log_probs,
        "precompute_ref_log_probs=False: reference log-probs are computed with each training batch.",
    ),
    IgnoredOption(
        "ref_model_mixup_alpha",
        lambda args, facts: not args.sync_ref_model,
        "sync_ref_model=False: the reference model is never updated.",
    ),
    IgnoredOption(
        "ref_model_sync_steps",
        lambda args, facts: not args.sync_ref_model,
        "sync_ref_model=False: the reference model is never updated.",
    ),
    IgnoredOption(
        "sync_ref_model",
        lambda args, facts: args.sync_ref_model and 0 < args.max_steps < args.ref_model_sync_steps,
        "the run has max_steps={args.max_steps} optimizer steps, fewer than ref_model_sync_steps="
        "{args.ref_model_sync_steps}, so the reference model is never updated.",
    ),
    _ITERABLE,
)

DPO_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = _REFERENCE_ROWS + (
    IgnoredOption(
        "f_alpha_divergence_coef",
        lambda args, facts: (
            args.f_divergence_type != "alpha_divergence" or not _losses(args) & _F_DIVERGENCE_DPO_LOSSES
        ),
        "it is the coefficient of f_divergence_type='alpha_divergence' (here {args.f_divergence_type!r}, loss_type "
        "{args.loss_type}).",
    ),
    IgnoredOption(
        "discopop_tau",
        lambda args, facts: "discopop" not in _losses(args),
        "it is the temperature of loss_type='discopop', which is not among loss_type={args.loss_type}.",
    ),
    IgnoredOption(
        "label_smoothing",
        lambda args, facts: not _losses(args) & _SMOOTHED_DPO_LOSSES,
        "none of loss_type={args.loss_type} smooths labels (robust, exo_pair, aot and aot_unpaired do; sigmoid "
        "does not, as in TRL 1.16: for label noise use loss_type='robust').",
    ),
    IgnoredOption(
        "truncation_mode",
        lambda args, facts: args.max_length is None,
        "max_length=None: nothing is truncated.",
    ),
    IgnoredOption(
        "beta",
        lambda args, facts: _losses(args) == {"sft"},
        "loss_type='sft' is a plain negative log-likelihood on the chosen completions, with no reference term.",
    ),
)

KTO_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = _REFERENCE_ROWS

_NO_UDM = "no embedding_func/embedding_tokenizer was passed, so the underlying-distribution matching is off."
BCO_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = (
    IgnoredOption("prompt_sample_size", lambda args, facts: not facts.get("udm", False), _NO_UDM),
    IgnoredOption("min_density_ratio", lambda args, facts: not facts.get("udm", False), _NO_UDM),
    IgnoredOption("max_density_ratio", lambda args, facts: not facts.get("udm", False), _NO_UDM),
    _NO_EVAL_GENERATION,
    _ITERABLE,
)

CPO_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = (
    IgnoredOption(
        "simpo_gamma",
        lambda args, facts: args.loss_type not in ("simpo", "alphapo"),
        "it is the target margin of loss_type='simpo' / 'alphapo' (here {args.loss_type!r}).",
    ),
    IgnoredOption(
        "label_smoothing",
        lambda args, facts: args.loss_type in ("hinge", "ipo"),
        "loss_type={args.loss_type!r} does not smooth labels (sigmoid, simpo and alphapo do).",
    ),
    _DECODER_ONLY_COMPLETION_LENGTH,
    _NO_EVAL_GENERATION,
    _ITERABLE,
)

ORPO_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = (_DECODER_ONLY_COMPLETION_LENGTH, _NO_EVAL_GENERATION, _ITERABLE)

# Reward and PRM use every option they define in every run; only the streaming case applies.
REWARD_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = (_ITERABLE,)
PRM_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = (_ITERABLE,)


# ---------------------------------------------------------------------------------------------------------------------
# Online trainers (GRPO, RLOO, Online DPO and its family, Distillation): generation back-end options
# ---------------------------------------------------------------------------------------------------------------------
def _no_vllm(args: Any, facts: Facts) -> bool:
    return not getattr(args, "use_vllm", False)


def _not_server(args: Any, facts: Facts) -> bool:
    return _no_vllm(args, facts) or getattr(args, "vllm_mode", None) != "server"


def _not_colocate(args: Any, facts: Facts) -> bool:
    return _no_vllm(args, facts) or getattr(args, "vllm_mode", None) != "colocate"


def _no_sampling_correction(args: Any, facts: Facts) -> bool:
    return _no_vllm(args, facts) or not getattr(args, "vllm_importance_sampling_correction", False)


_WITHOUT_VLLM = "generation runs with transformers (use_vllm=False); vLLM options apply with use_vllm=True."
_NOT_SERVER = "it configures the vLLM server client, used only with use_vllm=True and vllm_mode='server'."
_NOT_COLOCATE = "it configures the in-process vLLM engine, used only with use_vllm=True and vllm_mode='colocate'."
_NO_CORRECTION = (
    "it shapes vLLM's importance-sampling correction, applied only with use_vllm=True and "
    "vllm_importance_sampling_correction=True."
)

ONLINE_IGNORED_OPTIONS: tuple[IgnoredOption, ...] = (
    IgnoredOption("vllm_mode", _no_vllm, _WITHOUT_VLLM),
    IgnoredOption("vllm_model_impl", _no_vllm, _WITHOUT_VLLM),
    IgnoredOption("vllm_structured_outputs_regex", _no_vllm, _WITHOUT_VLLM),
    IgnoredOption("vllm_server_base_url", _not_server, _NOT_SERVER),
    IgnoredOption("vllm_server_host", _not_server, _NOT_SERVER),
    IgnoredOption("vllm_server_port", _not_server, _NOT_SERVER),
    IgnoredOption("vllm_server_timeout", _not_server, _NOT_SERVER),
    IgnoredOption("vllm_group_port", _not_server, _NOT_SERVER),
    IgnoredOption("vllm_gpu_memory_utilization", _not_colocate, _NOT_COLOCATE),
    IgnoredOption("vllm_tensor_parallel_size", _not_colocate, _NOT_COLOCATE),
    IgnoredOption("vllm_enable_sleep_mode", _not_colocate, _NOT_COLOCATE),
    IgnoredOption("vllm_max_model_length", _not_colocate, _NOT_COLOCATE),
    IgnoredOption("vllm_importance_sampling_correction", _no_vllm, _WITHOUT_VLLM),
    IgnoredOption("vllm_importance_sampling_mode", _no_sampling_correction, _NO_CORRECTION),
    IgnoredOption("vllm_importance_sampling_clip_min", _no_sampling_correction, _NO_CORRECTION),
    IgnoredOption("vllm_importance_sampling_clip_max", _no_sampling_correction, _NO_CORRECTION),
    IgnoredOption(
        "cache_implementation",
        lambda args, facts: getattr(args, "use_vllm", False),
        "it selects transformers' generation cache, and generation runs with vLLM (use_vllm=True).",
    ),
    IgnoredOption(
        "num_generations_eval",
        lambda args, facts: not facts.get("eval_dataset"),
        "no eval_dataset was given, so nothing is generated for evaluation.",
    ),
)
