"""Prefix-tree packing of rollout samples and the attention that runs on the packed layout.

Samples of one prompt group share their prompt tokens, and multi-turn samples share whole turns. A [`TreeRow`] stores
the samples of one packed row as a trie, so each shared token is forwarded once; [`tree_attention`] lets every
token attend to the tokens on its root-to-token path only.
"""

from __future__ import annotations

from typing import Any

import torch


TREE_ATTENTION = "tree_fa3"

# A trie node is keyed on (its token, the token after it): two samples that diverge at position i + 1 already part at
# position i, so every node predicts exactly one next token (one label per packed position).
_Key = tuple[int, int | None]


def _as_list(values: Any) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


class TreeRow:
    """One packed row: the prefix trie of the samples placed in it.

    Samples are dicts with `input_ids`, `completion_mask`, `old_log_probs`, `advantage` and `group_id` (what
    `RolloutQueueDataset` yields). `load` estimates the attention cost of the row: every node adds its depth + 1.
    """

    def __init__(self):
        self.samples: list[dict] = []
        self.sample_nodes: list[list[int]] = []
        self.tokens: list[int] = []
        self.depths: list[int] = []
        self.children: list[dict[_Key, int]] = []
        self.roots: dict[_Key, int] = {}
        self.groups: set[int] = set()
        self.trained = 0
        self.load = 0

    @staticmethod
    def _keys(ids: list[int]) -> list[_Key]:
        return [(token, ids[i + 1] if i + 1 < len(ids) else None) for i, token in enumerate(ids)]

    def _shared_nodes(self, keys: list[_Key]) -> int:
        """How many leading nodes of a sample with these keys already exist in the trie."""
        table, shared = self.roots, 0
        for key in keys:
            node = table.get(key)
            if node is None:
                break
            shared += 1
            table = self.children[node]
        return shared

    def fits(self, sample: dict, budget: int) -> bool:
        """Whether the row stays within `budget` forwarded tokens and `budget` trained tokens with `sample` added."""
        keys = self._keys(_as_list(sample["input_ids"]))
        new_nodes = len(keys) - self._shared_nodes(keys)
        trained = int(sum(_as_list(sample["completion_mask"])))
        return len(self.tokens) + new_nodes <= budget and self.trained + trained <= budget

    def add(self, sample: dict) -> None:
        """Insert `sample` into the trie (the caller checked `fits`)."""
        ids = _as_list(sample["input_ids"])
        table, path = self.roots, []
        for depth, key in enumerate(self._keys(ids)):
            node = table.get(key)
            if node is None:
                node = len(self.tokens)
                self.tokens.append(key[0])
                self.depths.append(depth)
                self.children.append({})
                table[key] = node
                self.load += depth + 1
            path.append(node)
            table = self.children[node]
        self.samples.append(sample)
        self.sample_nodes.append(path)
        self.groups.add(sample["group_id"])
        self.trained += int(sum(_as_list(sample["completion_mask"])))

    def _layout(self) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """Depth-first order of the nodes (children in insertion order), split into segments.

        A segment is a chain of nodes each the only child of the previous one; it ends at a leaf or a branching node.
        Returns `(node order, segments as packed positions, key/value positions of each segment)`, the latter being
        the positions of the segment's root-to-end path.
        """
        order: list[int] = []
        segments: list[list[int]] = []
        paths: list[list[int]] = []
        # Each stack entry: (node, positions of its ancestors, whether it continues its parent's segment).
        stack = [(node, [], False) for node in reversed(list(self.roots.values()))]
        while stack:
            node, ancestors, continues = stack.pop()
            position = len(order)
            order.append(node)
            if continues:
                segments[-1].append(position)
                paths[-1].append(position)
            else:
                segments.append([position])
                paths.append([*ancestors, position])
            kids = list(self.children[node].values())
            path = paths[-1]
            for kid in reversed(kids):
                stack.append((kid, path if len(kids) == 1 else list(path), len(kids) == 1))
        return order, segments, paths

    def pack(self) -> dict[str, torch.Tensor]:
        """The packed row: token layout, tree-attention metadata and one entry per trained token."""
        order, segments, paths = self._layout()
        position_of = [0] * len(self.tokens)
        for position, node in enumerate(order):
            position_of[node] = position
        labels = [-100] * len(order)
        token_index, old_log_probs, advantages, segment_id = [], [], [], []
        for index, (sample, nodes) in enumerate(zip(self.samples, self.sample_nodes, strict=True)):
            ids = _as_list(sample["input_ids"])
            mask = _as_list(sample["completion_mask"])
            logps = _as_list(sample["old_log_probs"])
            for i in range(1, len(ids)):
                if mask[i]:
                    position = position_of[nodes[i - 1]]
                    labels[position] = ids[i]
                    token_index.append(position)
                    old_log_probs.append(logps[i])
                    advantages.append(float(sample["advantage"]))
                    segment_id.append(index)
        kv_index = [position for path in paths for position in path]
        cu_q, cu_k = [0], [0]
        for segment, path in zip(segments, paths, strict=True):
            cu_q.append(cu_q[-1] + len(segment))
            cu_k.append(cu_k[-1] + len(path))
        return {
            "input_ids": torch.tensor([self.tokens[node] for node in order], dtype=torch.long),
            "position_ids": torch.tensor([self.depths[node] for node in order], dtype=torch.long),
            "shift_labels": torch.tensor(labels, dtype=torch.long),
            "tree_kv_index": torch.tensor(kv_index, dtype=torch.long),
            "tree_cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32),
            "tree_cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32),
            "tree_max_seqlens": torch.tensor(
                [max(map(len, segments), default=0), max(map(len, paths), default=0)], dtype=torch.long
            ),
            "token_index": torch.tensor(token_index, dtype=torch.long),
            "old_log_probs": torch.tensor(old_log_probs, dtype=torch.float32),
            "advantages": torch.tensor(advantages, dtype=torch.float32),
            "segment_id": torch.tensor(segment_id, dtype=torch.long),
        }


def tree_visibility_mask(
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    num_positions: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`(T, T)` boolean mask: query position p may attend key position a iff a lies on p's root-to-p path.

    Within a segment of `q` queries whose path holds `k` positions, the `t`-th query sees the first `k - q + t + 1`
    path positions (the last `q` of them are the segment itself), and with `sliding_window` only the latest
    `sliding_window` of those.
    """
    mask = torch.zeros(num_positions, num_positions, dtype=torch.bool, device=tree_kv_index.device)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for segment in range(len(cu_q) - 1):
        q_start, q_end, k_start, k_end = cu_q[segment], cu_q[segment + 1], cu_k[segment], cu_k[segment + 1]
        if q_start < 0 or q_end <= q_start:
            continue
        path = tree_kv_index[k_start:k_end]
        num_q, num_k = q_end - q_start, k_end - k_start
        query_rank = torch.arange(num_q, device=path.device).unsqueeze(1)
        key_rank = torch.arange(num_k, device=path.device).unsqueeze(0)
        visible = key_rank <= num_k - num_q + query_rank
        if sliding_window is not None:
            visible &= key_rank > num_k - num_q + query_rank - sliding_window
        rows = torch.arange(q_start, q_end, device=path.device)
        mask[rows.unsqueeze(1).expand(-1, num_k), path.unsqueeze(0).expand(num_q, -1)] = visible
    return mask


def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    tree_kv_index: torch.Tensor | None = None,
    tree_cu_seqlens_q: torch.Tensor | None = None,
    tree_cu_seqlens_k: torch.Tensor | None = None,
    tree_max_seqlen_q: int | None = None,
    tree_max_seqlen_k: int | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed prefix-tree row (batch of one row, `query` shaped `(1, heads, T, dim)`).

    Every packed segment attends causally to the keys/values along its root-to-segment path. This implementation
    computes the scores in plain PyTorch with a visibility mask (any device); grouped-query heads are expanded.
    Without tree metadata (a plain forward, e.g. generation) it falls back to causal SDPA.

    Returns:
        `(output shaped (1, T, heads, dim), None)`, the layout transformers' attention functions return.
    """
    if tree_kv_index is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, sliding_window=sliding_window, **kwargs
        )
    del attention_mask, tree_max_seqlen_q, tree_max_seqlen_k, kwargs
    if query.shape[0] != 1:
        raise ValueError(f"tree attention runs on one packed row at a time; got a batch of {query.shape[0]}.")
    num_positions = query.shape[2]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = tree_visibility_mask(
        tree_kv_index.reshape(-1), tree_cu_seqlens_q.reshape(-1), tree_cu_seqlens_k.reshape(-1), num_positions,
        sliding_window,
    )  # fmt: skip
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(value.dtype)
    output = torch.matmul(weights, value)
    return output.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """Mask builder for the tree attention: the tree metadata replaces the attention mask."""
    return None


def register_tree_attention() -> None:
    """Register [`tree_attention`] under `TREE_ATTENTION` in transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, _no_mask)
