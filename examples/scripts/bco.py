"""Binary Classifier Optimization (BCO) example with Underlying Distribution Matching (UDM).

UDM reweights undesirable examples by how typical their prompt is of the desirable ones, using a classifier on prompt
embeddings. Here the embeddings are the mean-pooled last hidden states of a small base model (any sentence-embedding
model works). Runs offline on the embedded tiny assets when no model or dataset is given (needs scikit-learn:
`pip install trl[bco]`):

```bash
python examples/scripts/bco.py --output_dir bco-example --max_steps 20 --prompt_sample_size 32
accelerate launch examples/scripts/bco.py --output_dir bco-example --max_steps 20
# your own policy, data and embedding model
python examples/scripts/bco.py --model_name_or_path <model> --dataset_name <unpaired dataset> \
    --embedding_model_name_or_path <embedding model> --output_dir bco-out --use_peft --lora_r 16
```
"""

from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config
from trl.experimental.bco import BCOConfig, BCOTrainer
from trl.scripts._training import finish_training, load_script_dataset, split_datasets


@dataclass
class EmbeddingArguments:
    """Which model embeds the prompts for UDM.

    Args:
        embedding_model_name_or_path (`str` or `None`, defaults to `None`):
            Path or hub id of the embedding model; None uses the policy model's base (without its LM head).
        use_udm (`bool`, defaults to `True`):
            Turn Underlying Distribution Matching on.
    """

    embedding_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Embedding model for UDM; None: the policy model's base."}
    )
    use_udm: bool = field(default=True, metadata={"help": "Turn Underlying Distribution Matching on."})


def embed_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """Mean of the last hidden states over the real (unpadded) tokens: one vector per prompt."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, BCOConfig, ModelConfig, EmbeddingArguments))
    script_args, training_args, model_args, embedding_args = parser.parse_args_and_config()
    if model_args.model_name_or_path is None or script_args.dataset_name is None:
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        script_args.dataset_name = script_args.dataset_name or get_dataset_path("standard_unpaired_preference")

    model_kwargs = {"revision": model_args.model_revision, "trust_remote_code": training_args.trust_remote_code}
    if model_args.dtype not in (None, "auto"):
        model_kwargs["dtype"] = getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **model_kwargs)
    ref_model = None
    if not model_args.use_peft:  # with LoRA the reference is the model with its adapters disabled
        ref_model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **model_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    dataset = load_script_dataset(script_args, None)
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)

    embedding_func, embedding_tokenizer = None, None
    if embedding_args.use_udm:
        embedding_id = embedding_args.embedding_model_name_or_path or model_args.model_name_or_path
        # On the training device, outside any `Accelerator` of its own: the trainer creates the one accelerator, with
        # the run's mixed precision (a second one built here first would fix it to "no").
        embedding_model = AutoModel.from_pretrained(embedding_id, **model_kwargs).eval().to(training_args.device)
        embedding_func = partial(embed_prompt, model=embedding_model)
        embedding_tokenizer = AutoTokenizer.from_pretrained(
            embedding_id, trust_remote_code=training_args.trust_remote_code
        )

    trainer = BCOTrainer(
        model,
        ref_model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        embedding_func=embedding_func,
        embedding_tokenizer=embedding_tokenizer,
    )
    finish_training(trainer, training_args, script_args)
