"""Steps every training script shares: model init kwargs, dataset loading, and finishing a run.

The scripts `trl/scripts/{sft,dpo,kto,reward,grpo,rloo,distillation}.py` keep only what is their own (trainer class, config,
extra trainer arguments) and hand the rest to `train_with_trainer`, `make_script_parser` and `run_script`.
"""

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

from .._local_paths import check_local_path
from ..trainer.run_report import REPORT_FILE_NAME
from ..trainer.utils import get_kbit_device_map, get_peft_config, get_quantization_config
from ..trainer.utils.distributed import wait_for_idle_gloo_workers
from .utils import DatasetMixtureConfig, ScriptArguments, TrlParser, get_dataset


logger = logging.getLogger(__name__)


def build_model_init_kwargs(model_args: Any, training_args: Any) -> dict[str, Any]:
    """`from_pretrained` kwargs from a `ModelConfig` and the trainer config, updated by its `model_init_kwargs`.

    `revision`, `attn_implementation` and `dtype` come from `model_args`; `trust_remote_code` from `training_args`
    (the training configs own it: `ModelConfig` has no such field). With `--load_in_4bit` / `--load_in_8bit` the
    bitsandbytes `quantization_config` and a per-process `device_map` are added.

    Args:
        model_args: The parsed `ModelConfig` (revision, attn_implementation, dtype, quantization fields).
        training_args: The trainer config (`trust_remote_code`); its own `model_init_kwargs` win over the rest.
    """
    kwargs: dict[str, Any] = {
        "revision": model_args.model_revision,
        "trust_remote_code": getattr(training_args, "trust_remote_code", None),
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    quantization_config = get_quantization_config(model_args)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        kwargs["device_map"] = get_kbit_device_map()
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

        check_local_path(script_args.dataset_name, "dataset")  # a typo fails here, not deep inside `datasets`

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
    """Train (resuming when asked), save, push when asked, then release the trainer's resources and process group."""
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if trainer.is_world_process_zero():
        print(closing_line(trainer))
    if hasattr(trainer, "end"):
        trainer.end()
    release_process_group()


def closing_line(trainer: Any) -> str:
    """What a finished run tells the user last: the step reached, the last logged loss, where the model and the run
    report went."""
    state, args = trainer.state, trainer.args
    losses = [row["loss"] for row in state.log_history if isinstance(row.get("loss"), (int, float))]
    parts = [f"Training finished at step {state.global_step}"]
    if losses:
        parts.append(f"last logged loss {losses[-1]:.4f}")
    parts.append(f"model saved to {os.path.abspath(args.output_dir)}")
    report = os.path.join(args.output_dir, REPORT_FILE_NAME)
    if os.path.isfile(report):
        parts.append(f"run report: {os.path.abspath(report)}")
    return "; ".join(parts) + "."


def train_with_trainer(
    trainer_class: type,
    script_args: ScriptArguments,
    training_args: Any,
    model_args: Any,
    dataset_args: DatasetMixtureConfig | None = None,
    **trainer_kwargs: Any,
) -> None:
    """The whole `main` of a training script: build the trainer from the parsed arguments, train, save.

    Sets `training_args.model_init_kwargs` from `model_args`, loads and splits the dataset, builds
    `trainer_class(model=model_args.model_name_or_path, args=..., train_dataset=..., eval_dataset=...,
    peft_config=get_peft_config(model_args), **trainer_kwargs)` and runs `finish_training`.

    Args:
        trainer_class (`type`):
            The trainer to build, e.g. `SFTTrainer`.
        script_args (`ScriptArguments`):
            Dataset selection (name, config, splits, streaming).
        training_args:
            The trainer config; its `model_init_kwargs` is replaced by the merged kwargs.
        model_args (`ModelConfig`):
            Model path and loading / PEFT options.
        dataset_args (`DatasetMixtureConfig` or `None`, defaults to `None`):
            A dataset mixture, used instead of `script_args.dataset_name` when it lists datasets.
        **trainer_kwargs:
            Extra keyword arguments of the trainer that only this script passes (e.g. GRPO's `reward_funcs`).
    """
    training_args.model_init_kwargs = build_model_init_kwargs(model_args, training_args)
    dataset = load_script_dataset(script_args, dataset_args)
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = trainer_class(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
        **trainer_kwargs,
    )
    finish_training(trainer, training_args, script_args)


def make_script_parser(
    name: str,
    help: str,
    dataclass_types: tuple[type, ...],
    subparsers: argparse._SubParsersAction | None = None,
    prog: str | None = None,
) -> TrlParser:
    """The `TrlParser` of a script, or its sub-command `name` registered on `subparsers` when given.

    Args:
        name (`str`):
            Sub-command name, e.g. `"sft"`.
        help (`str`):
            Help line of the sub-command, e.g. `"Run the SFT training script"`.
        dataclass_types (`tuple[type, ...]`):
            The dataclasses the parser fills, in the order `main` receives them.
        subparsers (`argparse._SubParsersAction` or `None`, defaults to `None`):
            Where to register the sub-command; a standalone parser is returned when `None`.
        prog (`str` or `None`, defaults to `None`):
            Program name of the standalone parser.
    """
    if subparsers is not None:
        return subparsers.add_parser(name, help=help, dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


def run_script(make_parser: Callable[[], TrlParser], main: Callable[..., None]) -> None:
    """Parse the command line (and `--config` YAML) with the script's parser and call its `main`.

    Args:
        make_parser (`Callable`):
            The script's `make_parser`; its parser must yield `(script_args, training_args, model_args,
            dataset_args)`.
        main (`Callable`):
            The script's `main(script_args, training_args, model_args, dataset_args)`.
    """
    parser = make_parser()
    # `dataset_args` is last so that dataclasses without `datasets` in the YAML still parse.
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    main(script_args, training_args, model_args, dataset_args)


def release_process_group() -> None:
    """Wait for every rank, then destroy the default process group if one was created.

    Without this, a rank that finishes first can exit while gloo's worker threads of the process group are still
    alive, and the C++ runtime aborts it ("terminate called without an active exception"), failing the launch.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        wait_for_idle_gloo_workers()
