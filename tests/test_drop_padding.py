"""Padding dropped inside the step (sequences packed, positions restarting): SFT padded batches and the reward model
compute nothing on padding, and give the same loss and gradients as the padded batch."""

import functools

import pytest
import torch
from trainer_utils import SGD_STEP_ARGS, sgd_step_update
from transformers import AutoModelForSequenceClassification

from trl import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.trainer import reward_trainer
from trl.trainer.utils import (
    MIN_SAVED_SHARE,
    common_packed_width,
    compute_sequence_token_logps,
    drop_padding,
    packed_sequence_logps_in_one_pass,
    packing,
    sequence_scores_without_padding,
)


def test_sequence_scores_equal_the_padded_forward():
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        get_model_path("tiny-Qwen2ForSequenceClassification"), num_labels=1
    )
    input_ids = torch.randint(10, 4000, (4, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0
    attention_mask[3, 5:] = 0
    input_ids[attention_mask == 0] = model.config.pad_token_id
    # Rows of 12, 8, 12 and 5 tokens: no two fit in a row of 12, nothing saved; packed anyway when asked to.
    assert sequence_scores_without_padding(model, input_ids, attention_mask) is None
    scores = sequence_scores_without_padding(model, input_ids, attention_mask, min_saved_share=0.0)
    expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(scores.sum(), params)
    expected_grads = torch.autograd.grad(expected.sum(), params)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Nothing to drop: the caller runs the model as usual.
    assert sequence_scores_without_padding(model, input_ids, torch.ones_like(input_ids)) is None


@pytest.mark.parametrize("kind", ["pre", "post", "global"])
def test_pooled_score_paths_step_aside_for_forward_hooks(kind):
    """Hooks that calling the model would run are never skipped by calling its backbone and head directly."""
    from torch.nn.modules.module import register_module_forward_hook

    from trl.trainer.fast_paths.prefix_sharing import pooled_scores_share_safely

    model = AutoModelForSequenceClassification.from_pretrained(
        get_model_path("tiny-Qwen2ForSequenceClassification"), num_labels=1
    )
    input_ids = torch.randint(10, 4000, (4, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, 6:] = 0
    input_ids[attention_mask == 0] = model.config.pad_token_id
    assert sequence_scores_without_padding(model, input_ids, attention_mask, min_saved_share=0.0) is not None
    assert pooled_scores_share_safely(model, input_ids, attention_mask)
    if kind == "pre":
        handle = model.register_forward_pre_hook(lambda module, args: None)
    elif kind == "post":
        handle = model.register_forward_hook(lambda module, args, output: None)
    else:
        handle = register_module_forward_hook(lambda module, args, output: None)
    try:
        assert sequence_scores_without_padding(model, input_ids, attention_mask, min_saved_share=0.0) is None
        assert not pooled_scores_share_safely(model, input_ids, attention_mask)
    finally:
        handle.remove()


def test_drop_padding_packs_within_the_longest_row(tiny_qwen_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path)
    attention_mask = torch.tensor([[1] * 8, [1] * 3 + [0] * 5, [1] * 4 + [0] * 4])
    packed = drop_padding(model, torch.arange(24).reshape(3, 8), attention_mask)
    assert packed.input_ids.shape == (2, 8)  # 8 | 3 + 4
    assert packed.position_ids[1].tolist()[:7] == [0, 1, 2, 3, 0, 1, 2] or packed.position_ids[1].tolist()[:7] == [
        0, 1, 2, 0, 1, 2, 3,
    ]  # fmt: skip


@pytest.mark.parametrize("saved_rows", [0, 1, 2])
def test_packed_path_only_when_it_saves_enough_positions(saved_rows):
    """Little padding saved (under `MIN_SAVED_SHARE` of the positions): the padded path; much: the packed one. Both
    give the padded forward's scores."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        get_model_path("tiny-Qwen2ForSequenceClassification"), num_labels=1
    )
    # 8 rows of width 16; each saved row is two sequences of 8 tokens that pack into one row of 16.
    lengths = [16] * (8 - 2 * saved_rows) + [8] * (2 * saved_rows)
    attention_mask = (torch.arange(16)[None] < torch.tensor(lengths)[:, None]).long()
    input_ids = torch.randint(10, 4000, (8, 16))
    input_ids[attention_mask == 0] = model.config.pad_token_id
    packed = drop_padding(model, input_ids, attention_mask)
    scores = sequence_scores_without_padding(model, input_ids, attention_mask)
    saved_share = saved_rows / 8
    assert (packed is not None) == (saved_share >= MIN_SAVED_SHARE) == (scores is not None)
    if packed is not None:
        assert packed.input_ids.shape == (8 - saved_rows, 16)
        expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("peft", [False, True])
def test_reward_step_equals_padded(tmp_path, monkeypatch, peft):
    dataset = load_test_dataset("standard_preference", split="train")
    kwargs = {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    def step(directory):
        args = RewardConfig(
            output_dir=str(directory), report_to="none", disable_tqdm=True, per_device_train_batch_size=4,
            **SGD_STEP_ARGS,
        )  # fmt: skip
        path = get_model_path("tiny-Qwen2ForSequenceClassification")
        torch.manual_seed(0)  # the LoRA weights are drawn while the model is wrapped, before the Trainer seeds
        trainer = RewardTrainer(path, args=args, train_dataset=dataset, **kwargs)
        trainer._share_prefix = False  # this test is about the padding-dropping path (prefix sharing comes first)
        return sgd_step_update(trainer), trainer.state.log_history[-1]["train_loss"]

    calls = []
    original = reward_trainer.sequence_scores_without_padding
    monkeypatch.setattr(reward_trainer, "sequence_scores_without_padding", lambda *a: calls.append(1) or original(*a))
    dropped, dropped_loss = step(tmp_path / "dropped")
    assert calls
    monkeypatch.setattr(reward_trainer, "sequence_scores_without_padding", lambda *a: None)
    padded, padded_loss = step(tmp_path / "padded")
    assert dropped_loss == pytest.approx(padded_loss, rel=1e-5)
    for name, update in padded.items():
        torch.testing.assert_close(dropped[name], update, rtol=1e-5, atol=1e-6, msg=name)


def test_sft_padded_batch_runs_without_padding(tmp_path, monkeypatch):
    """The model sees the packed sequences: no padding, positions restarting; with the per-sequence SDPA kernel the
    trainer swaps in, one row carrying the sequence boundaries."""
    monkeypatch.setattr(packing, "MIN_SAVED_SHARE", 0.0)  # pack whatever this batch saves
    dataset = load_test_dataset("standard_language_modeling", split="train")
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, per_device_train_batch_size=8,
                     **SGD_STEP_ARGS)  # fmt: skip
    trainer = SFTTrainer(get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=dataset)
    seen = []
    trainer.model.register_forward_pre_hook(lambda module, a, kw: seen.append(kw), with_kwargs=True)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    assert "attention_mask" not in seen[0] and "position_ids" in seen[0]
    assert seen[0]["input_ids"].shape == (1, int(batch["attention_mask"].sum()))
    lengths = batch["attention_mask"].sum(dim=1)
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    assert sorted(seen[0]["cu_seq_lens_q"].diff().tolist()) == sorted(bounds.diff().tolist())


def test_drop_padding_rows_follow_the_attention(tiny_qwen_path):
    """Rows no longer than the longest sequence for a dense block mask (eager/SDPA); one row with boundaries for the
    per-sequence SDPA kernel."""
    from transformers import AutoModelForCausalLM

    from trl.trainer.utils.packing import packed_attention_kind, packed_forward_inputs, packed_sdpa_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path)
    lengths = torch.tensor([5, 12, 3, 7])
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    ids = torch.randint(10, 1000, (4, 12)) * mask
    rows = drop_padding(model, ids, mask, min_saved_share=0.0)
    assert rows.input_ids.shape[1] == 12 and "cu_seq_lens_q" not in packed_forward_inputs(rows)
    expected = compute_sequence_token_logps(model, ids, mask, mask[:, 1:].bool()).logps
    with packed_sdpa_attention(model):
        assert packed_attention_kind(model) == "varlen"
        one_row = drop_padding(model, ids, mask, min_saved_share=0.0)
        inputs = packed_forward_inputs(one_row)
        assert one_row.input_ids.shape == (1, 27) and inputs["cu_seq_lens_q"].tolist() == [0, 5, 17, 20, 27]
        logits = model(**inputs).logits
    logps = torch.log_softmax(logits[0, :-1], -1).gather(-1, one_row.input_ids[0, 1:, None]).squeeze(-1)
    got = one_row.unpack_next_token(logps[None], (4, 11)) * mask[:, 1:]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["packed", "padding_free"])
def test_parts_in_one_pass_equal_their_own_passes_bit_for_bit(tiny_qwen_path, layout):
    """Two padded batches packed apart but run in one forward give the bits of their own passes at the common width
    (KTO's reference over main + KL rows vs the policy's KL pass: an exact 0 KL while they are equal)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path)

    def batch(width, lengths):
        ids = torch.randint(10, 4000, (len(lengths), width))
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        ids[mask == 0] = 0
        return ids, mask, mask[:, 1:].bool() & (torch.arange(width - 1)[None] >= 20)

    parts = [batch(200, [200, 150, 180, 90, 120, 199, 60, 170]), batch(170, [170, 120, 100, 150, 80, 130, 70, 160])]
    width = common_packed_width([mask for _, mask, _ in parts], layout)
    with torch.no_grad():
        together = packed_sequence_logps_in_one_pass(model, parts, layout)
        alone = [compute_sequence_token_logps(model, *part, layout=layout, min_width=width).logps for part in parts]
        padded = [compute_sequence_token_logps(model, *part).logps for part in parts]
    for got, want, reference in zip(together, alone, padded, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_layout_changing_paths_step_aside_for_hooks_on_the_input_embeddings(tiny_qwen_path):
    """A hook on the input embeddings (NEFTune's noise, drawn per position and scaled by the padded length) sees the
    batch as the plain path lays it out: no padding dropped, no prefixes shared, no rollout loop."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from trl.trainer.fast_paths.prefix_sharing import sharing_possible_now
    from trl.trainer.fast_paths.rollout_decode import rollout_decode_fallback_reason
    from trl.trainer.utils.forward_randomness import input_embeddings_hooked

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path)
    attention_mask = torch.tensor([[1] * 8, [1] * 3 + [0] * 5, [1] * 4 + [0] * 4])
    input_ids = torch.arange(24).reshape(3, 8)
    generation_config = GenerationConfig(max_new_tokens=4, do_sample=True, pad_token_id=0, eos_token_id=1)
    # Hooks that act the same whatever the layout: gradient checkpointing's (marks the output as requiring
    # gradients) and an engine's (here one defined in torch.distributed).
    from torch.distributed.utils import _p_assert

    model.enable_input_require_grads()
    model.get_input_embeddings().register_forward_pre_hook(functools.partial(_p_assert, True))
    assert not input_embeddings_hooked(model)
    assert drop_padding(model, input_ids, attention_mask) is not None
    assert sharing_possible_now(model)
    assert rollout_decode_fallback_reason(model, generation_config) is None
    handle = model.get_input_embeddings().register_forward_hook(lambda module, args, output: output)
    try:
        assert input_embeddings_hooked(model)
        assert drop_padding(model, input_ids, attention_mask) is None
        assert not sharing_possible_now(model)
        assert "NEFTune" in rollout_decode_fallback_reason(model, generation_config)
    finally:
        handle.remove()


def test_sft_with_neftune_embeds_the_padded_batch(tmp_path, monkeypatch):
    """`neftune_noise_alpha`: the embeddings see the padded batch (NEFTune scales its noise by the padded length), as
    under TRL, although dropping the padding would pay."""
    monkeypatch.setattr(packing, "MIN_SAVED_SHARE", 0.0)  # would pack whatever this batch saves
    dataset = load_test_dataset("standard_language_modeling", split="train")
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, per_device_train_batch_size=8,
                     neftune_noise_alpha=5.0, **SGD_STEP_ARGS)  # fmt: skip
    trainer = SFTTrainer(get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=dataset)
    batch = next(iter(trainer.get_train_dataloader()))
    shapes = []
    trainer.model.get_input_embeddings().register_forward_hook(lambda module, a, out: shapes.append(out.shape))
    trainer.train()
    assert shapes[0][:2] == batch["input_ids"].shape
