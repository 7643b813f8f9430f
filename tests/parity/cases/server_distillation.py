"""Parity cases: `trl.experimental.server_distillation` (config, errors, the sparse-support loss over a few steps).

The teacher server is replaced by an in-process scorer with `VLLMClient.get_sequence_logprobs`'s output format,
backed by the small Qwen2 teacher, so both libraries see the same teacher log-probabilities."""

from __future__ import annotations

from functools import partial

from . import COMMON_ARGS, QWEN, expect_error, register, run_trainer, to_jsonable
from .dataclass_fields import _register_dataclass_case


TEACHER = "small-Qwen2ForCausalLM"
SERVER_ARGS = dict(
    COMMON_ARGS, max_steps=2, max_completion_length=8, generation_kwargs={"do_sample": False}, report_to="none"
)
URL = "http://127.0.0.1:9"


class LocalTeacherScorer:
    """Stands in for the teacher's `VLLMClient`: scores sequences with a local causal LM (top-k and realised token)."""

    calls: list = []

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32").eval()

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs=100, temperature=1.0, **_):
        import torch

        out = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
        for sequence, prompt_length in zip(sequences, prompt_lengths):
            ids = torch.tensor([sequence])
            with torch.no_grad():
                log_probs = (self.model(ids).logits[0].float() / temperature).log_softmax(-1)
            scored = log_probs[prompt_length - 1 : len(sequence) - 1]
            top = scored.topk(top_logprobs, dim=-1)
            targets = ids[0, prompt_length:]
            out["logprobs"].append(top.values.tolist())
            out["logprob_token_ids"].append(top.indices.tolist())
            out["actual_logprobs"].append(scored.gather(-1, targets[:, None]).tolist())
            out["actual_token_ids"].append(targets[:, None].tolist())
        type(self).calls.append({"n": len(sequences), "k": top_logprobs, "temperature": temperature})
        return out


def _patch_client(ctx):
    """Make `VLLMClient(...)` (looked up when the trainer is built) return the local scorer."""
    import trl.generation.vllm_client as module

    teacher = ctx.model(TEACHER)
    module.VLLMClient = lambda *args, **kwargs: LocalTeacherScorer(teacher)


def build_server_distillation(ctx, **config):
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    _patch_client(ctx)
    args = ServerDistillationConfig(output_dir=ctx.tmpdir(), teacher_model_server_url=URL, **{**SERVER_ARGS, **config})
    return ServerDistillationTrainer(
        model=ctx.model(QWEN),
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 8),
        eval_dataset=ctx.dataset("standard_prompt_only", "test", 8),
    )


def server_distillation_case(ctx, **config) -> dict:
    LocalTeacherScorer.calls = []
    trainer = build_server_distillation(ctx, **config)
    out = run_trainer(trainer)
    out["teacher_calls"] = LocalTeacherScorer.calls[:3]
    out["tags"] = list(trainer._tag_names)
    out["name"] = trainer._name
    return out


register("server_distillation/default", server_distillation_case)
register("server_distillation/beta=0", partial(server_distillation_case, beta=0.0, loss_top_k=3))
register(
    "server_distillation/beta=0/no_tail",
    partial(server_distillation_case, beta=0.0, loss_top_k=3, loss_add_tail=False),
)
register("server_distillation/beta=0.5", partial(server_distillation_case, beta=0.5, temperature=2.0))
register("server_distillation/beta=0.5/no_tail", partial(server_distillation_case, beta=0.5, loss_add_tail=False))
register(
    "server_distillation/gradient_accumulation_steps=2",
    partial(server_distillation_case, per_device_train_batch_size=2, gradient_accumulation_steps=2),
)


def _config_error(ctx, **config) -> dict:
    from trl.experimental.server_distillation import ServerDistillationConfig

    return expect_error(lambda: ServerDistillationConfig(output_dir=ctx.tmpdir(), use_cpu=True, bf16=False, **config))


URL_PHRASES = ("teacher_model_server_url",)
MODE_PHRASES = ("reverse_kl_top_1_mode",)
TOP_K_PHRASES = ("loss_top_k",)
for _name, _kwargs, _phrases in (
    ("no_url", {}, URL_PHRASES),
    ("blank_url", dict(teacher_model_server_url="  "), URL_PHRASES),
    ("no_url_bad_mode", dict(reverse_kl_top_1_mode="foo"), MODE_PHRASES),
    ("bad_mode", dict(teacher_model_server_url=URL, reverse_kl_top_1_mode="foo"), MODE_PHRASES),
    ("argmax", dict(teacher_model_server_url=URL, reverse_kl_top_1_mode="argmax"), MODE_PHRASES),
    ("beta>0/top_k=2", dict(teacher_model_server_url=URL, loss_top_k=2), TOP_K_PHRASES),
    ("beta=0/top_k=0", dict(teacher_model_server_url=URL, beta=0.0, loss_top_k=0), TOP_K_PHRASES),
    ("beta=0/top_k=5", dict(teacher_model_server_url=URL, beta=0.0, loss_top_k=5), ()),
    ("bad_beta", dict(teacher_model_server_url=URL, beta=1.5), ("beta must be in [0.0, 1.0], got 1.5",)),
):
    register(f"server_distillation/config/{_name}", partial(_config_error, **_kwargs), phrases=_phrases)


def _request_inputs(ctx) -> dict:
    import torch

    from trl.experimental.server_distillation import build_teacher_request_inputs

    ids = torch.tensor([[0, 5, 6, 7, 8], [1, 2, 3, 4, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    labels = torch.tensor([[-100, -100, -100, 7, 8], [-100, 2, 3, 4, -100]])
    prompt_mask = torch.tensor([[0, 1], [1, 1]])
    return {
        "labels": to_jsonable(build_teacher_request_inputs(ids, mask, labels=labels)),
        "prompt_mask": to_jsonable(build_teacher_request_inputs(ids, mask, prompt_attention_mask=prompt_mask)),
        "no_labels": expect_error(lambda: build_teacher_request_inputs(ids, mask)),
        "bad_shape": expect_error(lambda: build_teacher_request_inputs(ids, mask[:, :3], labels=labels)),
        "bad_prompt": expect_error(lambda: build_teacher_request_inputs(ids, mask, labels=torch.full_like(labels, 5))),
    }


register("server_distillation/build_teacher_request_inputs", _request_inputs)
_register_dataclass_case(
    "ServerDistillationConfig", "trl.experimental.server_distillation", "ServerDistillationConfig"
)


# ---------------------------------------------------------------------------------------------------------------------
# IW-OPD configuration (same sparse-support option family)
# ---------------------------------------------------------------------------------------------------------------------
def _iw_opd_config(ctx, **config) -> dict:
    import warnings

    from trl.experimental.iw_opd import IWOPDConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = expect_error(lambda: IWOPDConfig(output_dir=ctx.tmpdir(), use_cpu=True, bf16=False, **config))
    if out.get("raised", "x") is None:
        args = IWOPDConfig(output_dir=ctx.tmpdir(), use_cpu=True, bf16=False, **config)
        out["derived"] = [args.max_prompt_length, args.generation_batch_size]
    out["warned"] = sorted(
        {w.category.__name__ for w in caught if "argmax" in str(w.message) or "copies" in str(w.message)}
    )
    return out


for _name, _kwargs, _phrases in (
    ("default", {}, ()),
    ("lmbda", dict(lmbda=1.5), ("lmbda must be in [0.0, 1.0], got 1.5.",)),
    ("beta", dict(beta=-1.0), ("beta must be in [0.0, 1.0], got -1.0.",)),
    ("objective", dict(distillation_objective="x"), ("distillation_objective must be one of: 'jsd', 'iw_opd'",)),
    ("gamma", dict(iw_opd_gamma=-1.0), ("iw_opd_gamma must be non-negative, got -1.0.",)),
    ("epsilon", dict(iw_opd_epsilon=0.0), ("iw_opd_epsilon must be positive, got 0.0.",)),
    ("mode", dict(reverse_kl_top_1_mode="x"), ("reverse_kl_top_1_mode must be one of: 'sampled', 'argmax'",)),
    ("lengths", dict(max_completion_length=2000), ("max_completion_length (2000) must be smaller",)),
    ("num_generations", dict(num_generations=0), ("num_generations must be at least 1, got 0.",)),
    ("generation_batch", dict(per_device_train_batch_size=3, num_generations=2), ("Got 1 * 2 != 3 * 1.",)),
    ("generation_batch_size=3", dict(generation_batch_size=3), ("Got 3 * 1 != 8 * 1.",)),
    ("iw_opd_lmbda", dict(lmbda=0.5), ("requires lmbda=1.0",)),
    ("iw_opd_argmax", dict(reverse_kl_top_1_mode="argmax"), ("requires reverse_kl_top_1_mode='sampled'",)),
    ("iw_opd_vllm_sync", dict(use_vllm=True, vllm_sync_frequency=2), ("requires vllm_sync_frequency=1",)),
    ("server_url", dict(use_teacher_server=True), ("teacher_model_server_url must be set",)),
    (
        "server_top_k=0",
        dict(
            use_teacher_server=True, teacher_model_server_url="u", distillation_objective="jsd", beta=0.0, loss_top_k=0
        ),
        ("loss_top_k must be positive",),
    ),
    (
        "server_argmax",
        dict(
            use_teacher_server=True,
            teacher_model_server_url="u",
            distillation_objective="jsd",
            reverse_kl_top_1_mode="argmax",
        ),
        ("reverse_kl_top_1_mode='argmax' is not supported with use_teacher_server=True",),
    ),
    (
        "server_top_k=2",
        dict(use_teacher_server=True, teacher_model_server_url="u", distillation_objective="jsd", loss_top_k=2),
        ("loss_top_k must be 1 when using use_teacher_server=True with beta>0 (got loss_top_k=2)",),
    ),
    ("jsd_argmax_beta=0", dict(distillation_objective="jsd", reverse_kl_top_1_mode="argmax", beta=0.0), ()),
    ("jsd_argmax_beta=0.5", dict(distillation_objective="jsd", reverse_kl_top_1_mode="argmax", beta=0.5), ()),
    (
        "jsd_mixed_generations",
        dict(distillation_objective="jsd", lmbda=0.5, num_generations=2, per_device_train_batch_size=2),
        (),
    ),
):
    register(f"iw_opd/config/{_name}", partial(_iw_opd_config, **_kwargs), phrases=_phrases)
_register_dataclass_case("IWOPDConfig", "trl.experimental.iw_opd", "IWOPDConfig")
