"""Universal Logit Distillation (Boizard et al., 2024) across tokenizers, with GOLD's tokenizer-aware alignment.

The student and the teacher read the same prompt + completion text, each through its own tokenizer. Their completion
tokens are paired up, and at each pair the two next-token distributions are compared through their *sorted*
probabilities (which needs no shared vocabulary):

    ULD(p_S, p_T) = sum_k | sort(p_S)_k - sort(p_T)_k |        (the shorter vector padded with zeros)

Pairing (`use_extended_uld`):

- False: positional, as in the ULD paper: the i-th completion token of the student with the i-th of the teacher, both
  sequences cut to the shorter one.
- True: by text. Each token covers a byte span of the completion text; tokens are grouped so that a student group and
  a teacher group end at the same byte (e.g. student `1`, `2` against teacher `12`). A group of several tokens gets
  one distribution: the probability of the group's text starting with each token, i.e. the first position's
  distribution times the probabilities of the tokens actually observed at the later positions (`observed`), or the
  last position's distribution times those of the earlier observed tokens (`bayesian`, which reads each token's
  predictive distribution: the logits one position earlier).

Hybrid (`uld_use_hybrid_loss`): tokens spelled identically in both vocabularies are compared entry by entry with the
generalized JSD (the probabilities are not renormalised), the remaining entries with ULD, and the two terms are
weighted (by default by the share of the teacher's vocabulary that has a match).
"""

from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from ...trainer.utils import pad
from ...trainer.utils.divergence import generalized_jsd_from_log_probs
from .._chatml_collator import _completion_byte_offsets


Span = tuple[int, int]


def align_by_byte_offsets(
    student_spans: list[Span], teacher_spans: list[Span]
) -> tuple[list[list[int]], list[list[int]]]:
    """Group two tokenizations of one text into pieces that end at the same byte.

    Walks both span lists at once; a group grows on the side whose end lies behind until both ends coincide (or one
    side runs out). Tokens left over on one side form groups facing an empty group (zero-length spans such as an
    appended end-of-sequence token end up there).

    Args:
        student_spans: `(start, end)` byte span of each student token, in order.
        teacher_spans: Same for the teacher.

    Returns:
        `(student_groups, teacher_groups)`: aligned lists of token-index groups (a group may be empty).
    """
    student_groups, teacher_groups = [], []
    i = j = 0
    while i < len(student_spans) and j < len(teacher_spans):
        group_s, group_t = [i], [j]
        end_s, end_t = student_spans[i][1], teacher_spans[j][1]
        i, j = i + 1, j + 1
        while end_s != end_t:
            if end_s < end_t:
                if i >= len(student_spans):
                    break
                group_s.append(i)
                end_s = student_spans[i][1]
                i += 1
            else:
                if j >= len(teacher_spans):
                    break
                group_t.append(j)
                end_t = teacher_spans[j][1]
                j += 1
        student_groups.append(group_s)
        teacher_groups.append(group_t)
    for rest in range(i, len(student_spans)):
        student_groups.append([rest])
        teacher_groups.append([])
    for rest in range(j, len(teacher_spans)):
        student_groups.append([])
        teacher_groups.append([rest])
    return student_groups, teacher_groups


def merge_group_probabilities(
    probs: torch.Tensor, groups: list[list[int]], token_ids: torch.Tensor | None, strategy: str = "observed"
) -> torch.Tensor:
    """One distribution per group of consecutive positions.

    Args:
        probs: `(positions, V)` probabilities; row `k` is the distribution of the token at position `k`.
        groups: Non-empty lists of row indices.
        token_ids: `(positions,)` the tokens actually observed; needed as soon as a group has several rows.
        strategy: `"observed"`: the first row's distribution times the probabilities of the observed tokens at the
            later rows; `"bayesian"`: the last row's distribution times those at the earlier rows.

    Returns:
        `(len(groups), V)`.
    """
    if strategy not in ("observed", "bayesian"):
        raise ValueError(f"The token merge strategy must be 'observed' or 'bayesian', got {strategy!r}.")
    merged = []
    for group in groups:
        if len(group) == 1:
            merged.append(probs[group[0]])
            continue
        if token_ids is None:
            raise ValueError(
                "token_ids must be provided when merging multi-token groups: the probabilities of the tokens actually "
                "observed at the group's other positions scale the kept distribution."
            )
        kept, others = (group[0], group[1:]) if strategy == "observed" else (group[-1], group[:-1])
        index = torch.tensor(others, device=probs.device)
        observed = probs[index, token_ids[index].to(probs.device)].prod()
        merged.append(probs[kept] * observed)
    return torch.stack(merged)


def sorted_probability_distance(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """ULD's distance per row: L1 between the descending-sorted probability vectors, padded to the larger width."""
    width = max(student_probs.shape[-1], teacher_probs.shape[-1])
    student_probs = F.pad(student_probs, (0, width - student_probs.shape[-1]))
    teacher_probs = F.pad(teacher_probs, (0, width - teacher_probs.shape[-1]))
    student_sorted = student_probs.sort(dim=-1, descending=True).values
    teacher_sorted = teacher_probs.sort(dim=-1, descending=True).values
    return (student_sorted - teacher_sorted).abs().sum(dim=-1)


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    return set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})


def shared_vocabulary(
    student_tokenizer: PreTrainedTokenizerBase, teacher_tokenizer: PreTrainedTokenizerBase
) -> dict[int, int]:
    """Teacher token id -> student token id for every ordinary (non-added) token spelled the same in both."""
    student_vocab = student_tokenizer.get_vocab()
    student_special, teacher_special = _special_ids(student_tokenizer), _special_ids(teacher_tokenizer)
    mapping = {}
    for piece, teacher_id in teacher_tokenizer.get_vocab().items():
        student_id = student_vocab.get(piece)
        if student_id is not None and teacher_id not in teacher_special and student_id not in student_special:
            mapping[teacher_id] = student_id
    return mapping


class ULDLoss(torch.nn.Module):
    """Universal Logit Distillation loss between a student and a teacher with different tokenizers.

    `loss = uld_crossentropy_weight * CE(student) + uld_distillation_weight * distillation`, where `CE` is the
    student's next-token cross-entropy on its labels and `distillation` the mean over sequences of the mean over
    aligned completion positions of the sorted-probability distance (or of the hybrid loss).

    Args:
        config: A [`GOLDConfig`] (its `uld_*` fields, `use_extended_uld` and `beta` are read).
        student_tokenizer: Needed for the hybrid loss (shared vocabulary).
        teacher_tokenizer: Same.
        device: Unused placeholder for API compatibility; tensors stay where the logits are.
    """

    def __init__(self, config: Any, student_tokenizer=None, teacher_tokenizer=None, device=None):
        super().__init__()
        self.device = device
        self.crossentropy_weight = config.uld_crossentropy_weight
        self.distillation_weight = config.uld_distillation_weight
        self.student_temperature = config.uld_student_temperature
        self.teacher_temperature = config.uld_teacher_temperature
        self.skip_student_eos = config.uld_skip_student_eos
        self.skip_teacher_eos = config.uld_skip_teacher_eos
        self.use_extended_uld = config.use_extended_uld
        self.token_merge_strategy = config.uld_token_merge_strategy
        # `bayesian` reads each answer token's own predictive distribution (the logits one position earlier, so the
        # observed tokens' probabilities are those the model gave them); `observed` reads the logits at the token's
        # position, i.e. the distribution of what follows it. Both as TRL.
        self.logit_shift = 1 if self.token_merge_strategy == "bayesian" else 0
        self.ignore_index = -100
        self.student_tokenizer = student_tokenizer
        self.teacher_tokenizer = teacher_tokenizer
        self.use_hybrid_loss = config.uld_use_hybrid_loss
        self.hybrid_matched_weight = config.uld_hybrid_matched_weight
        self.hybrid_unmatched_weight = config.uld_hybrid_unmatched_weight
        self.beta = config.beta
        if self.use_hybrid_loss:
            if student_tokenizer is None or teacher_tokenizer is None:
                raise ValueError(
                    "The hybrid ULD loss compares the tokens the two vocabularies share: pass both the student and "
                    "the teacher tokenizer to ULDLoss."
                )
            mapping = shared_vocabulary(student_tokenizer, teacher_tokenizer)
            teacher_ids = sorted(mapping)
            self._teacher_matched = torch.tensor(teacher_ids, dtype=torch.long)
            self._student_matched = torch.tensor([mapping[t] for t in teacher_ids], dtype=torch.long)
            self._matched_share = len(mapping) / len(teacher_tokenizer)

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        student_labels: torch.Tensor,
        teacher_labels: torch.Tensor,
        student_input_ids: torch.Tensor,
        teacher_input_ids: torch.Tensor,
        student_byte_offsets: torch.Tensor | None = None,
        teacher_byte_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The weighted loss.

        Logits and labels are position-aligned (the logits at a labelled position are taken as the distribution of
        that position's token); `*_byte_offsets` `(batch, length, 2)` give each completion token's span in the
        completion text and are required with `use_extended_uld`.
        """
        loss = student_logits.new_zeros(())
        if self.crossentropy_weight > 0:
            cross_entropy = F.cross_entropy(
                student_logits[:, :-1].flatten(0, 1).float(),
                student_labels[:, 1:].flatten(),
                ignore_index=self.ignore_index,
            )
            loss = loss + self.crossentropy_weight * cross_entropy
        if self.distillation_weight != 0:
            distillation = self.distillation_loss(
                student_logits,
                teacher_logits,
                student_labels,
                teacher_labels,
                student_input_ids,
                teacher_input_ids,
                student_byte_offsets,
                teacher_byte_offsets,
            )
            loss = loss + self.distillation_weight * distillation
        return loss

    def _answer_positions(self, labels: torch.Tensor, skip_last: bool) -> torch.Tensor:
        positions = (labels != self.ignore_index).nonzero().squeeze(-1)
        return positions[:-1] if skip_last and len(positions) > 0 else positions

    def distillation_loss(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        student_labels: torch.Tensor,
        teacher_labels: torch.Tensor,
        student_input_ids: torch.Tensor,
        teacher_input_ids: torch.Tensor,
        student_byte_offsets: torch.Tensor | None = None,
        teacher_byte_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The distillation term alone (mean over sequences that have aligned positions)."""
        if self.use_extended_uld and (student_byte_offsets is None or teacher_byte_offsets is None):
            raise ValueError(
                "use_extended_uld=True aligns tokens by their byte spans: pass student_byte_offsets and "
                "teacher_byte_offsets, or set use_extended_uld=False for positional alignment."
            )
        per_sequence = []
        self.last_hybrid_terms = {"matched_loss": [], "unmatched_loss": []}
        for row in range(student_logits.shape[0]):
            student_pos = self._answer_positions(student_labels[row], self.skip_student_eos)
            teacher_pos = self._answer_positions(teacher_labels[row], self.skip_teacher_eos)
            # Only the answer positions ever need probabilities (not the whole padded sequence).
            student_rows, teacher_rows = student_pos - self.logit_shift, teacher_pos - self.logit_shift
            student_probs = (student_logits[row, student_rows].float() / self.student_temperature).softmax(-1)
            with torch.no_grad():
                teacher_probs = (teacher_logits[row, teacher_rows].float() / self.teacher_temperature).softmax(-1)
            if self.use_extended_uld:
                groups_s, groups_t = align_by_byte_offsets(
                    student_byte_offsets[row, student_pos].tolist(), teacher_byte_offsets[row, teacher_pos].tolist()
                )
                kept = [k for k, (gs, gt) in enumerate(zip(groups_s, groups_t, strict=True)) if gs and gt]
                if not kept:
                    continue
                student_probs = merge_group_probabilities(
                    student_probs,
                    [groups_s[k] for k in kept],
                    student_input_ids[row, student_pos],
                    self.token_merge_strategy,
                )
                teacher_probs = merge_group_probabilities(
                    teacher_probs,
                    [groups_t[k] for k in kept],
                    teacher_input_ids[row, teacher_pos],
                    self.token_merge_strategy,
                )
            else:
                length = min(len(student_pos), len(teacher_pos))
                if length == 0:
                    continue
                student_probs, teacher_probs = student_probs[:length], teacher_probs[:length]
            if self.use_hybrid_loss:
                per_sequence.append(self.hybrid_loss(student_probs, teacher_probs))
            else:
                per_sequence.append(sorted_probability_distance(student_probs, teacher_probs).mean())
        if not per_sequence:
            return student_logits.sum() * 0.0  # nothing aligned: a zero that keeps the graph
        return torch.stack(per_sequence).mean()

    def hybrid_loss(self, student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
        """Generalized JSD on the shared vocabulary plus ULD on the rest, averaged over positions and weighted."""
        device = student_probs.device
        student_matched, teacher_matched = self._student_matched.to(device), self._teacher_matched.to(device)
        student_rest = torch.ones(student_probs.shape[-1], dtype=torch.bool, device=device)
        student_rest[student_matched] = False
        teacher_rest = torch.ones(teacher_probs.shape[-1], dtype=torch.bool, device=device)
        teacher_rest[teacher_matched] = False
        # Probabilities floored at 1e-8 before the log (as TRL): a merged group's product of probabilities can be
        # far smaller, and the floor also weights the KL terms (exp of the floored log).
        matched = generalized_jsd_from_log_probs(
            student_probs[:, student_matched].clamp_min(1e-8).log(),
            teacher_probs[:, teacher_matched].clamp_min(1e-8).log(),
            self.beta,
        )
        matched = matched.sum(-1).mean()
        unmatched = sorted_probability_distance(student_probs[:, student_rest], teacher_probs[:, teacher_rest]).mean()
        terms = getattr(self, "last_hybrid_terms", None)
        if terms is not None:  # read by the trainer for its `matched_loss` / `unmatched_loss` metrics
            terms["matched_loss"].append(matched.detach())
            terms["unmatched_loss"].append(unmatched.detach())
        if self.hybrid_matched_weight is None:
            return self._matched_share * matched + (1.0 - self._matched_share) * unmatched
        return self.hybrid_matched_weight * matched + self.hybrid_unmatched_weight * unmatched


def build_teacher_inputs_from_texts(
    tokenizer: PreTrainedTokenizerBase,
    prompt_texts: list[str],
    completion_texts: list[str],
    use_extended_uld: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize prompt + completion texts with the teacher's tokenizer, the teacher's eos closing each completion.

    The prompt gets the tokenizer's special tokens (e.g. a bos), minus a trailing eos; the completion is tokenized
    as plain text and the eos appended. Rows are right-padded.

    Args:
        tokenizer: The teacher's tokenizer.
        prompt_texts: One prompt text per row.
        completion_texts: One completion text per row.
        use_extended_uld: Also compute the completion tokens' byte spans (zeros otherwise).

    Returns:
        `(input_ids, labels, attention_mask, byte_offsets)`: labels are -100 outside the completion, the mask is
        boolean, byte offsets `(batch, length, 2)` are relative to the completion text.
    """
    if len(prompt_texts) != len(completion_texts):
        raise ValueError(
            f"Got {len(prompt_texts)} prompt texts but {len(completion_texts)} completion texts; pass one of each "
            "per row."
        )
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("The teacher's tokenizer has no eos token; set tokenizer.eos_token.")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    input_ids, labels, offsets = [], [], []
    for prompt_text, completion_text in zip(prompt_texts, completion_texts, strict=True):
        prompt_ids = tokenizer(prompt_text, add_special_tokens=True)["input_ids"]
        if prompt_ids and prompt_ids[-1] == eos_id:
            prompt_ids = prompt_ids[:-1]
        completion_ids = tokenizer(completion_text, add_special_tokens=False)["input_ids"] + [eos_id]
        input_ids.append(torch.tensor(prompt_ids + completion_ids))
        labels.append(torch.tensor([-100] * len(prompt_ids) + completion_ids))
        if use_extended_uld:
            spans = _completion_byte_offsets(tokenizer, completion_ids[:-1])
            end = spans[-1][1] if spans else 0
            spans = [(0, 0)] * len(prompt_ids) + spans + [(end, end)]
        else:
            spans = [(0, 0)] * (len(prompt_ids) + len(completion_ids))
        offsets.append(torch.tensor(spans, dtype=torch.long).reshape(-1, 2))
    attention = [torch.ones(len(ids), dtype=torch.bool) for ids in input_ids]
    return (
        pad(input_ids, padding_value=pad_id, padding_side="right"),
        pad(labels, padding_value=-100, padding_side="right"),
        pad(attention, padding_value=False, padding_side="right"),
        pad(offsets, padding_value=0, padding_side="right"),
    )


def print_prompt_completions_sample_uld(
    prompts: list[str], completions: list[str], step: int, num_samples: int | None = None
) -> None:
    """Print a table of prompts and their (generated) completions with rich.

    Args:
        prompts: Prompt texts.
        completions: Completion texts, aligned with `prompts`.
        step: Training step shown in the title.
        num_samples: If set (and smaller than the number of rows), print this many randomly chosen rows.
    """
    from ...trainer.utils.reporting import print_prompt_completions_sample

    print_prompt_completions_sample(prompts, completions, {}, None, step, num_samples)
