"""MergeModelCallback example: SFT, then merge the last checkpoint with the model it started from, using mergekit.

Needs mergekit (`pip install trl[merge]`). Runs offline on the embedded tiny assets when no model or dataset is given;
the merged model is written to `<output_dir>/checkpoint-<last step>/merged` (nothing is uploaded):

```bash
python examples/scripts/merge_model.py --output_dir merge-example --max_steps 5 --max_length 64 \
    --merge_method ties
# with your own model and data, merging at every checkpoint
python examples/scripts/merge_model.py --model_name_or_path <model> --dataset_name <dataset> \
    --merge_method slerp --merge_at_every_checkpoint --output_dir merge-out
```
"""

from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser
from trl.experimental.merge_model_callback import MergeConfig, MergeModelCallback
from trl.scripts._training import finish_training, load_script_dataset, split_datasets


@dataclass
class MergeArguments:
    merge_method: str = field(default="linear", metadata={"help": "linear, ties, dare_ties or slerp."})
    merge_dtype: str = field(default="float32", metadata={"help": "dtype the merged model is written in."})
    merge_at_every_checkpoint: bool = field(default=False, metadata={"help": "Merge every saved checkpoint."})


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, MergeArguments))
    script_args, training_args, model_args, merge_args = parser.parse_args_and_config()
    from trl.assets import get_dataset_path, get_model_path

    model = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
    script_args.dataset_name = script_args.dataset_name or get_dataset_path("standard_language_modeling")
    dataset, _ = split_datasets(load_script_dataset(script_args, None), script_args, training_args)
    merge_config = MergeConfig(merge_args.merge_method)
    merge_config.dtype = merge_args.merge_dtype
    callback = MergeModelCallback(merge_config, merge_at_every_checkpoint=merge_args.merge_at_every_checkpoint)
    trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, callbacks=[callback])
    finish_training(trainer, training_args, script_args)
