"""Command-line runner shared by the Online DPO, XPO and Nash-MD example scripts (same arguments, other trainer)."""

from dataclasses import dataclass, field
from typing import Any

from ..trainer.model_config import ModelConfig
from ..trainer.utils import get_peft_config
from ._training import build_model_init_kwargs, finish_training, load_script_dataset, split_datasets
from .utils import DatasetMixtureConfig, ScriptArguments, TrlParser


JUDGES = ("pair_rm", "openai", "hf")


@dataclass
class OnlinePreferenceScriptArguments(ScriptArguments):
    """Dataset selection plus an optional judge.

    Args:
        judge (`str` or `None`, defaults to `None`):
            Rank the completion pairs with a judge instead of a reward model: `pair_rm` (PairRMJudge), `openai`
            (OpenAIPairwiseJudge) or `hf` (HfPairwiseJudge).
    """

    judge: str | None = field(
        default=None, metadata={"help": "Judge instead of a reward model.", "choices": list(JUDGES)}
    )


def build_judge(name: str | None) -> Any:
    """The judge named on the command line (None when no judge was asked for)."""
    if name is None:
        return None
    from ..experimental.judges import HfPairwiseJudge, OpenAIPairwiseJudge, PairRMJudge

    return {"pair_rm": PairRMJudge, "openai": OpenAIPairwiseJudge, "hf": HfPairwiseJudge}[name]()


def run_online_preference_script(trainer_class: type, config_class: type) -> None:
    """Parse the command line (or `--config` YAML), fill offline defaults and train with `trainer_class`.

    Without a model, dataset or ranking the run uses the embedded tiny policy, prompt-only dataset and tiny reward
    model from `trl.assets`, so the example runs offline.
    """
    parser = TrlParser((OnlinePreferenceScriptArguments, config_class, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    from ..assets import get_dataset_path, get_model_path

    if model_args.model_name_or_path is None:
        model_args.model_name_or_path = get_model_path("tiny-Qwen2ForCausalLM")
    if script_args.dataset_name is None and not dataset_args.datasets:
        script_args.dataset_name = get_dataset_path("standard_prompt_only")
    if script_args.judge is None and training_args.reward_model_path is None:
        training_args.reward_model_path = get_model_path("tiny-Qwen2ForSequenceClassification")

    training_args.model_init_kwargs = build_model_init_kwargs(model_args, training_args)
    dataset = load_script_dataset(script_args, dataset_args)
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = trainer_class(
        model=model_args.model_name_or_path,
        judge=build_judge(script_args.judge),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    finish_training(trainer, training_args, script_args)
