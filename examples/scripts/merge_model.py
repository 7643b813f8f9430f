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

from datasets import load_dataset

from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser
from trl.experimental.merge_model_callback import MergeConfig, MergeModelCallback


@dataclass
class MergeArguments:
    merge_method: str = field(default="linear", metadata={"help": "linear, ties, dare_ties or slerp."})
    merge_dtype: str = field(default="float32", metadata={"help": "dtype the merged model is written in."})
    merge_at_every_checkpoint: bool = field(default=False, metadata={"help": "Merge every saved checkpoint."})


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, MergeArguments))
    script_args, training_args, model_args, merge_args = parser.parse_args_and_config()
    from trl.assets import get_model_path, load_test_dataset

    model = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
    if script_args.dataset_name is None:
        dataset = load_test_dataset("standard_language_modeling", split="train")
    else:
        dataset = load_dataset(
            script_args.dataset_name, script_args.dataset_config, split=script_args.dataset_train_split
        )
    merge_config = MergeConfig(merge_args.merge_method)
    merge_config.dtype = merge_args.merge_dtype
    callback = MergeModelCallback(merge_config, merge_at_every_checkpoint=merge_args.merge_at_every_checkpoint)
    trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, callbacks=[callback])
    trainer.train()
    trainer.save_model(training_args.output_dir)
