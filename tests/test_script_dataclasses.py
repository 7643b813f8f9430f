"""The public dataclasses have TRL's fields, and every combination a script builds parses.

TRL users compose the dataclasses in one parser: `HfArgumentParser((ScriptArguments, SFTConfig, ModelConfig))` or
`TrlParser(...)` (with `DatasetMixtureConfig`, and the GRPO/RLOO script arguments). argparse refuses an option defined
twice, so the field sets must be exactly TRL's: `trust_remote_code` lives in the training configs, not `ModelConfig`.

The expected fields of the trainer configs are in `tests/fixtures/trl_config_fields.json` (generated from the API
contract); those of the script dataclasses are written out below.
"""

import ast
import dataclasses
import json
import os
import types
import typing

import pytest
import yaml
from transformers import HfArgumentParser, TrainingArguments

import trl
from trl.experimental.bco import BCOConfig
from trl.experimental.nash_md import NashMDConfig
from trl.experimental.online_dpo import OnlineDPOConfig
from trl.experimental.prm import PRMConfig
from trl.experimental.xpo import XPOConfig
from trl.scripts import vllm_serve
from trl.scripts._training import build_model_init_kwargs
from trl.scripts.grpo import GRPOScriptArguments
from trl.scripts.rloo import RLOOScriptArguments
from trl.scripts.utils import DatasetConfig, DatasetMixtureConfig, ScriptArguments, TrlParser
from trl.trainer.model_config import ModelConfig


FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "trl_config_fields.json")

TRAINER_CONFIGS = {
    "DistillationConfig": trl.DistillationConfig,
    "SFTConfig": trl.SFTConfig,
    "DPOConfig": trl.DPOConfig,
    "GRPOConfig": trl.GRPOConfig,
    "KTOConfig": trl.KTOConfig,
    "RewardConfig": trl.RewardConfig,
    "RLOOConfig": trl.RLOOConfig,
    "BCOConfig": BCOConfig,
    "PRMConfig": PRMConfig,
    "OnlineDPOConfig": OnlineDPOConfig,
    "XPOConfig": XPOConfig,
    "NashMDConfig": NashMDConfig,
}

# Fields TRL does not have, kept because a TRL user cannot run into them: no option of another script dataclass
# collides with them and no TRL default changes. (TRL 0.x DPOConfig had both; they select the trained and the
# reference adapter of a multi-adapter PEFT model.)
EXTRA_FIELDS = {"DPOConfig": {"model_adapter_name", "ref_adapter_name"}}
# This project's own addition to every trainer config (default True, so a TRL config or YAML behaves the same): the
# switch of the run report written into output_dir (docs/run_report.md).
for _name in TRAINER_CONFIGS:
    EXTRA_FIELDS[_name] = EXTRA_FIELDS.get(_name, set()) | {"save_run_report"}

_REQUIRED = "REQUIRED"

# Script dataclasses: exactly these fields, as (type, default), in TRL's order.
SCRIPT_DATACLASS_FIELDS = {
    ModelConfig: {
        "model_name_or_path": ("str | None", None),
        "model_revision": ("str", "main"),
        "dtype": ("str | None", "float32"),
        "attn_implementation": ("str | None", None),
        "use_peft": ("bool", False),
        "lora_r": ("int", 16),
        "lora_alpha": ("int", 32),
        "lora_dropout": ("float", 0.05),
        "lora_target_modules": ("list[str] | None", None),
        "lora_target_parameters": ("list[str] | None", None),
        "lora_modules_to_save": ("list[str] | None", None),
        "lora_task_type": ("str", "CAUSAL_LM"),
        "use_rslora": ("bool", False),
        "use_dora": ("bool", False),
        "load_in_8bit": ("bool", False),
        "load_in_4bit": ("bool", False),
        "bnb_4bit_quant_type": ("str", "nf4"),
        "use_bnb_nested_quant": ("bool", False),
        "bnb_4bit_quant_storage": ("str | None", None),
    },
    ScriptArguments: {
        "dataset_name": ("str | None", None),
        "dataset_config": ("str | None", None),
        "dataset_train_split": ("str", "train"),
        "dataset_test_split": ("str", "test"),
        "dataset_streaming": ("bool", False),
        "ignore_bias_buffers": ("bool", False),
    },
    DatasetMixtureConfig: {
        "datasets": ("list[DatasetConfig]", []),
        "streaming": ("bool", False),
        "test_split_size": ("float | None", None),
    },
    DatasetConfig: {
        "path": ("str", _REQUIRED),
        "name": ("str | None", None),
        "data_dir": ("str | None", None),
        "data_files": ("str | list[str] | dict[str, str] | None", None),
        "split": ("str", "train"),
        "columns": ("list[str] | None", None),
        "fraction": ("float | None", None),
    },
    vllm_serve.ScriptArguments: {
        "model": ("str", _REQUIRED),
        "revision": ("str | None", None),
        "tensor_parallel_size": ("int", 1),
        "data_parallel_size": ("int", 1),
        # TRL: '0.0.0.0'. Here the server listens on the loopback interface unless told otherwise (safe by default).
        "host": ("str", "127.0.0.1"),
        "port": ("int", 8000),
        "gpu_memory_utilization": ("float", 0.9),
        "dtype": ("str", "auto"),
        "max_model_len": ("int | None", None),
        "enable_prefix_caching": ("bool | None", None),
        "enforce_eager": ("bool | None", False),
        "kv_cache_dtype": ("str", "auto"),
        "trust_remote_code": ("bool", False),
        "log_level": ("str", "info"),
        "vllm_model_impl": ("str", "vllm"),
        "distributed_executor_backend": ("str | None", None),
        "speculative_config": ("str | None", None),
    },
}
_REWARD_SCRIPT_FIELDS = {
    **SCRIPT_DATACLASS_FIELDS[ScriptArguments],
    "reward_model_name_or_path": ("str | None", None),
    "reward_funcs": ("list[str] | None", None),
}
SCRIPT_DATACLASS_FIELDS[GRPOScriptArguments] = _REWARD_SCRIPT_FIELDS
SCRIPT_DATACLASS_FIELDS[RLOOScriptArguments] = _REWARD_SCRIPT_FIELDS


def type_name(annotation) -> str:
    """An annotation written the way the contract writes it: `str | None`, `dict[str, Any]`, `Literal['a', 'b']`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Literal:
        return "Literal[" + ", ".join(repr(arg) for arg in typing.get_args(annotation)) + "]"
    if typing.get_origin(annotation) is not None:
        args = ", ".join(type_name(arg) for arg in typing.get_args(annotation))
        return f"{typing.get_origin(annotation).__name__}[{args}]"
    if annotation is type(None):
        return "None"
    if annotation is typing.Any:
        return "Any"
    return annotation.__name__


def field_default(dataclass_field):
    if dataclass_field.default is not dataclasses.MISSING:
        return dataclass_field.default
    if dataclass_field.default_factory is not dataclasses.MISSING:
        return dataclass_field.default_factory()
    return _REQUIRED


def field_table(cls) -> dict[str, tuple[str, typing.Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (type_name(hints[f.name]), field_default(f)) for f in dataclasses.fields(cls)}


def same_default(ours, theirs) -> bool:
    """Equal values of the same type; an int and a float of the same value count as equal (`10` vs `10.0`)."""
    numbers = (int, float)
    if isinstance(ours, numbers) and isinstance(theirs, numbers) and not isinstance(ours, bool | type(theirs)):
        return not isinstance(theirs, bool) and ours == theirs
    return type(ours) is type(theirs) and ours == theirs


def trl_fields() -> dict[str, dict[str, tuple[str, typing.Any]]]:
    with open(FIXTURE) as f:
        raw = json.load(f)
    return {
        name: {field: (typ, ast.literal_eval(default)) for field, (typ, default) in fields.items()}
        for name, fields in raw.items()
        if not name.startswith("_")
    }


# ---------------------------------------------------------------------------------------------------------------------
# Field names, types and defaults
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", list(SCRIPT_DATACLASS_FIELDS), ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_script_dataclass_fields_are_trls(cls):
    assert field_table(cls) == SCRIPT_DATACLASS_FIELDS[cls]
    assert list(field_table(cls)) == list(SCRIPT_DATACLASS_FIELDS[cls])


def test_model_config_has_no_trust_remote_code():
    assert "trust_remote_code" not in {f.name for f in dataclasses.fields(ModelConfig)}


def test_fixture_covers_every_trainer_config():
    assert sorted(trl_fields()) == sorted(TRAINER_CONFIGS)


@pytest.mark.parametrize("name", sorted(TRAINER_CONFIGS))
def test_trainer_config_fields_are_trls(name):
    """Every field TRL declares exists with TRL's type and default; the other fields are TrainingArguments' own."""
    cls = TRAINER_CONFIGS[name]
    ours = field_table(cls)
    expected = trl_fields()[name]
    missing = sorted(set(expected) - set(ours))
    assert not missing, f"{name} lacks TRL's fields {missing}"
    different = {
        field: {"ours": ours[field], "trl": spec}
        for field, spec in expected.items()
        if ours[field][0].replace(" ", "") != spec[0].replace(" ", "") or not same_default(ours[field][1], spec[1])
    }
    assert not different, different

    parent = field_table(TrainingArguments)
    extra = {field for field in ours if field not in expected and field not in parent}
    assert extra == EXTRA_FIELDS.get(name, set())
    # A TrainingArguments field TRL leaves alone keeps transformers' type and default here too.
    changed = {
        field: (ours[field], parent[field])
        for field in ours
        if field in parent and field not in expected and ours[field] != parent[field]
    }
    assert not changed, changed


@pytest.mark.parametrize("name", sorted(TRAINER_CONFIGS))
def test_trust_remote_code_is_a_training_config_field(name):
    """TRL's configs that load models from a path have `trust_remote_code` (default False); PRM has none."""
    has_field = "trust_remote_code" in {f.name for f in dataclasses.fields(TRAINER_CONFIGS[name])}
    assert has_field == ("trust_remote_code" in trl_fields()[name])
    assert has_field == (name != "PRMConfig")


# ---------------------------------------------------------------------------------------------------------------------
# Every combination a script builds parses, with both parsers
# ---------------------------------------------------------------------------------------------------------------------
COMBINATIONS = [(ScriptArguments, name) for name in sorted(TRAINER_CONFIGS)]
COMBINATIONS += [(GRPOScriptArguments, "GRPOConfig"), (RLOOScriptArguments, "RLOOConfig")]
PARSERS = [HfArgumentParser, TrlParser]


def _combination_id(value):
    if isinstance(value, type):
        return value.__name__
    return str(value)


def _dataclass_types(script_class, config_name, mixture):
    types_ = (script_class, TRAINER_CONFIGS[config_name], ModelConfig)
    return (*types_, DatasetMixtureConfig) if mixture else types_


def _typical_options(script_class, config_name, output_dir) -> dict[str, typing.Any]:
    """A typical command line of a TRL script, as `{option: value}`."""
    options = {
        "output_dir": str(output_dir),
        "model_name_or_path": "my-model",
        "dataset_name": "my-dataset",
        "dataset_config": "my-config",
        "learning_rate": 1e-5,
        "per_device_train_batch_size": 2,
        "report_to": "none",
        "use_peft": True,
        "lora_r": 8,
        "lora_target_modules": ["all-linear"],
        "dtype": "bfloat16",
    }
    if config_name != "PRMConfig":
        options["trust_remote_code"] = True
    if config_name in ("GRPOConfig", "RLOOConfig"):
        options["num_generations"] = 2
    if script_class in (GRPOScriptArguments, RLOOScriptArguments):
        options["reward_funcs"] = ["accuracy_reward", "think_format_reward"]
    return options


def _command_line(options: dict[str, typing.Any]) -> list[str]:
    args = []
    for key, value in options.items():
        args.append(f"--{key}")
        args.extend(str(v) for v in (value if isinstance(value, list) else [value]))
    return args


def _check_parsed(parsed, script_class, config_name, output_dir, mixture):
    script_args, training_args, model_args = parsed[:3]
    assert type(script_args) is script_class and type(training_args) is TRAINER_CONFIGS[config_name]
    assert type(model_args) is ModelConfig
    assert (script_args.dataset_name, script_args.dataset_config) == ("my-dataset", "my-config")
    assert (script_args.dataset_train_split, script_args.dataset_test_split) == ("train", "test")
    assert training_args.output_dir == str(output_dir)
    assert training_args.learning_rate == 1e-5 and training_args.per_device_train_batch_size == 2
    assert getattr(training_args, "trust_remote_code", True) is True
    assert (model_args.model_name_or_path, model_args.dtype) == ("my-model", "bfloat16")
    assert (model_args.use_peft, model_args.lora_r, model_args.lora_target_modules) == (True, 8, "all-linear")
    if script_class is not ScriptArguments:
        assert script_args.reward_funcs == ["accuracy_reward", "think_format_reward"]
        assert script_args.reward_model_name_or_path is None
    if mixture:
        assert isinstance(parsed[3], DatasetMixtureConfig)
    assert len(parsed) == (4 if mixture else 3)


@pytest.mark.parametrize("mixture", [False, True], ids=["", "mixture"])
@pytest.mark.parametrize("parser_class", PARSERS, ids=_combination_id)
@pytest.mark.parametrize("script_class, config_name", COMBINATIONS, ids=_combination_id)
def test_combination_parses_a_typical_command_line(script_class, config_name, parser_class, mixture, tmp_path):
    parser = parser_class(_dataclass_types(script_class, config_name, mixture))
    options = _typical_options(script_class, config_name, tmp_path)
    parsed = parser.parse_args_into_dataclasses(args=_command_line(options))
    _check_parsed(parsed, script_class, config_name, tmp_path, mixture)


@pytest.mark.parametrize("parser_class", PARSERS, ids=_combination_id)
@pytest.mark.parametrize("script_class, config_name", COMBINATIONS, ids=_combination_id)
def test_combination_help(script_class, config_name, parser_class, capsys):
    parser = parser_class(_dataclass_types(script_class, config_name, mixture=True))
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args_into_dataclasses(args=["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--model_name_or_path" in out and "--dataset_name" in out and "--learning_rate" in out
    defined = sum("--trust_remote_code" in action.option_strings for action in parser._actions)
    assert defined == (0 if config_name == "PRMConfig" else 1)
    assert ("--trust_remote_code" in out) == (defined == 1)


@pytest.mark.parametrize("script_class, config_name", COMBINATIONS, ids=_combination_id)
def test_combination_parses_a_yaml_config(script_class, config_name, tmp_path):
    options = _typical_options(script_class, config_name, tmp_path)
    options["datasets"] = [{"path": "my-dataset", "split": "train", "columns": ["prompt"]}]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(options))
    parser = TrlParser(_dataclass_types(script_class, config_name, mixture=True))
    parsed = parser.parse_args_and_config(args=["--config", str(config), "--lora_r", "8"])
    _check_parsed(parsed, script_class, config_name, tmp_path, mixture=True)
    assert parsed[3].datasets == [DatasetConfig(path="my-dataset", split="train", columns=["prompt"])]


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo", "kto", "reward", "rloo"])
def test_script_parser_parses_a_typical_command_line(name, tmp_path):
    """`trl/scripts/<name>.py`'s own parser: the same dataclasses, the same values."""
    import importlib

    parser = importlib.import_module(f"trl.scripts.{name}").make_parser()
    script_class, config_class, model_class, mixture_class = parser.dataclass_types
    config_name = config_class.__name__
    assert (model_class, mixture_class) == (ModelConfig, DatasetMixtureConfig)
    assert (script_class, config_name) in COMBINATIONS
    options = _typical_options(script_class, config_name, tmp_path)
    parsed = parser.parse_args_and_config(args=_command_line(options))
    _check_parsed(parsed, script_class, config_name, tmp_path, mixture=True)


# ---------------------------------------------------------------------------------------------------------------------
# What the scripts hand to model loading
# ---------------------------------------------------------------------------------------------------------------------
def test_script_model_init_kwargs_take_trust_remote_code_from_the_training_config(tmp_path):
    model_args = ModelConfig(model_revision="v1", attn_implementation="eager", dtype="bfloat16")
    training_args = trl.SFTConfig(str(tmp_path), trust_remote_code=True, report_to="none")
    kwargs = build_model_init_kwargs(model_args, training_args)
    assert kwargs == {"revision": "v1", "trust_remote_code": True, "attn_implementation": "eager", "dtype": "bfloat16"}
    # The config's own `model_init_kwargs` win.
    training_args.model_init_kwargs = {"trust_remote_code": False, "revision": "v2"}
    kwargs = build_model_init_kwargs(model_args, training_args)
    assert (kwargs["trust_remote_code"], kwargs["revision"]) == (False, "v2")


def test_script_model_init_kwargs_quantize_with_the_model_config(tmp_path):
    from transformers import BitsAndBytesConfig

    model_args = ModelConfig(load_in_4bit=True, dtype="bfloat16", bnb_4bit_quant_type="fp4")
    kwargs = build_model_init_kwargs(model_args, trl.SFTConfig(str(tmp_path), report_to="none"))
    assert isinstance(kwargs["quantization_config"], BitsAndBytesConfig)
    assert kwargs["quantization_config"].load_in_4bit and kwargs["quantization_config"].bnb_4bit_quant_type == "fp4"
    assert kwargs["trust_remote_code"] is False
    plain = build_model_init_kwargs(ModelConfig(), trl.SFTConfig(str(tmp_path), report_to="none"))
    assert "quantization_config" not in plain and "device_map" not in plain
