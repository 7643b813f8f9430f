"""Helpers shared by the TRL scripts: argument dataclasses, the YAML-aware `TrlParser` and dataset mixtures."""

import argparse
import copy
import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

from transformers import HfArgumentParser

from .._config_file import (
    apply_config_defaults,
    closest_name,
    export_env_section,
    leftovers_to_strings,
    load_config_file,
    parser_option_names,
    pop_config_argument,
    unknown_keys_message,
)
from .._local_paths import check_local_path


if TYPE_CHECKING:
    from datasets import DatasetDict, IterableDatasetDict


logger = logging.getLogger(__name__)

# Marks an option shared by several dataclasses that was not given, so that each dataclass keeps its own default.
_UNSET = object()


@dataclass
class ScriptArguments:
    """Dataset selection arguments common to the TRL training scripts.

    Args:
        dataset_name (`str` or `None`, defaults to `None`):
            Hub id or local path handed to `datasets.load_dataset`. Ignored when a dataset mixture
            ([`DatasetMixtureConfig`] `datasets`) is given.
        dataset_config (`str` or `None`, defaults to `None`):
            Configuration name of the dataset (the `name` argument of `load_dataset`).
        dataset_train_split (`str`, defaults to `"train"`):
            Split used for training.
        dataset_test_split (`str`, defaults to `"test"`):
            Split used for evaluation (only read when `eval_strategy` is not `"no"`).
        dataset_streaming (`bool`, defaults to `False`):
            Load the dataset as a stream instead of downloading it in full.
        ignore_bias_buffers (`bool`, defaults to `False`):
            Work around a DDP error with boolean bias buffers by excluding them from synchronisation.
    """

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub id or local path of the dataset (ignored when `datasets` is set)."}
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration name of the dataset (`name` of `load_dataset`)."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split used for training."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split used for evaluation (read only when eval_strategy != 'no')."}
    )
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset instead of loading it."})
    ignore_bias_buffers: bool = field(
        default=False,
        metadata={"help": "Exclude boolean bias buffers from DDP synchronisation (works around a DDP error)."},
    )


@dataclass
class DatasetConfig:
    """One entry of a dataset mixture; the fields map to `datasets.load_dataset` arguments.

    Args:
        path (`str`):
            Hub id, local directory (data files or a `save_to_disk` folder), local data file (`.json`, `.jsonl`,
            `.csv`, `.parquet`, `.txt`, `.arrow`) or builder name such as `"json"` (with `data_files`).
        name (`str` or `None`, defaults to `None`):
            Configuration name.
        data_dir (`str` or `None`, defaults to `None`):
            Sub-directory holding the data files.
        data_files (`str`, `list[str]`, `dict[str, str]` or `None`, defaults to `None`):
            Data files to read.
        split (`str`, defaults to `"train"`):
            Split to load.
        columns (`list[str]` or `None`, defaults to `None`):
            Keep only these columns (all columns when `None`).
        fraction (`float` or `None`, defaults to `None`):
            Relative share of this dataset in the mixture. Either every entry sets it or none does.
    """

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None


@dataclass
class DatasetMixtureConfig:
    """A training dataset assembled from several datasets (usually written as a `datasets:` list in a YAML config).

    Args:
        datasets (`list[DatasetConfig]`, defaults to `[]`):
            The datasets to mix; dictionaries are converted to [`~trl.scripts.utils.DatasetConfig`].
        streaming (`bool`, defaults to `False`):
            Stream every dataset of the mixture.
        test_split_size (`float` or `None`, defaults to `None`):
            When set, the mixture is split into `"train"` and `"test"` with this test fraction (or count, when
            greater than or equal to 1).

    Example:

    ```yaml
    datasets:
      - path: my_org/dataset_a
        split: train
        columns: [prompt, completion]
      - path: data/extra.jsonl
    test_split_size: 0.1
    ```
    """

    datasets: list[DatasetConfig] = field(
        default_factory=list,
        metadata={"help": "Datasets of the mixture (a YAML list of DatasetConfig mappings; see the docs)."},
    )
    streaming: bool = field(default=False, metadata={"help": "Stream every dataset of the mixture."})
    test_split_size: float | None = field(
        default=None, metadata={"help": "If set, split the mixture into train/test with this test size."}
    )

    def __post_init__(self):
        valid = [f.name for f in dataclasses.fields(DatasetConfig)]
        converted = []
        for entry in self.datasets:
            if isinstance(entry, DatasetConfig):
                converted.append(entry)
            elif isinstance(entry, dict):
                unknown = [key for key in entry if key not in valid]
                if unknown:
                    raise ValueError(unknown_keys_message(unknown, valid, "a `datasets` entry"))
                if "path" not in entry:
                    raise ValueError(f"Each `datasets` entry needs a `path`; got {entry!r}.")
                converted.append(DatasetConfig(**entry))
            elif isinstance(entry, str):
                converted.append(DatasetConfig(path=entry))
            else:
                raise ValueError(
                    f"`datasets` entries must be mappings with at least a `path` key, got {type(entry).__name__}: "
                    f"{entry!r}."
                )
        self.datasets = converted


class TrlParser(HfArgumentParser):
    """Argument parser for the TRL scripts: `HfArgumentParser` plus YAML config files.

    `--config file.yaml` (anywhere on the command line) loads a YAML mapping whose values become argument defaults,
    so explicit command-line flags override them. An optional `env:` mapping in the file is exported to
    `os.environ` before parsing. Keys that match no argument are returned as `["--key", "value"]` strings (with
    `return_remaining_strings=True`), which lets the `trl` command forward them to `accelerate launch`.

    Args:
        dataclass_types (`DataClassType`, `Iterable[DataClassType]` or `None`, defaults to `None`):
            Dataclass(es) whose fields become command-line options. None of them may have a field named `config`,
            which is reserved for the config-file flag.
        **kwargs:
            Forwarded to `HfArgumentParser` (and `argparse.ArgumentParser`).

    Example:

    ```python
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    ```
    """

    def __init__(self, dataclass_types: Any = None, **kwargs):
        if dataclass_types is None:
            dataclass_types = []
        elif dataclasses.is_dataclass(dataclass_types) or not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        dataclass_types = list(dataclass_types)
        for dataclass_type in dataclass_types:
            if not dataclasses.is_dataclass(dataclass_type):
                raise ValueError(f"TrlParser expects dataclass types, got {dataclass_type!r}.")
            if any(f.name == "config" for f in dataclasses.fields(dataclass_type)):
                raise ValueError(
                    f"{dataclass_type.__name__} has a field named `config`, which TrlParser reserves for the "
                    "`--config` YAML file flag. Rename the field."
                )
        # Set before `HfArgumentParser.__init__`, which registers the fields through `_add_dataclass_arguments`.
        self._field_dests: set[str] = set()
        self._shared_dests: set[str] = set()
        self._config_dests: set[str] = set()
        super().__init__(dataclass_types=dataclass_types, **kwargs)
        self.config_path: str | None = None

    def _add_dataclass_arguments(self, dtype: Any) -> None:
        # Unlike `HfArgumentParser`, a field name may appear in several dataclasses (e.g. a user's own dataclass
        # repeating a trainer-config field): it gets one option whose value goes to every dataclass. The TRL
        # dataclasses themselves never share a name, so they also compose with a plain `HfArgumentParser`.
        parser = (
            self.add_argument_group(dtype._argument_group_name) if hasattr(dtype, "_argument_group_name") else self
        )
        try:
            type_hints = get_type_hints(dtype)
        except NameError as e:
            raise RuntimeError(
                f"Type resolution failed for {dtype}: declare it at module level and without "
                "`from __future__ import annotations`."
            ) from e
        for dataclass_field in dataclasses.fields(dtype):
            if not dataclass_field.init:
                continue
            if dataclass_field.name in self._field_dests:
                self._shared_dests.add(dataclass_field.name)
                continue
            # Work on a copy: the parser rewrites `type`, which must not leak into the dataclass itself.
            dataclass_field = copy.copy(dataclass_field)
            dataclass_field.type = type_hints[dataclass_field.name]
            self._parse_dataclass_field(parser, dataclass_field)
            self._field_dests.add(dataclass_field.name)

    def parse_args_into_dataclasses(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        look_for_args_file: bool = True,
        args_filename: str | None = None,
        args_file_flag: str | None = None,
    ) -> tuple:
        """Parse command-line strings into one instance per dataclass (see `HfArgumentParser`).

        Options shared by several dataclasses are given to each of them; when such an option is set neither on the
        command line nor in the config file, every dataclass keeps its own default.
        """
        args = list(args) if args is not None else None
        if args_file_flag or args_filename or (look_for_args_file and len(sys.argv)):
            args = self._prepend_args_files(args, look_for_args_file, args_filename, args_file_flag)
        namespace = argparse.Namespace(**{dest: _UNSET for dest in self._shared_dests - self._config_dests})
        namespace, remaining_args = self.parse_known_args(args=args, namespace=namespace)
        outputs = []
        used = set()
        for dtype in self.dataclass_types:
            keys = [f.name for f in dataclasses.fields(dtype) if f.init]
            inputs = {k: getattr(namespace, k) for k in keys if getattr(namespace, k, _UNSET) is not _UNSET}
            used.update(keys)
            outputs.append(dtype(**inputs))
        for key in used:
            if hasattr(namespace, key):
                delattr(namespace, key)
        if len(vars(namespace)) > 0:
            outputs.append(namespace)
        if return_remaining_strings:
            return (*outputs, remaining_args)
        if remaining_args:
            raise ValueError(self._unknown_arguments_message(remaining_args))
        return tuple(outputs)

    @staticmethod
    def _prepend_args_files(
        args: list[str] | None, look_for_args_file: bool, args_filename: str | None, args_file_flag: str | None
    ) -> list[str]:
        # Same convention as `HfArgumentParser`: `<script>.args` next to the entry point, then `args_file_flag` files.
        paths = []
        if args_filename:
            paths.append(Path(args_filename))
        elif look_for_args_file and len(sys.argv):
            paths.append(Path(sys.argv[0]).with_suffix(".args"))
        if args_file_flag:
            flag_parser = argparse.ArgumentParser()
            flag_parser.add_argument(args_file_flag, type=str, action="append")
            parsed, args = flag_parser.parse_known_args(args=args)
            paths.extend(Path(p) for p in (vars(parsed).get(args_file_flag.lstrip("-")) or []))
        file_args = []
        for path in paths:
            if path.exists():
                file_args += path.read_text().split()
        return file_args + (args if args is not None else sys.argv[1:])

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ) -> tuple:
        """Parse the command line, using the values of an optional `--config` YAML file as defaults.

        Args:
            args (`Iterable[str]` or `None`, defaults to `None`):
                Strings to parse; `sys.argv[1:]` when `None`.
            return_remaining_strings (`bool`, defaults to `False`):
                Append the strings that matched no argument (unknown config keys as `["--key", "value"]`, then the
                unknown command-line strings) to the returned tuple.
            fail_with_unknown_args (`bool`, defaults to `True`):
                Without `return_remaining_strings`, raise a `ValueError` for config keys that match no argument.
            separate_remaining_strings (`bool`, defaults to `False`):
                With `return_remaining_strings`, return the config leftovers and the command-line leftovers as two
                separate lists instead of one.

        Returns:
            `tuple`: One instance per dataclass type (plus a namespace for non-dataclass arguments added to the
            parser), followed by the remaining strings when requested.
        """
        args = list(args) if args is not None else sys.argv[1:]
        config_path, args = pop_config_argument(args)
        config_remaining_strings: list[str] = []
        config_leftovers: dict[str, Any] = {}
        if config_path is not None:
            self.config_path = config_path
            config = load_config_file(config_path)
            export_env_section(config)
            config_leftovers = apply_config_defaults(self, config)
            self._config_dests.update(key for key in config if key not in config_leftovers)
            config_remaining_strings = leftovers_to_strings(config_leftovers)

        *objects, args_remaining_strings = self.parse_args_into_dataclasses(args=args, return_remaining_strings=True)

        if return_remaining_strings:
            if separate_remaining_strings:
                return (*objects, config_remaining_strings, args_remaining_strings)
            return (*objects, config_remaining_strings + args_remaining_strings)

        if args_remaining_strings:
            raise ValueError(self._unknown_arguments_message(args_remaining_strings))
        if fail_with_unknown_args and config_leftovers:
            raise ValueError(
                unknown_keys_message(config_leftovers, parser_option_names(self), f"config file {config_path!r}")
            )
        return tuple(objects)

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        """Use `kwargs` as argument defaults (explicit command-line values still win).

        Matched arguments also stop being required; sub-parsers are updated too.

        Args:
            **kwargs:
                Argument names mapped to their new default values.

        Returns:
            `list[str]`: The entries that matched no argument, as `["--key", "str(value)", ...]`.
        """
        leftovers = apply_config_defaults(self, kwargs)
        self._config_dests.update(key for key in kwargs if key not in leftovers)
        return leftovers_to_strings(leftovers)

    def _unknown_arguments_message(self, strings: list[str]) -> str:
        options = parser_option_names(self)
        parts = []
        for string in strings:
            if not string.startswith("-"):
                continue
            name = string.lstrip("-").split("=", 1)[0].replace("-", "_")
            suggestion = closest_name(name, options)
            parts.append(f"{string!r}" + (f" (did you mean '--{suggestion}'?)" if suggestion else ""))
        if not parts:
            return f"Unexpected command-line values: {strings}. Every value must follow an option such as `--name`."
        return f"Unknown command-line option(s): {', '.join(parts)}. Run with `--help` to list the accepted options."


def _is_saved_to_disk(path: str) -> bool:
    # `Dataset.save_to_disk` writes state.json + dataset_info.json; `DatasetDict.save_to_disk` writes dataset_dict.json.
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json"))
    )


_BUILDER_BY_EXTENSION = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".arrow": "arrow",
}


def _load_dataset_entry(dataset_config: DatasetConfig, streaming: bool):
    from datasets import DatasetDict, load_dataset, load_from_disk

    path = dataset_config.path
    if os.path.isdir(path) and _is_saved_to_disk(path):
        # `load_dataset` refuses folders written by `save_to_disk`; those need `load_from_disk`.
        dataset = load_from_disk(path)
        if isinstance(dataset, DatasetDict):
            if dataset_config.split not in dataset:
                raise ValueError(
                    f"Split {dataset_config.split!r} not found in the dataset saved at {path!r}; available splits: "
                    f"{sorted(dataset)}. Set `split` to one of them."
                )
            dataset = dataset[dataset_config.split]
        if streaming:
            dataset = dataset.to_iterable_dataset()
    elif os.path.isfile(path):
        extension = os.path.splitext(path)[1].lower()
        if extension not in _BUILDER_BY_EXTENSION:
            raise ValueError(
                f"Cannot tell the format of the data file {path!r}; expected one of "
                f"{', '.join(sorted(_BUILDER_BY_EXTENSION))}. Alternatively set `path` to a builder such as 'json' "
                "and list the files in `data_files`."
            )
        kwargs = {"delimiter": "\t"} if extension == ".tsv" else {}
        dataset = load_dataset(
            _BUILDER_BY_EXTENSION[extension],
            data_files=dataset_config.data_files if dataset_config.data_files is not None else path,
            split=dataset_config.split,
            streaming=streaming,
            **kwargs,
        )
    else:
        check_local_path(path, "dataset")
        dataset = load_dataset(
            path,
            name=dataset_config.name,
            data_dir=dataset_config.data_dir,
            data_files=dataset_config.data_files,
            split=dataset_config.split,
            streaming=streaming,
        )
    if dataset_config.columns is not None:
        dataset = dataset.select_columns(dataset_config.columns)
    return dataset


def get_dataset(mixture_config: DatasetMixtureConfig) -> "DatasetDict | IterableDatasetDict":
    """Load every dataset of a mixture, apply the fractions and concatenate them.

    Each entry is loaded with `datasets.load_dataset(path, name, data_dir, data_files, split, streaming)` (local data
    files and `save_to_disk` folders are recognised), then reduced to `columns` when given. When fractions are set,
    they are normalised to weights `w_i` and dataset `i` keeps its first `round(w_i * total)` rows, with
    `total = min(len_i / w_i)` (the largest mixture that honours every weight).

    Args:
        mixture_config ([`DatasetMixtureConfig`]):
            The mixture to build.

    Returns:
        [`~datasets.DatasetDict`]: `{"train": mixture}`, or `{"train": ..., "test": ...}` when `test_split_size` is
        set (split with a fixed seed so that every process of a distributed run gets the same split). With
        `streaming=True`, an `IterableDatasetDict`.
    """
    from datasets import DatasetDict, IterableDatasetDict, concatenate_datasets

    configs = mixture_config.datasets
    if not configs:
        raise ValueError(
            "The dataset mixture is empty: list at least one entry under `datasets` (each with a `path`)."
        )
    streaming = mixture_config.streaming
    fractions = [c.fraction for c in configs]
    use_fractions = any(f is not None for f in fractions)
    if use_fractions:
        missing = [c.path for c in configs if c.fraction is None]
        if missing:
            raise ValueError(
                f"Either every dataset of the mixture sets `fraction` or none does; missing for: {missing}."
            )
        if streaming:
            raise ValueError("`fraction` cannot be used with `streaming=True` (stream lengths are unknown).")
        if any(f <= 0 for f in fractions):
            raise ValueError(f"Every `fraction` must be positive; got {fractions}.")
    if streaming and mixture_config.test_split_size is not None:
        raise ValueError("`test_split_size` cannot be used with `streaming=True`; streamed datasets cannot be split.")

    loaded = []
    for dataset_config in configs:
        logger.info("Loading mixture dataset %s (split %s)", dataset_config.path, dataset_config.split)
        loaded.append(_load_dataset_entry(dataset_config, streaming))

    if use_fractions:
        weights = [f / sum(fractions) for f in fractions]
        total = min(len(dataset) / weight for dataset, weight in zip(loaded, weights))
        loaded = [
            dataset.select(range(min(len(dataset), round(weight * total)))) for dataset, weight in zip(loaded, weights)
        ]

    combined = loaded[0] if len(loaded) == 1 else concatenate_datasets(loaded)
    if streaming:
        return IterableDatasetDict({"train": combined})
    if mixture_config.test_split_size is not None:
        test_size = mixture_config.test_split_size
        # The option is a float; `train_test_split` reads a float >= 1 as an error, an int as a number of rows.
        if test_size >= 1 and float(test_size).is_integer():
            test_size = int(test_size)
        return combined.train_test_split(test_size=test_size, seed=0)
    return DatasetDict({"train": combined})


def init_zero_verbose() -> None:
    """Silence logging below ERROR (through a Rich handler when available) and route warnings to `logging`."""
    handlers: list[logging.Handler]
    if importlib.util.find_spec("rich") is not None:
        from rich.logging import RichHandler

        handlers = [RichHandler()]
    else:
        handlers = [logging.StreamHandler()]
    logging.basicConfig(format="%(message)s", datefmt="[%X]", handlers=handlers, level=logging.ERROR)
    # basicConfig is a no-op when the root logger already has handlers; the level must drop regardless.
    logging.getLogger().setLevel(logging.ERROR)

    def _log_warning(message, category, filename, lineno, file=None, line=None):
        logging.warning(f"{filename}:{lineno}: {category.__name__}: {message}")

    warnings.showwarning = _log_warning


def get_git_commit_hash(package_name: str) -> str | None:
    """Commit hash of the git checkout a package is imported from, or `None` (regular install, git missing, ...).

    Args:
        package_name (`str`):
            Importable name of the package, e.g. `"trl"`.

    Returns:
        `str` or `None`: The full commit hash of `HEAD`.
    """
    try:
        spec = importlib.util.find_spec(package_name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    repo_dir = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
    if not os.path.exists(os.path.join(repo_dir, ".git")):
        return None
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = result.stdout.strip()
    return commit or None
