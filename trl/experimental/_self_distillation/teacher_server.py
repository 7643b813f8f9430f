"""The teacher behind the vLLM generation server (`use_teacher_server=True`) for SDFT and SDPO.

With a live teacher (the student itself reading the teacher prompt), the server that samples the rollouts already
holds the student's weights, so it can score the completions after the teacher prompt instead of a second forward
pass here. The server returns log-probabilities only (the sampled token's and the top-k per position), not logits,
so only `sampled_token` and `topk_logits` distillation are possible, and `topk_logits` then distils over the
teacher's top-k tokens (the student's log-probabilities are gathered there).
"""

from typing import Any

import torch

from ...trainer.utils import sparse_divergence
from .loss_utils import _support_log_probs, compute_divergence, token_log_probs


def build_teacher_request_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_attention_mask: torch.Tensor
) -> tuple[list[list[int]], list[int], list[int]]:
    """The server request of a padded batch (TRL's SDFT/SDPO signature: the prompt mask is required); see
    [`~trl.trainer.utils.sparse_divergence.build_teacher_request_inputs`].

    Args:
        input_ids: `(B, L)` teacher prompt followed by the completion, padded anywhere.
        attention_mask: `(B, L)` 1 on real tokens.
        prompt_attention_mask: `(B, L)` 1 on the real prompt tokens (0 over the completion).

    Returns:
        `(sequences, prompt_lengths, completion_lengths)`, one entry per row.
    """
    return sparse_divergence.build_teacher_request_inputs(
        input_ids, attention_mask, prompt_attention_mask=prompt_attention_mask
    )


def check_teacher_server_args(args: Any, distillation_weight: float | None = None) -> None:
    """Refuse a configuration the server teacher cannot serve (raised at trainer construction, as TRL does).

    Args:
        args: An `SDFTConfig` or `SDPOConfig` with `use_teacher_server=True`.
        distillation_weight: SDPO's `distillation_weight` (None for SDFT): the policy-loss blend needs full logits.

    Raises:
        ValueError: Without vLLM server-mode generation, with a teacher other than `"live"`, with
            `distillation_mode="full_logits"`, with `topk_logits` and no `distillation_topk`, or with a
            `distillation_weight` other than 1.
    """
    if not (args.use_vllm and args.vllm_mode == "server"):
        raise ValueError(
            "`use_teacher_server=True` requires `use_vllm=True` and `vllm_mode='server'`: teacher logprobs are served "
            "by the same vLLM server used for generation."
        )
    if args.teacher_model_kind != "live":
        raise ValueError(
            "`use_teacher_server=True` only supports `teacher_model_kind='live'` (the generation server holds the "
            f"current student weights), got {args.teacher_model_kind!r}."
        )
    if args.distillation_mode not in ("sampled_token", "topk_logits"):
        raise ValueError(
            "`use_teacher_server=True` only supports `distillation_mode` in {'sampled_token', 'topk_logits'}, got "
            f"{args.distillation_mode!r}. The server returns the teacher's top-k logprobs, not the full vocabulary, "
            "so `full_logits` is unavailable. Note `topk_logits` distills over the teacher's own top-k support (the "
            "server cannot score the student's top-k indices)."
        )
    if distillation_weight is not None and distillation_weight != 1.0:
        raise ValueError(
            "`use_teacher_server=True` only supports pure self-distillation with `distillation_weight=1.0`, got "
            f"{distillation_weight}. A convex blend with the policy loss needs the full-vocabulary logits, which the "
            "server does not return."
        )
    if args.distillation_mode == "topk_logits" and args.distillation_topk is None:
        raise ValueError(
            "`use_teacher_server=True` with `distillation_mode='topk_logits'` needs `distillation_topk` (the number "
            "of teacher log-probabilities the server returns per token); got None. Set e.g. `distillation_topk=100`."
        )


def score_on_server(trainer: Any, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The server teacher's log-probabilities of this process's completions after their teacher prompts.

    The server first gets the student's current weights (when they changed since the last push); then every process's
    requests are scored by the main process's client and handed back.

    Returns:
        `actual` `(B, C)`: log-probability of each completion token (`-inf` past a row's end); `top` and `top_ids`
        `(B, C, k)`: the teacher's top-k log-probabilities and token ids per position.
    """
    from accelerate.utils import broadcast_object_list, gather_object

    args, accelerator, generation = trainer.args, trainer.accelerator, trainer.vllm_generation
    if generation._synced_version != trainer.state.global_step:
        generation.sync_weights(trainer.model_wrapped)
        generation._synced_version = trainer.state.global_step
    accelerator.wait_for_everyone()

    prompt_mask, completion_mask = inputs["teacher_prompt_mask"], inputs["completion_mask"].long()
    sequences, prompt_lengths, _ = build_teacher_request_inputs(
        torch.cat([inputs["teacher_prompt_ids"], inputs["completion_ids"]], dim=1),
        torch.cat([prompt_mask, completion_mask], dim=1),
        torch.cat([prompt_mask, torch.zeros_like(completion_mask)], dim=1),
    )
    top_k = args.distillation_topk if args.distillation_mode == "topk_logits" else 1
    requests = gather_object([(sequences, prompt_lengths)])
    results: list[Any] = [None] * len(requests)
    if accelerator.is_main_process:
        all_sequences = [seq for chunk in requests for seq in chunk[0]]
        all_lengths = [length for chunk in requests for length in chunk[1]]
        scored = generation.client.get_sequence_logprobs(
            all_sequences, all_lengths, top_logprobs=top_k, temperature=args.temperature
        )
        start = 0
        for index, chunk in enumerate(requests):
            end = start + len(chunk[0])
            results[index] = {key: values[start:end] for key, values in scored.items()}
            start = end
    if accelerator.num_processes > 1:
        broadcast_object_list(results, from_process=0)
    mine = results[accelerator.process_index]

    batch, width = inputs["completion_ids"].shape
    device = inputs["completion_ids"].device
    actual = torch.full((batch, width), float("-inf"), device=device)
    top = torch.full((batch, width, top_k), float("-inf"), device=device)
    top_ids = torch.zeros((batch, width, top_k), dtype=torch.long, device=device)
    for row in range(batch):
        n = min(len(mine["actual_logprobs"][row]), width)
        if n == 0:
            continue
        actual[row, :n] = torch.tensor(mine["actual_logprobs"][row][:n], device=device)
        top[row, :n] = torch.tensor([values[:top_k] for values in mine["logprobs"][row][:n]], device=device)
        top_ids[row, :n] = torch.tensor([ids[:top_k] for ids in mine["logprob_token_ids"][row][:n]], device=device)
    valid = completion_mask.bool()
    if not torch.isfinite(actual[valid]).all():
        raise ValueError(
            "The teacher server returned no log-probability for some completion tokens: the server must score every "
            "completion token (check that it serves the student's model and tokenizer)."
        )
    return {"actual": actual, "top": top, "top_ids": top_ids}


def server_self_distillation_per_token(
    student_logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    teacher: dict[str, torch.Tensor],
    args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(B, C)` per-token self-distillation loss against the server teacher, and the mean absolute difference
    between the teacher's and the student's log-probability of the sampled tokens (`server_logprob_abs_diff`).

    `sampled_token`: `sg(log p_S(y) - log p_T(y)) * log p_S(y)`. `topk_logits`: the student's true log-probabilities
    gathered on the teacher's top-k tokens, then the tail bucket or the renormalisation and the divergence of
    `distillation_alpha`, as with a local teacher. Positions past a completion's end are neutralised (zero loss).
    """
    valid = completion_mask.bool()
    student_logps = token_log_probs(student_logits, completion_ids)
    teacher_logps = torch.where(valid, teacher["actual"], student_logps.detach())
    diff = (teacher_logps - student_logps.detach()).abs()
    abs_diff = diff[valid].mean() if valid.any() else diff.sum() * 0.0
    if args.distillation_mode == "sampled_token":
        return (student_logps - teacher_logps).detach() * student_logps, abs_diff
    top_ids = teacher["top_ids"]
    student_on = student_logits.gather(-1, top_ids) - torch.logsumexp(student_logits, dim=-1, keepdim=True)
    # Past a row's end (and in slots the server left empty) the teacher copies the student: zero divergence there.
    teacher_on = torch.where(torch.isfinite(teacher["top"]), teacher["top"], student_on.detach())
    student_on, teacher_on = _support_log_probs(student_on, teacher_on, args.distillation_add_tail)
    return compute_divergence(student_on, teacher_on, args.distillation_alpha), abs_diff
