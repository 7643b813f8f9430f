"""SFT with `assistant_only_loss=True` on tokenizers whose chat template has no generation markers: TRL's training
variant of the family is swapped in for tokenizing, and exactly the assistant turns are trained."""

import pytest
from datasets import Dataset
from trainer_utils import args_builder
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl import SFTConfig, SFTTrainer
from trl import chat_template_utils as ctu
from trl.assets import get_model_path, get_tokenizer_path


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(SFTConfig, max_steps=1, per_device_train_batch_size=2, learning_rate=1e-2)

MESSAGES = [
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi there."},
    {"role": "user", "content": "Say bye."},
    {"role": "assistant", "content": "Bye now."},
]

# family -> (special tokens of that family's style, text the assistant mask must cover)
FAMILY_STYLES = {
    "qwen3": (
        ["<think>", "</think>"],
        "<think>\n\n</think>\n\nHi there.<|im_end|>\n<think>\n\n</think>\n\nBye now.<|im_end|>\n",
    ),
    "gemma3": (["<start_of_turn>", "<end_of_turn>"], "Hi there.<end_of_turn>\nBye now.<end_of_turn>\n"),
}


@pytest.mark.parametrize("family", sorted(FAMILY_STYLES))
def test_assistant_only_loss_masks_exactly_the_assistant_turns(tmp_path, family):
    special_tokens, expected = FAMILY_STYLES[family]
    tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_path("qwen2_5"))
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    tokenizer.chat_template = getattr(ctu, f"{family}_chat_template")  # the family's text, no generation markers
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    model.resize_token_embeddings(len(tokenizer))

    trainer = SFTTrainer(
        model=model,
        args=make_args(tmp_path, assistant_only_loss=True),
        train_dataset=Dataset.from_dict({"messages": [MESSAGES] * 4}),
        processing_class=tokenizer,
    )
    assert not ctu.has_generation_markers(trainer.processing_class.chat_template)  # the tokenizer is left as is
    row = trainer.train_dataset[0]
    assert row["input_ids"] == tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]
    trained = [token for token in row["labels"] if token != -100]
    assert tokenizer.decode(trained) == expected
    untrained = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label == -100])
    assert "Say hi." in untrained and "Say bye." in untrained and "Hi there." not in untrained
    trainer.train()
