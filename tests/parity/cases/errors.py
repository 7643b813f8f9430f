"""Parity cases: Bad inputs: exception type and key phrase."""

from __future__ import annotations

from . import (
    COMMON_ARGS,
    QWEN,
    QWEN_RM,
    case,
    expect_error,
    tokenizer,
)
from .data import _tokenized_lm


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs: exception type and key phrase
# ---------------------------------------------------------------------------------------------------------------------
@case(
    "errors/pack_dataset_strategy",
    phrases=("Invalid packing strategy 'first_fit', must be one of ('bfd', 'bfd_split', 'wrapped').",),
)
def _err_pack_strategy(ctx):
    from trl import pack_dataset

    return expect_error(lambda: pack_dataset(_tokenized_lm(ctx, 2), seq_length=8, strategy="first_fit"))


@case("errors/apply_chat_template_keys", phrases=("Invalid keys in the example: set()",))
def _err_chat_template_keys(ctx):
    from trl import apply_chat_template

    tok = tokenizer(ctx)
    return expect_error(lambda: apply_chat_template({"question": [{"role": "user", "content": "Hi"}]}, tok))


@case(
    "errors/dpo_exo_pair_without_label_smoothing",
    phrases=(
        "Label smoothing must be greater than 0.0 when using 'exo_pair' loss. The EXO paper recommends a value of 1e-3.",
    ),
)
def _err_exo_pair(ctx):
    from trl import DPOConfig, DPOTrainer

    def build():
        args = DPOConfig(output_dir=ctx.tmpdir(), loss_type="exo_pair", **COMMON_ARGS)
        return DPOTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_preference", "train", 4)
        )

    return expect_error(build)


@case(
    "errors/dpo_f_divergence_with_apo_zero",
    phrases=(
        "`f_divergence_type='forward_kl'` is only supported for the following loss types: ['discopop', 'exo_pair', "
        "'hinge', 'ipo', 'robust', 'sft', 'sigmoid', 'sigmoid_norm']. You provided ['apo_zero']. Use the default "
        "`f_divergence_type='reverse_kl'` with these losses.",
    ),
)
def _err_f_divergence(ctx):
    from trl import DPOConfig, DPOTrainer

    def build():
        args = DPOConfig(output_dir=ctx.tmpdir(), loss_type="apo_zero", f_divergence_type="forward_kl", **COMMON_ARGS)
        return DPOTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_preference", "train", 4)
        )

    return expect_error(build)


@case(
    "errors/reward_num_labels=2",
    phrases=(
        "The model has `num_labels=2`, but reward models require `num_labels=1` to output a single scalar reward per "
        "sequence. Please instantiate your model with `num_labels=1` or pass a model name as a string to have it "
        "configured automatically",
    ),
)
def _err_reward_num_labels(ctx):
    from transformers import AutoModelForSequenceClassification

    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(
        ctx.model(QWEN_RM), num_labels=2, ignore_mismatched_sizes=True
    )
    args = RewardConfig(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    return expect_error(
        lambda: RewardTrainer(model=model, args=args, train_dataset=ctx.dataset("standard_preference", "train", 4))
    )


@case("errors/sft_completion_only_loss_on_lm_data")
def _err_sft_completion_only(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), completion_only_loss=True, **COMMON_ARGS)
        trainer = SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )
        trainer.train()

    return expect_error(build)


@case(
    "errors/sft_padding_free_without_packing_with_max_length",
    phrases=(
        "When `padding_free=True` without packing, `max_length` is not enforced. Either enable packing (e.g., "
        "`packing=True, packing_strategy='bfd'`), provide already truncated inputs, or set `max_length=None`.",
    ),
)
def _err_sft_padding_free_max_length(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), padding_free=True, **COMMON_ARGS)
        return SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )

    return expect_error(build)


@case(
    "errors/sft_skip_prepare_dataset_raw_text",
    phrases=(
        "No columns in the dataset match the model's forward method signature: (input_ids, labels, seq_lengths). The "
        "following columns have been ignored: [text]. Please check the dataset and model.",
    ),
)
def _err_sft_skip_prepare_raw(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), dataset_kwargs={"skip_prepare_dataset": True}, **COMMON_ARGS)
        trainer = SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )
        trainer.train()

    return expect_error(build)


@case(
    "errors/sft_assistant_only_loss_on_standard_data",
    phrases=(
        "You set `assistant_only_loss=True`, but the dataset is not conversational. This option is only supported for "
        "conversational datasets.",
    ),
)
def _err_sft_assistant_only(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), assistant_only_loss=True, **COMMON_ARGS)
        return SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )

    return expect_error(build)


@case(
    "errors/sft_assistant_only_loss_template_without_markers",
    phrases=(
        "The chat template is not training-compatible (missing prefix-preservation or `{% generation %}` markers) and "
        "patching is not supported for this template. Please manually modify the chat template for training.",
    ),
)
def _err_sft_assistant_only_template(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), assistant_only_loss=True, **COMMON_ARGS)
        return SFTTrainer(
            model=ctx.model(QWEN),
            args=args,
            train_dataset=ctx.dataset("conversational_language_modeling", "train", 4),
        )

    return expect_error(build)


@case("errors/kto_loss_type_unknown")
def _err_kto_loss_type(ctx):
    from trl import KTOConfig, KTOTrainer

    def build():
        args = KTOConfig(output_dir=ctx.tmpdir(), loss_type="sigmoid", **COMMON_ARGS)
        trainer = KTOTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_unpaired_preference", "train", 4)
        )
        trainer.train()

    return expect_error(build)


# ---------------------------------------------------------------------------------------------------------------------
