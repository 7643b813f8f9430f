"""Parity cases: TRL's importable internals that code written for TRL imports (test suites, plugins), called on small
fixed tensors and the tiny model. Against TRL 1.16 where it ships the name, else against TRL 1.12 (the SFT loss
helpers, Nash-MD's mixture wrapper and PPO's module-level helpers are gone from 1.16).

Each case imports the name from TRL's path inside the function (both sides have it there) and records values,
shapes, dtypes and gradient fingerprints.
"""

from __future__ import annotations

from . import COMMON_ARGS, QWEN, case, tensor_stats, to_jsonable


def _tensor(value) -> dict | None:
    """A tensor's dtype, shape and values (float64), or None."""
    import torch

    if value is None:
        return None
    return {"dtype": str(value.dtype), "shape": list(value.shape), "values": value.detach().to(torch.float64).tolist()}


def _grads(named: dict) -> dict:
    """`tensor_stats` of each gradient (l2 and projection: their sums vanish in exact arithmetic for a head)."""
    keep = ("l2", "maxabs", "proj")
    return {name: {k: v for k, v in tensor_stats(name, g).items() if k in keep} for name, g in named.items()}


def _head(seed: int = 0, rows: int = 5, hidden: int = 6, vocab: int = 13):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, hidden, generator=generator, requires_grad=True),
        torch.randn(vocab, hidden, generator=generator, requires_grad=True),
        torch.randn(vocab, generator=generator, requires_grad=True),
    )


def _tiny_model(ctx):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ctx.model(QWEN), dtype=torch.float32)


def _tiny_models(ctx):
    """The tiny policy and a reference with its weights moved by a fixed-seed Gaussian (scale 0.05)."""
    import torch

    policy, reference = _tiny_model(ctx), _tiny_model(ctx)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted(reference.named_parameters()):
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return policy, reference


# ---------------------------------------------------------------------------------------------------------------------
# TRL 1.16
# ---------------------------------------------------------------------------------------------------------------------
@case("internals/chunked_logprob_function")
def chunked_logprob_function(ctx) -> dict:
    import torch

    from trl.trainer.utils import _ChunkedLogProbFunction

    hidden, weight, bias = _head()
    targets = torch.tensor([0, 3, 12, 7, 7])
    out = {}
    settings = {
        "plain": (hidden, weight, None, targets, 1.0, 4),
        "softcap_scale_bias": (hidden, weight, bias, targets, 0.7, 4, 3.0, 0.5),
        "entropy_only": (hidden, weight, bias, targets, 1.3, 5, None, 2.0, ("entropy",)),
        "logprobs_only": (hidden, weight, None, targets, 1.0, 8, None, 1.0, ()),
    }
    for name, args in settings.items():
        results = _ChunkedLogProbFunction.apply(*args)
        loss = 0.3 * results[0].sum()
        if results[1] is not None:
            loss = loss + (results[1] * torch.arange(5.0)).sum()
        inputs = {"hidden": hidden, "weight": weight, "bias": bias}
        used = {k: v for k, v in inputs.items() if any(v is a for a in args)}
        grads = torch.autograd.grad(loss, list(used.values()))
        out[name] = {
            "outputs": [_tensor(r) for r in results],
            "requires_grad": [None if r is None else r.requires_grad for r in results],
            "grads": _grads(dict(zip(used, grads))),
        }
    tied = _ChunkedLogProbFunction.apply(torch.zeros(2, 6), torch.zeros(13, 6), None, torch.tensor([0, 4]), 1.0, 4)
    out["ties"] = [_tensor(r) for r in tied]
    return to_jsonable(out)


@case("internals/disable_gradient_checkpointing")
def disable_gradient_checkpointing_case(ctx) -> dict:
    from transformers import AutoModelForCausalLM

    from trl.models.utils import disable_gradient_checkpointing

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN))

    def state() -> dict:
        layer = model.model.layers[0]
        function = getattr(layer, "_gradient_checkpointing_func", None)
        return {
            "checkpointing": model.is_gradient_checkpointing,
            "layer": layer.gradient_checkpointing,
            "kwargs": getattr(function, "keywords", None),
            "use_cache": model.config.use_cache,
        }

    out = {"before": state()}
    with disable_gradient_checkpointing(model) as value:
        out["inside_plain"] = {**state(), "value": repr(value)}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    out["enabled"] = state()
    with disable_gradient_checkpointing(model, {"use_reentrant": False}):
        out["inside"] = state()
    out["after"] = state()
    try:
        with disable_gradient_checkpointing(model):
            raise RuntimeError("block failed")
    except RuntimeError:
        pass
    out["after_exception"] = state()
    return to_jsonable(out)


@case("internals/grpo_entropy_bonus_enabled")
def grpo_entropy_bonus_enabled(ctx) -> dict:
    import trl

    train = ctx.dataset("standard_prompt_only", "train", 4)

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    out = {}
    for name, options in {
        "default": {},
        "entropy_coef": {"entropy_coef": 0.01},
        "adaptive": {"use_adaptive_entropy": True, "entropy_coef": 0.0},
    }.items():
        args = trl.GRPOConfig(
            output_dir=ctx.tmpdir(),
            **{**COMMON_ARGS, "num_generations": 4, "max_completion_length": 4, **options},
        )
        trainer = trl.GRPOTrainer(model=ctx.model(QWEN), reward_funcs=reward, args=args, train_dataset=train)
        out[name] = trainer._entropy_bonus_enabled
    return out


@case("internals/gkd_generate_on_policy_outputs")
def gkd_generate_on_policy_outputs(ctx) -> dict:
    import torch
    from transformers import GenerationConfig

    from trl.experimental.gkd import GKDTrainer

    policy = _tiny_model(ctx)
    pad = policy.config.pad_token_id
    prompts = torch.tensor([[pad, pad, 5, 6, 7], [pad, 8, 9, 10, 11], [1, 2, 3, 4, 5]])
    inputs = {"prompts": prompts, "prompt_attention_mask": (prompts != pad).long()}
    out = {"static": isinstance(GKDTrainer.__dict__["generate_on_policy_outputs"], staticmethod)}
    configs = {
        "eos_and_pad": GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=3729, pad_token_id=77),
        "eos_list": GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=[3729, 1441], pad_token_id=77),
        "pad_is_generated": GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=1435),
        "sampled": GenerationConfig(max_new_tokens=5, do_sample=True, top_k=0, temperature=0.9, eos_token_id=3729),
    }
    for name, config in configs.items():
        torch.manual_seed(1)
        result = GKDTrainer.generate_on_policy_outputs(policy, inputs, config)
        out[name] = [_tensor(r) for r in result]
    return to_jsonable(out)


# ---------------------------------------------------------------------------------------------------------------------
# TRL 1.12 (gone from 1.16)
# ---------------------------------------------------------------------------------------------------------------------
_LABELS = [[-100, 3, 4, 5, 6], [-100, -100, 7, 8, -100]]


@case("internals/sft_chunked_cross_entropy_loss", oracle="1.12")
def sft_chunked_cross_entropy_loss(ctx) -> dict:
    import torch

    from trl.trainer.sft_trainer import _chunked_cross_entropy_loss

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=generator, requires_grad=True)
    weight = torch.randn(11, 8, generator=generator, requires_grad=True)
    bias = torch.randn(11, generator=generator)
    labels = torch.tensor(_LABELS)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    settings = {
        "labels": {"labels": labels},
        "num_items_in_batch": {"labels": labels, "num_items_in_batch": torch.tensor(4)},
        "shift_labels": {"shift_labels": shifted},
        "both": {"labels": labels, "shift_labels": labels},
        "no_target": {"labels": torch.full_like(labels, -100)},
        "scale_softcap_bias": {
            "labels": labels, "logit_scale": 0.5, "final_logit_softcapping": 2.0, "lm_head_bias": bias
        },
    }  # fmt: skip
    out = {}
    for name, kwargs in settings.items():
        loss, correct, entropy, count = _chunked_cross_entropy_loss(hidden, weight, 3, **kwargs)
        record = {"outputs": [_tensor(t) for t in (loss, correct, entropy, count)]}
        if loss.requires_grad:
            grads = torch.autograd.grad(loss + entropy, (hidden, weight))
            record["grads"] = _grads({"hidden": grads[0], "weight": grads[1]})
        out[name] = record
    try:
        _chunked_cross_entropy_loss(hidden, weight, 3)
    except ValueError as exc:
        out["error"] = str(exc)
    return to_jsonable(out)


@case("internals/sft_dft_loss", oracle="1.12")
def sft_dft_loss(ctx) -> dict:
    import torch

    from trl.trainer.sft_trainer import dft_loss

    class Outputs:
        def __init__(self, logits):
            self.logits = logits

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator, requires_grad=True)
    labels = torch.tensor(_LABELS)
    out = {}
    for name, kwargs in {"plain": {}, "num_items_in_batch": {"num_items_in_batch": 10}}.items():
        loss = dft_loss(Outputs(logits), labels, **kwargs)
        (grad,) = torch.autograd.grad(loss, logits)
        out[name] = {"loss": _tensor(loss), "grad": _grads({"logits": grad})}
    out["no_target"] = _tensor(dft_loss(Outputs(logits), torch.full_like(labels, -100)))
    return to_jsonable(out)


@case("internals/nash_md_geometric_mixture_wrapper", oracle="1.12")
def nash_md_geometric_mixture_wrapper(ctx) -> dict:
    import torch
    from transformers import GenerationConfig

    from trl.experimental.nash_md.nash_md_trainer import GeometricMixtureWrapper

    policy, reference = _tiny_models(ctx)
    pad = policy.config.pad_token_id
    ids = torch.tensor([[pad, 6, 7, 8], [9, 10, 11, 12]])
    mask = (ids != pad).long()
    out = {}
    for coef in (0.0, 0.3, 1.0):
        wrapper = GeometricMixtureWrapper(
            policy, reference, GenerationConfig(), mixture_coef=coef, device=torch.device("cpu")
        )
        logits = wrapper(input_ids=ids, attention_mask=mask).logits
        out[f"forward/{coef}"] = {
            "shape": list(logits.shape),
            "requires_grad": logits.requires_grad,
            "last": logits[:, -1, :16].tolist(),
            "sum": logits.double().sum().item(),
        }
        # Without a KV cache: with one, TRL 1.12 gives the reference the policy's cache (see docs/nash_md_trainer.md).
        greedy = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=pad, use_cache=False)
        out[f"greedy/{coef}"] = wrapper.generate(input_ids=ids, attention_mask=mask, generation_config=greedy)
        sampled = GenerationConfig(
            max_new_tokens=5, do_sample=True, temperature=0.9, top_k=0, pad_token_id=pad, use_cache=False
        )
        torch.manual_seed(5)
        out[f"sampled/{coef}"] = wrapper.generate(input_ids=ids, attention_mask=mask, generation_config=sampled)
    return to_jsonable(out)


@case("internals/ppo_batch_generation", oracle="1.12")
def ppo_batch_generation(ctx) -> dict:
    import torch
    from transformers import GenerationConfig

    from trl.experimental.ppo.ppo_trainer import batch_generation

    policy = _tiny_model(ctx)
    pad = 99
    queries = torch.tensor([[pad, pad, 5, 6, 7], [pad, 8, 9, 10, 11], [1, 2, 3, 4, 5]])
    configs = {
        "greedy_eos_chunk1": (1, GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=3729, pad_token_id=pad)),
        "greedy_chunk2": (2, GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=3729)),
        "sampled_top_k": (3, GenerationConfig(max_new_tokens=3, do_sample=True, top_k=5, temperature=0.5)),
        "sampled_chunk2": (2, GenerationConfig(max_new_tokens=4, temperature=0.7 + 1e-7, top_k=0, do_sample=True)),
    }  # fmt: skip
    out = {}
    for name, (chunk, config) in configs.items():
        torch.manual_seed(3)
        query_responses, logits = batch_generation(policy, queries, chunk, pad, config)
        finite = torch.where(torch.isfinite(logits), logits, torch.zeros_like(logits)).double()
        out[name] = {
            "query_responses": query_responses,
            "logits_shape": list(logits.shape),
            "logits_dtype": str(logits.dtype),
            "logits_finite_sum": finite.sum(dim=-1),
            "logits_num_inf": torch.isinf(logits).sum(dim=-1),
            "logits_head": logits[:, :, :8].tolist(),
        }
    return to_jsonable(out)


@case("internals/ppo_masked_mean_var", oracle="1.12")
def ppo_masked_mean_var(ctx) -> dict:
    import torch

    from trl.experimental.ppo.ppo_trainer import masked_mean, masked_var

    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    masks = {
        "int": torch.tensor([[1, 1, 0], [1, 0, 0]]),
        "bool": torch.tensor([[True, True, False], [True, False, False]]),
        "weights": torch.tensor([[0.5, 1.0, 0.0], [1.0, 0.0, 0.0]]),
        "single": torch.tensor([[1, 0, 0], [0, 0, 0]]),
        "empty": torch.zeros(2, 3),
        "full": torch.ones(2, 3),
    }
    out = {}
    for name, mask in masks.items():
        record = {"mean": masked_mean(values, mask), "mean_axis0": masked_mean(values, mask, axis=0)}
        record["mean_axis1"] = masked_mean(values, mask, axis=1)
        for unbiased in (True, False):
            try:
                record[f"var_unbiased={unbiased}"] = masked_var(values, mask, unbiased)
            except ValueError as exc:
                record[f"var_unbiased={unbiased}"] = {"exception": "ValueError", "first_sentence": str(exc)[:110]}
        out[name] = record
    out["float64"] = str(masked_var(values.double(), masks["int"]).dtype)
    return to_jsonable(out)
