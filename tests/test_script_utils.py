"""Tests for the script helpers: ModelConfig, ScriptArguments, TrlParser (YAML configs) and dataset mixtures."""

import json
import logging
import os
import subprocess
import warnings
from dataclasses import dataclass, field

import pytest
from datasets import Dataset, DatasetDict, IterableDatasetDict

from trl.scripts.utils import (
    DatasetConfig,
    DatasetMixtureConfig,
    ScriptArguments,
    TrlParser,
    get_dataset,
    get_git_commit_hash,
    init_zero_verbose,
)
from trl.trainer.model_config import ModelConfig


@dataclass
class _TrainArgs:
    learning_rate: float = 1e-3
    num_steps: int = 10
    use_bias: bool = True
    tags: list[str] = field(default_factory=list)
    mode: str = field(default="fast", metadata={"choices": ["fast", "slow"]})
    shared: str = "from-train"


@dataclass
class _OtherArgs:
    name: str | None = None
    shared: str = "from-other"


def _write_yaml(path, text: str) -> str:
    path.write_text(text)
    return str(path)


# --- dataclasses -----------------------------------------------------------------------------------------------------


def test_model_config_defaults():
    config = ModelConfig()
    assert config.model_name_or_path is None
    assert config.model_revision == "main"
    assert config.dtype == "float32"
    assert not hasattr(config, "trust_remote_code")  # a training-config option (TRL 1.16)
    assert config.attn_implementation is None
    assert (config.use_peft, config.lora_r, config.lora_alpha, config.lora_dropout) == (False, 16, 32, 0.05)
    assert config.lora_target_modules is None and config.lora_modules_to_save is None
    assert config.lora_target_parameters is None
    assert config.lora_task_type == "CAUSAL_LM"
    assert (config.use_rslora, config.use_dora) == (False, False)
    assert (config.load_in_8bit, config.load_in_4bit) == (False, False)
    assert config.bnb_4bit_quant_type == "nf4"
    assert config.use_bnb_nested_quant is False
    assert config.bnb_4bit_quant_storage is None


def test_model_config_rejects_both_quantizations():
    with pytest.raises(ValueError, match="load_in_8bit=True and load_in_4bit=True"):
        ModelConfig(load_in_8bit=True, load_in_4bit=True)


def test_model_config_unwraps_single_target_module():
    assert ModelConfig(lora_target_modules=["all-linear"]).lora_target_modules == "all-linear"
    assert ModelConfig(lora_target_modules=["q_proj", "v_proj"]).lora_target_modules == ["q_proj", "v_proj"]


def test_model_config_choices_are_validated_by_the_parser():
    parser = TrlParser(ModelConfig)
    (config,) = parser.parse_args_and_config(["--dtype", "bfloat16", "--bnb_4bit_quant_type", "fp4"])
    assert (config.dtype, config.bnb_4bit_quant_type) == ("bfloat16", "fp4")
    with pytest.raises(SystemExit):
        parser.parse_args_and_config(["--dtype", "float64"])


def test_script_arguments_defaults():
    args = ScriptArguments()
    assert (args.dataset_name, args.dataset_config) == (None, None)
    assert (args.dataset_train_split, args.dataset_test_split) == ("train", "test")
    assert (args.dataset_streaming, args.ignore_bias_buffers) == (False, False)


def test_dataset_mixture_converts_dicts_and_reports_unknown_keys():
    mixture = DatasetMixtureConfig(datasets=[{"path": "a.json", "columns": ["text"]}, DatasetConfig(path="b")])
    assert mixture.datasets == [DatasetConfig(path="a.json", columns=["text"]), DatasetConfig(path="b")]
    assert mixture.streaming is False and mixture.test_split_size is None
    with pytest.raises(ValueError, match="'colums' \\(did you mean 'columns'\\?\\)"):
        DatasetMixtureConfig(datasets=[{"path": "a.json", "colums": ["text"]}])
    with pytest.raises(ValueError, match="needs a `path`"):
        DatasetMixtureConfig(datasets=[{"split": "train"}])


def test_public_import_paths():
    import trl
    import trl.scripts
    import trl.trainer

    assert trl.TrlParser is TrlParser and trl.scripts.TrlParser is TrlParser
    assert trl.ModelConfig is ModelConfig and trl.trainer.ModelConfig is ModelConfig
    assert trl.ScriptArguments is ScriptArguments and trl.DatasetMixtureConfig is DatasetMixtureConfig
    assert trl.get_dataset is get_dataset and trl.init_zero_verbose is init_zero_verbose


# --- TrlParser -------------------------------------------------------------------------------------------------------


def test_parser_is_an_hf_argument_parser():
    from transformers import HfArgumentParser

    assert isinstance(TrlParser(_TrainArgs), HfArgumentParser)


def test_parser_rejects_a_config_field():
    @dataclass
    class WithConfig:
        config: str = "x"

    with pytest.raises(ValueError, match="field named `config`"):
        TrlParser((_TrainArgs, WithConfig))


def test_command_line_only():
    parser = TrlParser(_TrainArgs)
    (args,) = parser.parse_args_and_config(
        ["--learning_rate", "0.5", "--no_use_bias", "--tags", "a", "b", "--mode", "slow"]
    )
    assert args == _TrainArgs(learning_rate=0.5, use_bias=False, tags=["a", "b"], mode="slow")


def test_yaml_values_are_defaults_and_flags_win(tmp_path):
    config = _write_yaml(
        tmp_path / "c.yaml", "learning_rate: 2.0e-5\nnum_steps: 7\nuse_bias: false\ntags: [x, y]\nmode: slow\n"
    )
    parser = TrlParser(_TrainArgs)
    (args,) = parser.parse_args_and_config(["--num_steps", "3", "--config", config])
    assert args == _TrainArgs(learning_rate=2e-5, num_steps=3, use_bias=False, tags=["x", "y"], mode="slow")


def test_yaml_string_numbers_go_through_the_argument_type(tmp_path):
    # YAML reads `1e-4` (no dot) as a string; argparse converts string defaults with the option's type.
    config = _write_yaml(tmp_path / "c.yaml", "learning_rate: 1e-4\n")
    (args,) = TrlParser(_TrainArgs).parse_args_and_config(["--config", config])
    assert args.learning_rate == pytest.approx(1e-4)


def test_config_equals_form(tmp_path):
    config = _write_yaml(tmp_path / "c.yaml", "num_steps: 4\n")
    (args,) = TrlParser(_TrainArgs).parse_args_and_config([f"--config={config}"])
    assert args.num_steps == 4


def test_env_section_is_exported(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_TEST_ENV_A", "unset")  # restored after the test
    monkeypatch.setenv("TRL_TEST_ENV_B", "unset")
    config = _write_yaml(tmp_path / "c.yaml", "num_steps: 4\nenv:\n  TRL_TEST_ENV_A: 42\n  TRL_TEST_ENV_B: hello\n")
    (args,) = TrlParser(_TrainArgs).parse_args_and_config(["--config", config])
    assert args.num_steps == 4
    assert os.environ["TRL_TEST_ENV_A"] == "42"
    assert os.environ["TRL_TEST_ENV_B"] == "hello"


def test_env_section_must_be_a_mapping(tmp_path):
    config = _write_yaml(tmp_path / "c.yaml", "env: [A, B]\n")
    with pytest.raises(ValueError, match="`env` section"):
        TrlParser(_TrainArgs).parse_args_and_config(["--config", config])


def test_config_must_be_a_mapping(tmp_path):
    config = _write_yaml(tmp_path / "c.yaml", "- a\n- b\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        TrlParser(_TrainArgs).parse_args_and_config(["--config", config])


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        TrlParser(_TrainArgs).parse_args_and_config(["--config", str(tmp_path / "nope.yaml")])


def test_yaml_is_loaded_safely(tmp_path):
    config = _write_yaml(tmp_path / "c.yaml", "num_steps: !!python/object/apply:os.getcwd []\n")
    import yaml

    with pytest.raises(yaml.YAMLError):
        TrlParser(_TrainArgs).parse_args_and_config(["--config", config])


def test_unknown_yaml_key_names_the_closest_field(tmp_path):
    config = _write_yaml(tmp_path / "c.yaml", "lerning_rate: 0.1\n")
    with pytest.raises(ValueError, match="'lerning_rate' \\(did you mean 'learning_rate'\\?\\)"):
        TrlParser(_TrainArgs).parse_args_and_config(["--config", config])


def test_unknown_yaml_keys_can_be_ignored_or_returned(tmp_path):
    config = _write_yaml(tmp_path / "c.yaml", "num_steps: 5\nnum_processes: 2\nmixed_precision: bf16\n")
    parser = TrlParser(_TrainArgs)
    (args,) = parser.parse_args_and_config(["--config", config], fail_with_unknown_args=False)
    assert args.num_steps == 5

    args, remaining = TrlParser(_TrainArgs).parse_args_and_config(
        ["--config", config, "--gpu_ids", "0"], return_remaining_strings=True
    )
    assert args.num_steps == 5
    assert remaining == ["--num_processes", "2", "--mixed_precision", "bf16", "--gpu_ids", "0"]

    args, from_config, from_cli = TrlParser(_TrainArgs).parse_args_and_config(
        ["--config", config, "--gpu_ids", "0"], return_remaining_strings=True, separate_remaining_strings=True
    )
    assert from_config == ["--num_processes", "2", "--mixed_precision", "bf16"]
    assert from_cli == ["--gpu_ids", "0"]


def test_unknown_command_line_flag_names_the_closest_option():
    with pytest.raises(ValueError, match="'--num_stpes' \\(did you mean '--num_steps'\\?\\)"):
        TrlParser(_TrainArgs).parse_args_and_config(["--num_stpes", "3"])


def test_set_defaults_with_config_clears_required_and_returns_leftovers():
    @dataclass
    class Required:
        model: str
        port: int = 8000

    parser = TrlParser(Required)
    leftovers = parser.set_defaults_with_config(model="m", port=9000, unknown=True)
    assert leftovers == ["--unknown", "True"]
    (args,) = parser.parse_args_and_config([])
    assert (args.model, args.port) == ("m", 9000)


def test_field_shared_by_two_dataclasses():
    parser = TrlParser((_TrainArgs, _OtherArgs))
    train, other = parser.parse_args_and_config(["--shared", "both"])
    assert (train.shared, other.shared) == ("both", "both")
    # Not given: each dataclass keeps its own default.
    train, other = TrlParser((_TrainArgs, _OtherArgs)).parse_args_and_config([])
    assert (train.shared, other.shared) == ("from-train", "from-other")


def test_field_shared_by_two_dataclasses_from_yaml(tmp_path):
    config = _write_yaml(tmp_path / "c.yaml", "shared: yaml\n")
    train, other = TrlParser((_TrainArgs, _OtherArgs)).parse_args_and_config(["--config", config])
    assert (train.shared, other.shared) == ("yaml", "yaml")


def test_script_dataclasses_with_a_mixture_from_yaml(tmp_path):
    config = _write_yaml(
        tmp_path / "c.yaml",
        "model_name_or_path: some/model\n"
        "lora_target_modules: [q_proj]\n"
        "datasets:\n"
        "  - path: a.jsonl\n"
        "    columns: [prompt, completion]\n"
        "  - path: b.parquet\n"
        "    split: test\n"
        "test_split_size: 0.25\n",
    )
    parser = TrlParser((ScriptArguments, ModelConfig, DatasetMixtureConfig))
    script_args, model_args, mixture = parser.parse_args_and_config(["--config", config, "--lora_r", "4"])
    assert script_args == ScriptArguments()
    assert (model_args.model_name_or_path, model_args.lora_r, model_args.lora_target_modules) == (
        "some/model",
        4,
        "q_proj",
    )
    assert mixture.datasets == [
        DatasetConfig(path="a.jsonl", columns=["prompt", "completion"]),
        DatasetConfig(path="b.parquet", split="test"),
    ]
    assert mixture.test_split_size == 0.25


# --- get_dataset -----------------------------------------------------------------------------------------------------


@pytest.fixture
def local_datasets(tmp_path):
    """Four small local datasets in different on-disk formats."""
    with open(tmp_path / "a.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"text": f"a{i}", "extra": i}) + "\n")
    Dataset.from_dict({"text": [f"b{i}" for i in range(6)]}).to_parquet(str(tmp_path / "b.parquet"))
    DatasetDict(
        {"train": Dataset.from_dict({"text": ["c0", "c1", "c2"]}), "test": Dataset.from_dict({"text": ["ct"]})}
    ).save_to_disk(str(tmp_path / "c_saved"))
    (tmp_path / "d_dir").mkdir()
    with open(tmp_path / "d_dir" / "train.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"text": f"d{i}"}) + "\n")
    return tmp_path


def test_two_dataset_mixture_from_local_files(local_datasets):
    mixture = DatasetMixtureConfig(
        datasets=[
            {"path": str(local_datasets / "a.jsonl"), "columns": ["text"]},
            {"path": str(local_datasets / "b.parquet")},
        ]
    )
    dataset = get_dataset(mixture)
    assert isinstance(dataset, DatasetDict) and list(dataset) == ["train"]
    assert dataset["train"].column_names == ["text"]
    assert list(dataset["train"]["text"]) == [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(6)]


def test_mixture_from_saved_folder_and_data_directory(local_datasets):
    mixture = DatasetMixtureConfig(
        datasets=[
            {"path": str(local_datasets / "c_saved"), "split": "test"},
            {"path": str(local_datasets / "d_dir")},
            {"path": "json", "data_files": str(local_datasets / "a.jsonl"), "split": "train[:2]", "columns": ["text"]},
        ]
    )
    assert list(get_dataset(mixture)["train"]["text"]) == ["ct", "d0", "d1", "d2", "d3", "a0", "a1"]


def test_mixture_missing_split_of_saved_folder(local_datasets):
    mixture = DatasetMixtureConfig(datasets=[{"path": str(local_datasets / "c_saved"), "split": "validation"}])
    with pytest.raises(ValueError, match="Split 'validation' not found"):
        get_dataset(mixture)


def test_mixture_fractions_and_test_split(local_datasets):
    # Weights 0.75 / 0.25 over 10 and 6 rows: total = min(10 / 0.75, 6 / 0.25) = 13.33 -> 10 and 3 rows.
    mixture = DatasetMixtureConfig(
        datasets=[
            {"path": str(local_datasets / "a.jsonl"), "columns": ["text"], "fraction": 3},
            {"path": str(local_datasets / "b.parquet"), "fraction": 1},
        ],
        test_split_size=0.25,
    )
    dataset = get_dataset(mixture)
    assert list(dataset) == ["train", "test"]
    assert (len(dataset["train"]), len(dataset["test"])) == (9, 4)
    texts = sorted(list(dataset["train"]["text"]) + list(dataset["test"]["text"]))
    assert texts == sorted([f"a{i}" for i in range(10)] + ["b0", "b1", "b2"])
    # The split is seeded: every process of a distributed run sees the same one.
    assert list(get_dataset(mixture)["test"]["text"]) == list(dataset["test"]["text"])


def test_mixture_test_split_as_a_row_count(local_datasets):
    mixture = DatasetMixtureConfig(datasets=[{"path": str(local_datasets / "b.parquet")}], test_split_size=2.0)
    dataset = get_dataset(mixture)
    assert (len(dataset["train"]), len(dataset["test"])) == (4, 2)


def test_mixture_streaming(local_datasets):
    mixture = DatasetMixtureConfig(datasets=[{"path": str(local_datasets / "a.jsonl")}], streaming=True)
    dataset = get_dataset(mixture)
    assert isinstance(dataset, IterableDatasetDict)
    assert [row["text"] for row in dataset["train"]] == [f"a{i}" for i in range(10)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"datasets": []}, "mixture is empty"),
        ({"datasets": [{"path": "A", "fraction": 0.5}, {"path": "B"}]}, "missing for: \\['B'\\]"),
        ({"datasets": [{"path": "A", "fraction": 0.5}], "streaming": True}, "cannot be used with `streaming"),
        ({"datasets": [{"path": "A", "fraction": 0.0}]}, "must be positive"),
        ({"datasets": [{"path": "A"}], "streaming": True, "test_split_size": 0.1}, "`test_split_size` cannot"),
    ],
)
def test_mixture_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_dataset(DatasetMixtureConfig(**kwargs))


def test_mixture_rejects_unknown_file_extension(tmp_path):
    path = tmp_path / "data.xyz"
    path.write_text("x")
    with pytest.raises(ValueError, match="Cannot tell the format"):
        get_dataset(DatasetMixtureConfig(datasets=[{"path": str(path)}]))


# --- misc ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    level, handlers, showwarning = root.level, list(root.handlers), warnings.showwarning
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    warnings.showwarning = showwarning


def test_init_zero_verbose(restore_logging):
    init_zero_verbose()
    assert logging.getLogger().level == logging.ERROR

    class _Collect(logging.Handler):
        def __init__(self):
            super().__init__(level=logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    collector = _Collect()
    logging.getLogger().addHandler(collector)
    logging.getLogger().setLevel(logging.WARNING)
    # pytest records warnings itself, so call the hook that `warnings.warn` would use.
    warnings.showwarning("careful", UserWarning, "somefile.py", 12)
    assert collector.messages == ["somefile.py:12: UserWarning: careful"]


def test_get_git_commit_hash():
    import trl

    repo = os.path.dirname(os.path.dirname(trl.__file__))
    expected = None
    if os.path.exists(os.path.join(repo, ".git")):
        expected = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
        expected = expected.strip() or None
    assert get_git_commit_hash("trl") == expected
    assert get_git_commit_hash("yaml") is None
    assert get_git_commit_hash("a_package_that_does_not_exist") is None


def test_trl_parser_reads_config_through_plain_open():
    """TRL's tests substitute `builtins.open` to feed a YAML config; the parser must read it that way."""
    from unittest.mock import mock_open, patch

    from trl import ScriptArguments, TrlParser

    parser = TrlParser((ScriptArguments,))
    with patch("builtins.open", mock_open(read_data="dataset_name: from-yaml\n")):
        (script_args,) = parser.parse_args_and_config(args=["--config", "config.yaml"])
    assert script_args.dataset_name == "from-yaml"
