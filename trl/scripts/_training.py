"""Steps every training script shares: model init kwargs from ModelConfig, dataset loading, and finishing a run."""

import logging
from typing import Any

from .utils import DatasetMixtureConfig, ScriptArguments, get_dataset


logger = logging.getLogger(__name__)


def build_model_init_kwargs(model_args: Any, training_args: Any) -> dict[str, Any]:
    """`from_pretrained` kwargs from a `ModelConfig`, updated by `training_args.model_init_kwargs`.

    Args:
        model_args: The parsed `ModelConfig` (revision, trust_remote_code, attn_implementation, dtype).
        training_args: The trainer config; its own `model_init_kwargs` win over `model_args`.
    """
    kwargs: dict[str, Any] = {
        "revision": model_args.model_revision,
        "trust_remote_code": model_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    kwargs.update(getattr(training_args, "model_init_kwargs", None) or {})
    return kwargs


def load_script_dataset(script_args: ScriptArguments, dataset_args: DatasetMixtureConfig | None):
    """The dataset a script trains on: a mixture when `datasets` is given, else `load_dataset(dataset_name, ...)`."""
    if dataset_args is not None and dataset_args.datasets:
        if script_args.dataset_name is not None:
            logger.warning(
                "Both `datasets` (a mixture) and `dataset_name` were given; using the mixture and ignoring "
                "dataset_name=%r.",
                script_args.dataset_name,
            )
        return get_dataset(dataset_args)
    if script_args.dataset_name is not None:
        from datasets import load_dataset

        return load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    raise ValueError(
        "No dataset given: pass --dataset_name (a hub id or a local directory of json/parquet/csv files) or a "
        "`datasets:` mixture in the YAML config."
    )


def split_datasets(dataset: Any, script_args: ScriptArguments, training_args: Any) -> tuple[Any, Any]:
    """Train split, and the test split when evaluation is on (a clear error when a split is missing)."""
    if script_args.dataset_train_split not in dataset:
        raise ValueError(
            f"The dataset has no split {script_args.dataset_train_split!r}; available splits: {list(dataset)}. Set "
            "--dataset_train_split."
        )
    train = dataset[script_args.dataset_train_split]
    eval_dataset = None
    if training_args.eval_strategy != "no":
        if script_args.dataset_test_split not in dataset:
            raise ValueError(
                f"eval_strategy={training_args.eval_strategy!r} needs the split {script_args.dataset_test_split!r}, "
                f"but the dataset has {list(dataset)}. Set --dataset_test_split or --eval_strategy no."
            )
        eval_dataset = dataset[script_args.dataset_test_split]
    return train, eval_dataset


def finish_training(trainer: Any, training_args: Any, script_args: ScriptArguments) -> None:
    """Train (resuming when asked), save the model, push when asked, and release the trainer's resources."""
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if hasattr(trainer, "end"):
        trainer.end()
