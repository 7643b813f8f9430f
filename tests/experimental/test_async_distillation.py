"""AsyncDistillation: configuration, teacher candidates, planning, padding-free collation, the loss against a
hand-written formula, and an end-to-end run whose teacher is a stub `vllm serve` HTTP server (OpenAI
`/v1/completions` with `prompt_logprobs`, backed by a small model) and whose student generates in process."""

import math
import queue
from collections import defaultdict

import numpy as np
import pytest
import torch

from trl.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer
from trl.experimental.async_distillation.async_distillation_trainer import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
    distillation_support,
)
from trl.experimental.async_distillation.async_rollout_worker import RolloutSample, teacher_candidates
from trl.trainer.utils.sparse_divergence import masked_sparse_divergence


def _sample(length, prompt=2, prompt_id=0, teacher="default", k=2):
    ids = np.full((length, k + 1), -1)
    lps = np.full((length, k + 1), -np.inf, dtype=np.float32)
    ids[prompt:, 0], lps[prompt:, 0] = 5, -0.5
    return {
        "input_ids": np.arange(length) + 10,
        "completion_mask": np.array([0] * prompt + [1] * (length - prompt)),
        "teacher_topk_ids": ids,
        "teacher_topk_logprobs": lps,
        "teacher_id": teacher,
        "prompt_id": prompt_id,
        "metrics": {},
    }


def test_config(tmp_path):
    args = AsyncDistillationConfig(output_dir=str(tmp_path), use_cpu=True)
    assert args.teacher_server_urls == {"default": "http://localhost:8001"}
    assert (args.beta, args.teacher_top_k, args.learning_rate, args.lr_scheduler_type) == (0.0, 8, 1e-6, "linear")
    assert args.accelerator_config.split_batches and args.accelerator_config.dispatch_batches
    parsed = AsyncDistillationConfig(output_dir=str(tmp_path), use_cpu=True, teacher_server_urls='{"a": "http://h:1"}')
    assert parsed.teacher_server_urls == {"a": "http://h:1"}
    with pytest.raises(ValueError, match="at least one entry"):
        AsyncDistillationConfig(output_dir=str(tmp_path), use_cpu=True, teacher_server_urls={})
    with pytest.raises(ValueError, match="beta"):
        AsyncDistillationConfig(output_dir=str(tmp_path), use_cpu=True, beta=1.5)


def test_teacher_candidates_keep_rank_order_and_add_the_realised_token():
    scores = {
        "logprobs": [[[-0.1, -2.0], [-0.3, float("nan")]]],
        "logprob_token_ids": [[[4, 5], [6, 7]]],
        "actual_logprobs": [[[-2.0], [-5.0]]],
    }
    ids, lps = teacher_candidates(scores, [5, 9], top_k=2)
    assert ids.tolist() == [[4, 5, -1], [6, 9, -1]]
    assert lps[1, :2].tolist() == pytest.approx([-0.3, -5.0]) and math.isinf(lps[0, 2])


def test_support_by_beta():
    ids = torch.tensor([[3, 7, -1], [3, 7, -1]])
    lps = torch.tensor([[-0.2, -1.0, float("-inf")], [-0.2, -1.0, float("-inf")]])
    targets = torch.tensor([7, 3])
    s_ids, s_lps, ok = distillation_support(ids, lps, targets, 0.0)
    assert ok.tolist() == [[True, True, False]] * 2
    s_ids, s_lps, ok = distillation_support(ids, lps, targets, 0.5)
    assert s_ids.tolist() == [[3, 7], [3, 3]] and ok.tolist() == [[True, True], [True, False]]
    assert s_lps[0].tolist() == pytest.approx([-0.2, -1.0])
    s_ids, s_lps, ok = distillation_support(ids, lps, targets, 1.0)
    assert s_ids.tolist() == [[7], [3]] and s_lps[:, 0].tolist() == pytest.approx([-1.0, -0.2])


def test_stale_samples_are_dropped():
    q = queue.Queue()
    for version in (0, 5):
        fields = _sample(4)
        q.put(RolloutSample(prompt=[], completion=[], model_version=version, **fields))
    metrics = defaultdict(list)
    dataset = RolloutQueueDataset(q, lambda: 5, lambda s: None, 60.0, metrics, max_staleness=2, poll_interval_s=0.01)
    item = next(iter(dataset))
    assert set(item) == set(RolloutQueueDataset._item_fields) and metrics["sample/dropped_stale_total"] == [1.0]


def test_planners_balance_squared_lengths_and_respect_the_budget():
    samples = [_sample(n, prompt_id=i) for i, n in enumerate([8, 2, 6, 4])]
    (rows,) = list(FixedCountBatcher(samples, 2, 4))
    # Longest first, each into the row with the smaller sum of squares: 8 | 6, 4, 2 (64 vs 56).
    assert sorted(sorted(len(s["input_ids"]) for s in row) for row in rows) == [[2, 4, 6], [8]]
    metrics = defaultdict(list)
    batches = list(TokenBudgetBatcher(samples + [_sample(20)] + [_sample(3)], 2, 10, metrics))
    for rows in batches:
        assert all(rows) and all(sum(len(s["input_ids"]) for s in row) <= 10 for row in rows)
    assert metrics["batch/dropped_oversize_total"] == [1.0]


def test_collator_packs_padding_free_rows():
    metrics = defaultdict(list)
    collator = DataCollatorForRollout(
        pad_token_id=0, num_processes=2, teacher_id_to_idx={"a": 0, "b": 1}, metrics=metrics
    )
    rows = [
        [_sample(4, teacher="a", prompt_id=0), _sample(3, teacher="b", prompt_id=1)],
        [_sample(5, prompt_id=2, teacher="b")],
    ]
    batch = collator([rows])
    assert batch["input_ids"].shape == (2, 7)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert batch["attention_mask"][1].tolist() == [1] * 5 + [0] * 2
    assert batch["teacher_id_idx"][0].tolist() == [0] * 4 + [1] * 3 and batch["teacher_id_idx"][1, -1] == -1
    assert batch["global_n_tokens"].tolist() == [2 + 1 + 3] * 2 and collator.prompts_trained == {0, 1, 2}
    assert "batch/packing_ratio" not in metrics and "batch/row_imbalance" in metrics


TINY, SMALL = "tiny-Qwen2ForCausalLM", "small-Qwen2ForCausalLM"


def _trainer(tmp_path, teacher_url, backend=None, transfer=None, **overrides):
    from datasets import Dataset

    from trl.assets import get_model_path

    class LocalAsyncDistillationTrainer(AsyncDistillationTrainer):
        _poll_interval_s = 0.2

        def _build_generation_backend(self):
            return backend

    config = {
        "output_dir": str(tmp_path), "use_cpu": True, "max_steps": 3, "per_device_train_batch_size": 2,
        "max_completion_length": 4, "token_budget": 0, "learning_rate": 0.05, "report_to": "none",
        "save_strategy": "no", "teacher_server_urls": {"default": teacher_url}, "teacher_top_k": 3,
        "heartbeat_stale_after_s": 60.0,
    }  # fmt: skip
    config.update(overrides)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(6)]})
    return LocalAsyncDistillationTrainer(
        get_model_path(TINY), args=AsyncDistillationConfig(**config), train_dataset=dataset, weight_transfer=transfer
    )


@pytest.fixture
def teacher_server():
    """A stub `vllm serve` of the small model (see tests/test_vllm_client_openai_scoring.py)."""
    import threading
    from http.server import ThreadingHTTPServer

    from test_vllm_client_openai_scoring import _OpenAIStub
    from transformers import AutoModelForCausalLM

    from trl.assets import get_model_path

    _OpenAIStub.model = AutoModelForCausalLM.from_pretrained(get_model_path(SMALL)).eval()
    _OpenAIStub.requests = []
    _OpenAIStub.paths = {"/health": {}, "/v1/models": {}, "/v1/completions": {}}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_loss_matches_hand_formula(tmp_path, teacher_server):
    from test_async_grpo import LocalBackend, LocalTransfer

    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY))
    trainer = _trainer(tmp_path, teacher_server, backend, LocalTransfer(backend), beta=0.5, add_tail_bucket=True)
    sample = _sample(6, prompt=3)
    sample["teacher_topk_ids"][3:, :2] = [[5, 9]] * 3
    sample["teacher_topk_logprobs"][3:, :2] = [[-0.5, -1.5]] * 3
    batch = trainer.data_collator([[[sample]]])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"]).logits[0].float()
    expected = 0.0
    for j in range(2, 5):  # positions predicting completion tokens 3, 4, 5
        target = int(batch["input_ids"][0, j + 1])  # 13..15: outside the candidates -> only the top-1 is valid
        log_s = logits[j].log_softmax(-1)
        support = torch.tensor([5])
        s = torch.cat([log_s[support], torch.log1p(-log_s[support].exp().sum()).reshape(1)])
        t = torch.tensor([-0.5, math.log1p(-math.exp(-0.5))])
        expected += masked_sparse_divergence(s, t, torch.ones(2, dtype=torch.bool), 0.5).item()
        assert target not in (5, 9)
    assert loss.item() == pytest.approx(expected / 3, rel=1e-4)
    assert trainer._metrics["jsd"][-1] == pytest.approx(expected / 3, rel=1e-4)


def test_packed_sequences_do_not_attend_to_each_other(tmp_path, teacher_server):
    from test_async_grpo import LocalBackend, LocalTransfer

    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY))
    trainer = _trainer(tmp_path, teacher_server, backend, LocalTransfer(backend))
    first, second = _sample(5, prompt=2), _sample(4, prompt=1, prompt_id=1)
    second["input_ids"] = second["input_ids"] + 7
    trainer.model.train()

    def loss(rows):
        batch = trainer.data_collator([rows])
        return trainer.compute_loss(trainer.model, batch).item() * float(batch["global_n_tokens"][0])

    together = loss([[first, second]])
    assert together == pytest.approx(loss([[first]]) + loss([[second]]), rel=1e-5)


@pytest.mark.timeout(300)
def test_trains_with_a_vllm_serve_teacher_and_syncs(tmp_path, teacher_server):
    from test_async_grpo import LocalBackend, LocalTransfer

    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY))
    transfer = LocalTransfer(backend)
    trainer = _trainer(tmp_path, teacher_server, backend, transfer, save_strategy="steps", save_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.model_version == 4
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = [log for log in trainer.state.log_history if "loss" in log]
    for key in ("jsd", "entropy", "teacher_entropy", "rollout/score_s", "sample/staleness_mean", "perf/step_s"):
        assert key in logs[-1], key
    assert "batch/groups_per_step" not in logs[-1] and math.isfinite(logs[-1]["jsd"])
    posted = [r for r in __import__("test_vllm_client_openai_scoring")._OpenAIStub.requests if r[0] == "POST"]
    assert posted and posted[0][2]["prompt_logprobs"] == 3 and posted[0][2]["max_tokens"] == 1
    assert (tmp_path / "checkpoint-2" / "rollout_state.json").is_file()
    assert transfer.events[0] == "init" and transfer.events[-1] == "destroy"


def test_unreachable_teacher_fails_before_training(tmp_path):
    with pytest.raises(ConnectionError):
        _trainer(tmp_path, "http://127.0.0.1:9", backend=object(), transfer=object(), vllm_server_timeout=1.0)


def test_several_teachers_need_a_teacher_id(tmp_path, teacher_server):
    with pytest.raises(ValueError, match="teacher_id"):
        _trainer(tmp_path, teacher_server, teacher_server_urls={"a": teacher_server, "b": teacher_server})
