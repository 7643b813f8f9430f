"""Parity cases: the experimental reference-free preference trainers (CPO with every loss type, ORPO)."""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, predict_eval_dataset, prediction_fingerprint, register, run_trainer


TINY_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
T5 = "tiny-T5ForConditionalGeneration"


def build_reference_free(ctx, kind: str, dataset="standard_preference", model=QWEN, peft=False, **config):
    """`CPOTrainer` / `ORPOTrainer` (kind `cpo` / `orpo`) on 8 training and 8 test rows; returns (trainer, test).

    An encoder-decoder `model` is passed as an instance with its tokenizer (TRL loads a model path as a causal LM).
    """
    import importlib

    module = importlib.import_module(f"trl.experimental.{kind}")
    prefix = kind.upper()
    args = getattr(module, f"{prefix}Config")(output_dir=ctx.tmpdir(), **{**COMMON_ARGS, **config})
    train, test = ctx.dataset(dataset, "train", 8), ctx.dataset(dataset, "test", 8)
    kwargs = {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(**TINY_LORA, task_type="CAUSAL_LM")
    model_arg = ctx.model(model)
    if model == T5:
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        kwargs["processing_class"] = AutoTokenizer.from_pretrained(model_arg)
        model_arg = AutoModelForSeq2SeqLM.from_pretrained(model_arg)
    trainer = getattr(module, f"{prefix}Trainer")(
        model=model_arg, args=args, train_dataset=train, eval_dataset=test, **kwargs
    )
    return trainer, test


def reference_free_case(ctx, kind: str, **kwargs) -> dict:
    """Evaluate, train one step, evaluate, fingerprint the update (see `run_trainer`)."""
    trainer, _ = build_reference_free(ctx, kind, **kwargs)
    return run_trainer(trainer)


def predict_case(ctx, kind: str, **kwargs) -> dict:
    """`predict()` on the prepared test split, and with one of the logits left out through `ignore_keys`."""
    trainer, _ = build_reference_free(ctx, kind, **kwargs)
    return {
        "all": predict_eval_dataset(trainer),
        "ignore_keys": prediction_fingerprint(
            trainer.predict(trainer.eval_dataset, ignore_keys=["eval_logits/chosen"])
        ),
    }


def _register(name: str, kind: str, **kwargs) -> None:
    register(name, partial(reference_free_case, kind=kind, **kwargs))


# CPO: every loss type, the NLL weight, label smoothing, AlphaPO's shape, every dataset shape, PEFT, Llama
for _loss in ("sigmoid", "hinge", "ipo", "simpo"):
    _register(f"cpo/loss_type={_loss}", "cpo", loss_type=_loss)
_register("cpo/loss_type=alphapo", "cpo", loss_type="alphapo", alpha=0.25)
_register("cpo/neftune_noise_alpha=5", "cpo", neftune_noise_alpha=5.0)
_register("orpo/neftune_noise_alpha=5", "orpo", neftune_noise_alpha=5.0)
_register("orpo/beta=-0.1", "orpo", beta=-0.1)  # TRL trains with it: a warning here
_register("cpo/beta=0.0", "cpo", beta=0.0)  # TRL trains with it (only the NLL term learns): a warning here
_register("cpo/loss_type=alphapo/alpha=-0.3", "cpo", loss_type="alphapo", alpha=-0.3, simpo_gamma=0.1)
_register("cpo/loss_type=simpo/cpo_alpha=0", "cpo", loss_type="simpo", cpo_alpha=0.0)
_register("cpo/loss_type=simpo/label_smoothing=0.1", "cpo", loss_type="simpo", label_smoothing=0.1, simpo_gamma=1.0)
_register("cpo/label_smoothing=0.2", "cpo", label_smoothing=0.2)
_register("cpo/beta=0.5/cpo_alpha=0.5", "cpo", beta=0.5, cpo_alpha=0.5)
_register("cpo/loss_type=ipo/alpha=0.3", "cpo", loss_type="ipo", alpha=0.3)
_register("cpo/max_length=16", "cpo", max_length=16)
# Two training prompts fill max_length=14: TRL keeps those pairs with empty completions, this project drops them.
_register("cpo/max_length=14", "cpo", max_length=14)
_register("cpo/conversational_preference", "cpo", dataset="conversational_preference")
_register("cpo/standard_implicit_prompt_preference", "cpo", dataset="standard_implicit_prompt_preference")
_register("cpo/conversational_implicit_prompt_preference", "cpo", dataset="conversational_implicit_prompt_preference")
_register("cpo/llama", "cpo", dataset="conversational_preference", model="tiny-LlamaForCausalLM")
_register("cpo/llama/standard_preference", "cpo", model="tiny-LlamaForCausalLM", loss_type="simpo")
_register("cpo/peft_lora", "cpo", peft=True)
_register("cpo/gradient_accumulation_steps=2", "cpo", per_device_train_batch_size=2, gradient_accumulation_steps=2)

# ORPO
_register("orpo/standard_preference", "orpo")
_register("orpo/beta=0.5", "orpo", beta=0.5)
_register("orpo/padding_value=0", "orpo", padding_value=0)
_register("orpo/conversational_preference", "orpo", dataset="conversational_preference")
_register("orpo/standard_implicit_prompt_preference", "orpo", dataset="standard_implicit_prompt_preference")
_register("orpo/llama", "orpo", dataset="conversational_preference", model="tiny-LlamaForCausalLM")
_register("orpo/peft_lora", "orpo", peft=True)

# Encoder-decoder (tiny T5): the prompt is the encoder input, the completions the decoder labels
_register("cpo/t5/loss_type=sigmoid", "cpo", model=T5)
_register("cpo/t5/loss_type=simpo", "cpo", model=T5, loss_type="simpo")
_register("cpo/t5/conversational_preference", "cpo", model=T5, dataset="conversational_preference")
_register("orpo/t5/standard_preference", "orpo", model=T5)
_register("orpo/t5/max_completion_length=3", "orpo", model=T5, max_completion_length=3)

register("cpo/predict", partial(predict_case, kind="cpo"))
register("orpo/predict", partial(predict_case, kind="orpo"))
