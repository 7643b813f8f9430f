"""GRPO with a replay buffer: GRPO, except that groups without a learning signal are swapped for stored groups.

A group whose rewards are all equal has zero advantages and teaches nothing. Groups whose rewards vary are stored in a
bounded [`ReplayBuffer`] (score: the group's reward std times the sum of its absolute advantages); each zero-variance
group of a training batch is replaced by a stored group, sampled with probability proportional to its score. Replayed
groups are re-padded to the batch (prompts on the left, completions on the right) and keep their own advantages and
log-probabilities. Evaluation batches are left untouched; the logged rewards are those of the fresh completions.
"""

from typing import Any

import torch

from ...trainer.grpo_trainer import GRPOTrainer
from ...trainer.online_math import aggregate_rewards
from ...trainer.utils import pad
from .grpo_with_replay_buffer_config import GRPOWithReplayBufferConfig


PROMPT_KEYS = ("prompt_ids", "prompt_mask")
# Per-token tensors aligned with the completion columns (right-padded).
COMPLETION_KEYS = (
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
)


# ---------------------------------------------------------------------------------------------------------------------
# The buffer: a min-heap on the score (heapq's layout, comparing scores only so equal scores never compare the data)
# ---------------------------------------------------------------------------------------------------------------------
def _sift_toward_root(heap: list, pos: int) -> None:
    item = heap[pos]
    while pos > 0:
        parent = (pos - 1) >> 1
        if item[0] < heap[parent][0]:
            heap[pos] = heap[parent]
            pos = parent
            continue
        break
    heap[pos] = item


def _replace_root(heap: list, item: tuple) -> None:
    # Move the smaller child up until a leaf is reached, put the item there, then let it rise (heapq.heapreplace).
    end, pos, child = len(heap), 0, 1
    while child < end:
        right = child + 1
        if right < end and not heap[child][0] < heap[right][0]:
            child = right
        heap[pos] = heap[child]
        pos, child = child, 2 * child + 1
    heap[pos] = item
    _sift_toward_root(heap, pos)


class ReplayBuffer:
    """Keeps the `max_size` highest-scored items; samples them with probability proportional to their score.

    `heap` is a list of `(score, data)` pairs in min-heap order (the lowest score first): a new item enters while
    there is room, otherwise only if its score beats the lowest, which it evicts.

    Args:
        max_size (`int`): Most items kept.
    """

    def __init__(self, max_size: int):
        self.max_size = max_size
        self.heap: list[tuple[float, dict[str, Any]]] = []

    def __len__(self) -> int:
        return len(self.heap)

    def add(self, scores: list[float], data: list[dict]) -> None:
        """Offer `data[i]` with score `scores[i]`, in order."""
        if len(scores) != len(data):
            raise ValueError(f"add() needs one score per item; got {len(scores)} scores for {len(data)} items.")
        for score, item in zip(scores, data):
            entry = (float(score), item)
            if len(self.heap) < self.max_size:
                self.heap.append(entry)
                _sift_toward_root(self.heap, len(self.heap) - 1)
            elif self.heap and entry[0] > self.heap[0][0]:
                _replace_root(self.heap, entry)

    def sample(self, num_samples: int) -> list[dict[str, torch.Tensor]] | None:
        """`num_samples` stored items drawn with probability proportional to their score (with replacement only when
        more are asked than stored); None when the buffer is empty."""
        if not self.heap:
            return None
        scores = torch.tensor([score for score, _ in self.heap], dtype=torch.float32)
        weights = scores if scores.sum() > 0 else torch.ones_like(scores)
        chosen = torch.multinomial(weights / weights.sum(), num_samples, replacement=num_samples > len(self.heap))
        return [self.heap[i][1] for i in chosen.tolist()]


def _is_completion_aligned(key: str, value: torch.Tensor, width: int) -> bool:
    return key in COMPLETION_KEYS and value.dim() == 2 and value.shape[1] == width


def per_group_std(group_std_rewards: torch.Tensor, num_groups: int) -> torch.Tensor:
    """`(num_groups,)` reward stds from `(num_groups,)` or `(num_groups, G)` input.

    A 2-D input normally repeats each group's std along its row. TRL's own tests broadcast the `(num_groups,)` vector
    along the rows instead (`std(dim=1).expand_as(advantages)`, so group `g` is column `g`); rows that are not
    constant mean that layout.
    """
    stds = group_std_rewards.detach().float()
    if stds.dim() == 1:
        return stds
    if bool((stds == stds[:, :1]).all()):
        return stds[:, 0]
    if stds.shape[1] != num_groups:
        raise ValueError(
            f"group_std_rewards of shape {tuple(stds.shape)} holds neither one std per row nor one per column for "
            f"{num_groups} groups; pass a (num_groups,) tensor."
        )
    return stds.max(dim=0).values


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------
class GRPOWithReplayBufferTrainer(GRPOTrainer):
    """[`GRPOTrainer`] that replaces zero-reward-variance groups with stored groups that had a learning signal.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.grpo_with_replay_buffer import GRPOWithReplayBufferConfig, GRPOWithReplayBufferTrainer

    trainer = GRPOWithReplayBufferTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=lambda completions, **kw: [float("a" in c) for c in completions],
        args=GRPOWithReplayBufferConfig(output_dir="grpo-replay-out", replay_buffer_size=16, max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
    )
    trainer.train()
    ```

    Args:
        args (`GRPOWithReplayBufferConfig` or `None`, defaults to `None`):
            Training configuration; `replay_buffer_size` bounds the buffer.
        **kwargs: Every other [`GRPOTrainer`] argument (`model`, `reward_funcs`, `train_dataset`, ...).
    """

    _tag_names = ["trl", "grpo", "replay-buffer"]
    _config_class = GRPOWithReplayBufferConfig

    def __init__(self, args: GRPOWithReplayBufferConfig | None = None, **kwargs):
        super().__init__(args=args, **kwargs)
        size = getattr(self.args, "replay_buffer_size", GRPOWithReplayBufferConfig.replay_buffer_size)
        self.replay_buffer = ReplayBuffer(max_size=size)

    def _checkpoint_state(self) -> dict[str, Any]:
        # The buffer is per process and cannot be rebuilt from the data seen: a resumed run needs its contents.
        state = super()._checkpoint_state()
        state["replay_buffer"] = [
            [score, {k: v.cpu() for k, v in data.items()}] for score, data in self.replay_buffer.heap
        ]
        return state

    def _restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        super()._restore_checkpoint_state(state)
        if "replay_buffer" in state:
            device = self.accelerator.device
            self.replay_buffer.heap = [
                (float(score), {k: v.to(device) for k, v in data.items()}) for score, data in state["replay_buffer"]
            ]

    # ------------------------------------------------------------------------------------------------------------
    # The hook: once GRPO has set the advantages of a training batch
    # ------------------------------------------------------------------------------------------------------------
    def _finish_rollout_batch(self, batch: dict[str, Any], rewards_per_func: torch.Tensor) -> dict[str, Any]:
        if self._mode != "train" or self.replay_buffer.max_size == 0:
            return batch
        group = self.num_generations
        rows = batch["prompt_ids"].shape[0]
        if rows % group:
            raise ValueError(
                f"The replay buffer swaps whole groups, so each process needs a multiple of num_generations "
                f"({group}) completions per generation batch; it has {rows}. Adjust per_device_train_batch_size or "
                "steps_per_generation."
            )
        rewards = aggregate_rewards(rewards_per_func, self.reward_weights.to(rewards_per_func.device))
        first = self.accelerator.process_index * rows // group
        stds = rewards.view(-1, group).std(dim=1)[first : first + rows // group].to(batch["advantages"].device)
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        replaced = self._replay(tensors, stds)
        return batch if replaced is None else {**batch, **replaced}

    def _replay(self, tensors: dict[str, torch.Tensor], stds: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Store the varying groups of `tensors` (row tensors of one batch), then replace its zero-variance groups by
        sampled stored ones; returns the new tensors, or None when nothing was replaced."""
        has_variance = stds > 0
        group = tensors["prompt_ids"].shape[0] // stds.shape[0]
        self.replay_buffer.add(*self._groups_to_store(tensors, stds, has_variance, group))
        missing = int((~has_variance).sum())
        if missing == 0:
            return None
        sampled = self.replay_buffer.sample(missing)
        if not sampled:
            return None
        return self._assemble(tensors, has_variance, sampled, group)

    @staticmethod
    def _group_slice(tensors: dict[str, torch.Tensor], index: int, group: int) -> dict[str, torch.Tensor]:
        """Group `index`'s rows, without the prompt and completion columns that are padding in all of them."""
        rows = slice(index * group, (index + 1) * group)
        width = tensors["completion_ids"].shape[1]
        attended = tensors["completion_mask"]
        prompt_columns = tensors["prompt_mask"][rows].bool().any(dim=0)
        completion_columns = attended[rows].bool().any(dim=0)
        out = {}
        for key, value in tensors.items():
            if key in PROMPT_KEYS:
                value = value[rows][:, prompt_columns]
            elif _is_completion_aligned(key, value, width):
                value = value[rows][:, completion_columns]
            else:
                value = value[rows]
            out[key] = value.detach().clone()
        return out

    def _groups_to_store(self, tensors, stds, has_variance, group) -> tuple[list[float], list[dict]]:
        scores, items = [], []
        advantages = tensors["advantages"].reshape(-1, group)
        for index in torch.nonzero(has_variance).flatten().tolist():
            scores.append(float(stds[index] * advantages[index].abs().sum()))
            items.append(self._group_slice(tensors, index, group))
        return scores, items

    def _assemble(self, tensors, has_variance, sampled, group) -> dict[str, torch.Tensor]:
        """The batch with each zero-variance group replaced by the next sampled one, all re-padded to a common width."""
        groups, queue = [], iter(sampled)
        for index, keep in enumerate(has_variance.tolist()):
            groups.append(self._group_slice(tensors, index, group) if keep else next(queue))
        device = tensors["prompt_ids"].device
        width = tensors["completion_ids"].shape[1]
        out = {}
        for key, value in tensors.items():
            if any(key not in g for g in groups):
                raise ValueError(
                    f"A replayed group lacks '{key}', which this batch has; every stored group needs the same keys "
                    "as the batches it replaces groups of."
                )
            parts = [torch.as_tensor(g[key]).to(device) for g in groups]
            if key in PROMPT_KEYS or _is_completion_aligned(key, value, width):
                side = "left" if key in PROMPT_KEYS else "right"
                fill = self.pad_token_id if key in ("prompt_ids", "completion_ids") else 0
                rows = [row for part in parts for row in part]
                out[key] = pad(rows, fill, side).to(value.dtype)
            else:
                out[key] = torch.cat([p.reshape(group, *value.shape[1:]) for p in parts]).to(value.dtype)
        return out

    # ------------------------------------------------------------------------------------------------------------
    # TRL's helper methods (public)
    # ------------------------------------------------------------------------------------------------------------
    def slice_group_data(
        self, data: torch.Tensor, mask: torch.Tensor, group_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of group `group_idx` (`num_generations` consecutive rows) of `data` and `mask`, without the columns
        that are padding (mask 0) in every one of those rows."""
        rows = slice(group_idx * self.num_generations, (group_idx + 1) * self.num_generations)
        group_mask = mask[rows]
        columns = group_mask.bool().any(dim=0)
        return data[rows][:, columns], group_mask[:, columns]

    def update_replay_buffer(
        self,
        groups_with_variance: torch.Tensor,
        group_advantages: torch.Tensor,
        group_std_rewards: torch.Tensor,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        forward_kwargs: dict,
        optional_vision_fields: list[str] | None = None,
        old_per_token_logps: torch.Tensor | None = None,
        ref_per_token_logps: torch.Tensor | None = None,
        importance_sampling_ratio: torch.Tensor | None = None,
    ) -> None:
        """Store every group flagged in `groups_with_variance` (`(num_groups,)` bools), scored by its reward std times
        the sum of its absolute advantages (`group_advantages`: `(num_groups, G)`)."""
        tensors = self._named_tensors(locals())
        num_groups = group_advantages.shape[0]
        stds = per_group_std(group_std_rewards, num_groups)
        flags = torch.as_tensor(groups_with_variance, dtype=torch.bool).reshape(-1).expand(num_groups)
        self.replay_buffer.add(*self._groups_to_store(tensors, stds, flags, group_advantages.shape[1]))

    def sample_from_replay_buffer(
        self, num_samples: int, optional_vision_fields: list[str] | None = None, optional_tensor_fields=None
    ) -> list[dict]:
        """`num_samples` stored groups (see [`ReplayBuffer.sample`]); an empty list when the buffer is empty."""
        return self.replay_buffer.sample(num_samples) or []

    def update_with_replay_buffer(
        self,
        group_advantages: torch.Tensor,
        group_std_rewards: torch.Tensor,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        forward_kwargs: dict,
        num_items_in_batch: int,
        old_per_token_logps: torch.Tensor | None = None,
        ref_per_token_logps: torch.Tensor | None = None,
        importance_sampling_ratio: torch.Tensor | None = None,
    ) -> dict[str, Any] | None:
        """Store the groups whose rewards vary, then replace the others with sampled stored groups.

        Args:
            group_advantages: `(num_groups, G)` advantages.
            group_std_rewards: Each group's reward std, `(num_groups,)` or repeated to `(num_groups, G)`.
            prompt_ids, prompt_mask, completion_ids, completion_mask: `(num_groups * G, ...)` batch tensors.
            forward_kwargs: Extra per-row model inputs (e.g. `pixel_values`), stored and replayed with their rows.
            num_items_in_batch: Passed through to the output.
            old_per_token_logps, ref_per_token_logps, importance_sampling_ratio: Optional per-token tensors.

        Returns:
            None when no group was replaced; otherwise the batch tensors (advantages as `(num_groups, G)`), the
            forward kwargs and `num_items_in_batch`.
        """
        tensors = self._named_tensors(locals())
        num_groups, group = group_advantages.shape
        replaced = self._replay(tensors, per_group_std(group_std_rewards, num_groups))
        if replaced is None:
            return None
        replaced["advantages"] = replaced["advantages"].reshape(num_groups, group)
        replaced["num_items_in_batch"] = num_items_in_batch
        return replaced

    @staticmethod
    def _named_tensors(arguments: dict[str, Any]) -> dict[str, torch.Tensor]:
        names = (*PROMPT_KEYS, "completion_ids", "completion_mask")
        names += ("old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")
        tensors = {name: arguments[name] for name in names if isinstance(arguments.get(name), torch.Tensor)}
        tensors["advantages"] = arguments["group_advantages"].reshape(-1)
        tensors.update({k: v for k, v in (arguments.get("forward_kwargs") or {}).items() if torch.is_tensor(v)})
        return tensors
