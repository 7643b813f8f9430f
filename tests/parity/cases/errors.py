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
@case("errors/dpo_loss_weights_length", phrases=("loss_weights",))
def _err_loss_weights(ctx):
    from trl import DPOConfig

    return expect_error(
        lambda: DPOConfig(output_dir=ctx.tmpdir(), loss_type=["sigmoid", "sft"], loss_weights=[1.0], report_to="none")
    )


@case("errors/grpo_num_generations=1", phrases=("at least 2",))
def _err_num_generations(ctx):
    from trl import GRPOConfig

    return expect_error(
        lambda: GRPOConfig(output_dir=ctx.tmpdir(), num_generations=1, report_to="none", use_cpu=True, bf16=False)
    )


@case("errors/grpo_generation_batch_size", phrases=("generation_batch_size",))
def _err_generation_batch_size(ctx):
    from trl import GRPOConfig

    return expect_error(
        lambda: GRPOConfig(
            output_dir=ctx.tmpdir(),
            per_device_train_batch_size=3,
            num_generations=2,
            report_to="none",
            use_cpu=True,
            bf16=False,
        )
    )


@case("errors/pack_dataset_strategy", phrases=("strategy",))
def _err_pack_strategy(ctx):
    from trl import pack_dataset

    return expect_error(lambda: pack_dataset(_tokenized_lm(ctx, 2), seq_length=8, strategy="first_fit"))


@case("errors/apply_chat_template_keys")
def _err_chat_template_keys(ctx):
    from trl import apply_chat_template

    tok = tokenizer(ctx)
    return expect_error(lambda: apply_chat_template({"question": [{"role": "user", "content": "Hi"}]}, tok))


@case("errors/dpo_ref_model_is_model")
def _err_ref_is_model(ctx):
    from transformers import AutoModelForCausalLM

    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN))
    args = DPOConfig(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    return expect_error(
        lambda: DPOTrainer(
            model=model, ref_model=model, args=args, train_dataset=ctx.dataset("standard_preference", "train", 4)
        )
    )


@case("errors/dpo_exo_pair_without_label_smoothing")
def _err_exo_pair(ctx):
    from trl import DPOConfig, DPOTrainer

    def build():
        args = DPOConfig(output_dir=ctx.tmpdir(), loss_type="exo_pair", **COMMON_ARGS)
        return DPOTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_preference", "train", 4)
        )

    return expect_error(build)


@case("errors/dpo_f_divergence_with_apo_zero")
def _err_f_divergence(ctx):
    from trl import DPOConfig, DPOTrainer

    def build():
        args = DPOConfig(output_dir=ctx.tmpdir(), loss_type="apo_zero", f_divergence_type="forward_kl", **COMMON_ARGS)
        return DPOTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_preference", "train", 4)
        )

    return expect_error(build)


@case("errors/reward_num_labels=2")
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


@case("errors/sft_train_dataset=None")
def _err_sft_no_dataset(ctx):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    return expect_error(lambda: SFTTrainer(model=ctx.model(QWEN), args=args, train_dataset=None))


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


@case("errors/sft_padding_free_without_packing_with_max_length", phrases=("max_length",))
def _err_sft_padding_free_max_length(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), padding_free=True, **COMMON_ARGS)
        return SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )

    return expect_error(build)


@case("errors/sft_skip_prepare_dataset_raw_text", phrases=("forward method signature",))
def _err_sft_skip_prepare_raw(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), dataset_kwargs={"skip_prepare_dataset": True}, **COMMON_ARGS)
        trainer = SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )
        trainer.train()

    return expect_error(build)


@case("errors/sft_assistant_only_loss_on_standard_data")
def _err_sft_assistant_only(ctx):
    from trl import SFTConfig, SFTTrainer

    def build():
        args = SFTConfig(output_dir=ctx.tmpdir(), assistant_only_loss=True, **COMMON_ARGS)
        return SFTTrainer(
            model=ctx.model(QWEN), args=args, train_dataset=ctx.dataset("standard_language_modeling", "train", 4)
        )

    return expect_error(build)


@case("errors/sft_assistant_only_loss_template_without_markers")
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
    from trl import KTOConfig

    return expect_error(lambda: KTOConfig(output_dir=ctx.tmpdir(), loss_type="sigmoid", report_to="none"))


# ---------------------------------------------------------------------------------------------------------------------
