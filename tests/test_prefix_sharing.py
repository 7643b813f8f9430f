"""Shared-prefix forward passes (trl/trainer/fast_paths/prefix_sharing.py): the layout and its mask, per-row log-probs,
pooled scores and their gradients equal to separate rows, and the trainers that use them (DPO, Reward, KTO)."""

import copy

import pytest
import torch
from datasets import Dataset
from trainer_utils import COMMON_ARGS
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from trl._compat import disable_activation_checkpointing, enable_activation_checkpointing
from trl.kernels.packed_attention import capture_keys_values
from trl.trainer.fast_paths.prefix_sharing import (
    MIN_SHARED_SAVING,
    continuation_starts,
    keys_values_capturable,
    paired_groups,
    pooled_scores_share_safely,
    prefix_cached_saving,
    prefix_cached_token_logps,
    share_prefixes,
    shared_prefix_pooled_scores,
    shared_prefix_token_logps,
    sharing_possible_now,
    supports_prefix_sharing,
)
from trl.trainer.utils import compute_sequence_token_logps
from trl.trainer.utils.packing import packed_sdpa_attention


pytestmark = pytest.mark.usefixtures("single_thread")

PAD = 0
SHORT_RUN = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, seed=0)


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return ids, mask


def _completion_mask(rows: list[list[int]], prompt_lengths: list[int], width: int) -> torch.Tensor:
    """Next-token target mask: the tokens after each row's prompt."""
    mask = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for index, (row, prompt) in enumerate(zip(rows, prompt_lengths)):
        mask[index, prompt - 1 : len(row) - 1] = True
    return mask


def test_layout_and_mask_on_a_hand_written_example():
    ids, mask = _padded([[5, 6, 7], [5, 6, 8, 9], [3, 4]])
    layout = share_prefixes(ids, mask, [[0, 1], [2]], pad_token_id=PAD)
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]]
    assert layout.position_ids[0].tolist() == [0, 1, 2, 2, 3]
    assert layout.segment_ids.tolist() == [[0, 0, 1, 2, 2], [0, 0, -1, -1, -1]]
    assert layout.token_index.tolist() == [[0, 1, 2, -1], [0, 1, 3, 4], [5, 6, -1, -1]]
    assert layout.saved_share == pytest.approx(1 - 7 / 9)
    allowed = (layout.attention_mask(torch.float32) == 0).squeeze(1).int()
    assert allowed.shape == (2, 5, 5)
    assert allowed[0].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # first suffix: prefix + itself
        [1, 1, 0, 1, 0],  # second suffix skips the first one
        [1, 1, 0, 1, 1],
    ]
    # pad positions attend to themselves only, nothing attends to them
    assert allowed[1].tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    assert layout.attention_mask(torch.float32).min() == torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="exactly one group"):
        share_prefixes(ids, mask, [[0, 1]])


def test_prefix_is_the_common_token_prefix_not_a_given_prompt():
    # identical rows, a row that is a prefix of another, left padding
    ids = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4], [0, 0, 1, 2]])
    mask = ids != 0
    layout = share_prefixes(ids, mask, [[0, 1, 2]])
    # common prefix [1, 2]; suffixes [3], [3, 4] and an empty one
    assert layout.input_ids.tolist() == [[1, 2, 3, 3, 4]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 2, 3]]
    assert layout.token_index.tolist() == [[-1, 0, 1, 2], [0, 1, 3, 4], [-1, -1, 0, 1]]


@pytest.fixture(scope="module")
def causal_lm(model_path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def _batch(kind: str):
    """DPO-shaped (chosen/rejected share a prompt), KTO-shaped (main + KL row share a prompt) rows of unequal
    lengths, and a group whose rows share nothing."""
    g = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(1, 200, (n,), generator=g).tolist()

    prompts = [tokens(9), tokens(6), tokens(12)]
    first = [prompt + tokens(n) for prompt, n in zip(prompts, (5, 7, 3))]
    second = [prompt + tokens(n) for prompt, n in zip(prompts, (8, 2, 6))]
    if kind == "unrelated":
        second[1] = [201] + tokens(10)
    rows = first + second
    prompt_lengths = [len(p) for p in prompts] * 2
    if kind == "unrelated":
        prompt_lengths[4] = 1
    ids, mask = _padded(rows)
    return ids, mask, _completion_mask(rows, prompt_lengths, ids.shape[1])


@pytest.mark.parametrize("kind", ["paired", "unrelated"])
def test_shared_logps_and_gradients_equal_separate_rows(causal_lm, kind):
    ids, mask, target = _batch(kind)
    layout = share_prefixes(ids, mask, paired_groups(len(ids)))
    assert layout.saved_share > (0.1 if kind == "unrelated" else MIN_SHARED_SAVING)
    assert supports_prefix_sharing(causal_lm)

    def run(shared: bool):
        causal_lm.zero_grad()
        if shared:
            result = shared_prefix_token_logps(causal_lm, ids, layout, target, compute_entropy=True)
        else:
            result = compute_sequence_token_logps(causal_lm, ids, mask, target, compute_entropy=True)
        sums = (result.logps * target).sum(dim=1)
        (sums * torch.linspace(0.5, 1.5, len(sums))).sum().backward()
        grads = [p.grad.clone() for p in causal_lm.parameters() if p.grad is not None]
        return result.logps.detach(), result.entropy.detach(), grads

    logps, entropy, grads = run(True)
    ref_logps, ref_entropy, ref_grads = run(False)
    torch.testing.assert_close(logps, ref_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    assert (logps[~target] == 0).all()
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_shared_logps_with_peft(model_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False))
    assert supports_prefix_sharing(model)
    ids, mask, target = _batch("paired")
    layout = share_prefixes(ids, mask, paired_groups(len(ids)))
    values = []
    for shared in (True, False):
        model.zero_grad()
        if shared:
            logps = shared_prefix_token_logps(model, ids, layout, target).logps
        else:
            logps = compute_sequence_token_logps(model, ids, mask, target).logps
        logps.sum().backward()
        values.append((logps.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    torch.testing.assert_close(values[0][0], values[1][0], rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(values[0][1], values[1][1], strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_over_shared_micro_batches(causal_lm):
    """Two shared micro-batches accumulate the gradient of the whole batch run unshared."""
    ids, mask, target = _batch("paired")
    causal_lm.zero_grad()
    for rows in ([0, 1, 3, 4], [2, 5]):
        part_ids, part_mask, part_target = ids[rows], mask[rows], target[rows]
        layout = share_prefixes(part_ids, part_mask, paired_groups(len(rows)))
        shared_prefix_token_logps(causal_lm, part_ids, layout, part_target).logps.sum().backward()
    accumulated = [p.grad.clone() for p in causal_lm.parameters()]
    causal_lm.zero_grad()
    compute_sequence_token_logps(causal_lm, ids, mask, target).logps.sum().backward()
    for grad, ref_grad in zip(accumulated, [p.grad for p in causal_lm.parameters()], strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_pooled_scores_and_gradients_equal_the_classifier(model_path):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = PAD
    assert supports_prefix_sharing(model, causal_lm=False)
    ids, mask, _ = _batch("paired")
    assert pooled_scores_share_safely(model, ids, mask)
    layout = share_prefixes(ids, mask, paired_groups(len(ids)))
    scores = shared_prefix_pooled_scores(model, ids, mask, layout)
    scores.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(input_ids=ids, attention_mask=mask).logits
    ref.sum().backward()
    torch.testing.assert_close(scores, ref, rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    # a pad id inside a row's text: the model pools the token before it, and so does the shared path
    ids_with_pad = ids.clone()
    ids_with_pad[0, int(mask[0].sum()) - 1] = PAD
    assert pooled_scores_share_safely(model, ids_with_pad, mask)
    with torch.no_grad():
        torch.testing.assert_close(
            shared_prefix_pooled_scores(
                model, ids_with_pad, mask, share_prefixes(ids_with_pad, mask, [[0, 3], [1, 4], [2, 5]])
            ),
            model(input_ids=ids_with_pad, attention_mask=mask).logits,
            rtol=1e-5,
            atol=1e-5,
        )
    # padding written with another id than the model's pad id: the model would pool a padding position
    assert not pooled_scores_share_safely(model, ids.masked_fill(mask == 0, 7), mask)


def test_attention_implementations_that_cannot_share(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager")
    assert supports_prefix_sharing(model)
    model.config._attn_implementation = "flash_attention_2"
    assert not supports_prefix_sharing(model)
    assert not supports_prefix_sharing(None)


# ---------------------------------------------------------------------------------------------------------------------
# Trainers
# ---------------------------------------------------------------------------------------------------------------------
def _text_rows(n: int = 8) -> list[dict[str, str]]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    rows = []
    for i in range(n):
        prompt = " ".join(words[(i + j) % len(words)] for j in range(12))
        rows.append(
            {
                "prompt": prompt,
                "chosen": " " + " ".join(words[(i * 3 + j) % len(words)] for j in range(4)),
                "rejected": " " + " ".join(words[(i * 5 + j) % len(words)] for j in range(3)),
            }
        )
    return rows


def _short_run(config_class, tmp_path, **overrides):
    return config_class(**{"output_dir": str(tmp_path), **COMMON_ARGS, **SHORT_RUN, **overrides})


def _losses(trainer) -> list[float]:
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _train_twice(make_trainer, model, attribute: str):
    """Train the same model a few steps with the shared path and with it switched off: same losses."""
    shared = make_trainer(copy.deepcopy(model))
    assert getattr(shared, attribute)
    shared_losses = _losses(shared)
    assert shared._shared_prefix_passes > 0
    plain = make_trainer(copy.deepcopy(model))
    setattr(plain, attribute, False)
    if hasattr(plain, "_ref_share_prefix"):
        plain._ref_share_prefix = False
    plain_losses = _losses(plain)
    assert getattr(plain, "_shared_prefix_passes", 0) == 0
    assert shared_losses == pytest.approx(plain_losses, rel=1e-4, abs=1e-6)
    return shared, plain


def test_dpo_trainer_shares_prompts_and_keeps_its_losses(tmp_path, model_path):
    from trl import DPOConfig, DPOTrainer

    dataset = Dataset.from_list(_text_rows())

    def make_trainer(model):
        args = _short_run(DPOConfig, tmp_path)
        return DPOTrainer(model, args=args, train_dataset=dataset)

    _train_twice(make_trainer, AutoModelForCausalLM.from_pretrained(model_path), "_share_prefix")


def test_reward_trainer_shares_prompts_and_keeps_its_losses(tmp_path, model_path):
    from trl import RewardConfig, RewardTrainer

    dataset = Dataset.from_list(_text_rows())

    def make_trainer(model):
        args = _short_run(RewardConfig, tmp_path)
        return RewardTrainer(model, args=args, train_dataset=dataset)

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    _train_twice(make_trainer, model, "_share_prefix")


def test_kto_trainer_shares_prompts_and_keeps_its_losses(tmp_path, model_path):
    from trl import KTOConfig, KTOTrainer

    rows = []
    for i, row in enumerate(_text_rows()):
        rows.append({"prompt": row["prompt"], "completion": row["chosen"], "label": i % 2 == 0})

    def make_trainer(model):
        args = _short_run(KTOConfig, tmp_path, gradient_checkpointing=False)
        return KTOTrainer(model, args=args, train_dataset=Dataset.from_list(rows))

    _train_twice(make_trainer, AutoModelForCausalLM.from_pretrained(model_path), "_share_kl_prefix")


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kind", ["paired", "unrelated"])
def test_prefix_cached_continuations_equal_separate_rows(causal_lm, kind, layout, checkpointing):
    """KTO-shaped: main rows with gradient, KL rows (same prompt, another completion) continued from the main rows'
    recorded prompt keys/values, with and without gradient checkpointing (which turns the model's own cache off)."""
    model = copy.deepcopy(causal_lm)
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    ids, mask, target = _batch(kind)
    n = len(ids) // 2
    main, main_mask, main_target = ids[:n], mask[:n], target[:n]
    width = int(main_mask.sum(dim=1).max())
    main, main_mask, main_target = main[:, :width], main_mask[:, :width], main_target[:, : width - 1]
    kl, kl_mask, kl_target = ids[n:], mask[n:], target[n:]
    with pytest.raises(ValueError, match="packed_sdpa_attention"):
        prefix_cached_token_logps(model, main, main_mask, main_target, kl, kl_mask, kl_target, layout=layout)
    with packed_sdpa_attention(model):
        assert keys_values_capturable(model)
        model.zero_grad()
        result = prefix_cached_token_logps(
            model, main, main_mask, main_target, kl, kl_mask, kl_target, layout=layout, compute_entropy=True
        )
        result.main.logps.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
    assert not result.continuation_logps.requires_grad
    assert all(module.gradient_checkpointing == checkpointing for module in model.model.layers)
    model.zero_grad()
    ref_main = compute_sequence_token_logps(model, main, main_mask, main_target, compute_entropy=True)
    ref_main.logps.sum().backward()
    with torch.no_grad():
        ref_kl = compute_sequence_token_logps(model, kl, kl_mask, kl_target).logps
    torch.testing.assert_close(result.main.logps, ref_main.logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.main.entropy, ref_main.entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.continuation_logps, ref_kl, rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert prefix_cached_saving(main, main_mask, kl, kl_mask, kl_target, layout) > 0


def test_continuation_starts_and_saving_on_a_hand_written_example():
    main, main_mask = _padded([[5, 6, 7, 8], [5, 6]])
    kl, kl_mask = _padded([[5, 6, 9], [5, 6, 7, 1, 2]])
    kl_target = _completion_mask([[5, 6, 9], [5, 6, 7, 1, 2]], [2, 2], kl.shape[1])
    # Row 0 shares [5, 6]: one token from the main row, the last shared one runs again. Row 1 shares [5, 6] too
    # (the main row ends there). Never past the first scored position (column 1).
    assert continuation_starts(main, main_mask, kl, kl_mask, kl_target).tolist() == [1, 1]
    kl_target[1, 1] = False  # first scored column 2: still only [5] (the shared prefix is 2 tokens)
    assert continuation_starts(main, main_mask, kl, kl_mask, kl_target).tolist() == [1, 1]
    assert prefix_cached_saving(main, main_mask, kl, kl_mask, kl_target, "packed") == pytest.approx(2 / 14)
    # The padded main pass also computes the main rows' 2 pads (and their pad rows' keys): counted against it.
    assert prefix_cached_saving(main, main_mask, kl, kl_mask, kl_target, "padded") == pytest.approx(-2 / 14)


def test_key_value_capture_is_scoped_and_keeps_first_calls(causal_lm):
    from trl.kernels import packed_attention

    ids = torch.tensor([[5, 6, 7, 8]])
    with packed_sdpa_attention(causal_lm), torch.no_grad():
        with capture_keys_values() as captured:
            causal_lm(input_ids=ids, use_cache=False)
            first = {layer: key for layer, (key, _) in captured.items()}
            causal_lm(input_ids=ids[:, :2], use_cache=False)  # a second call does not overwrite the first
        assert packed_attention._KEY_VALUE_SINK.get() is None
        causal_lm(input_ids=ids, use_cache=False)
    layers = causal_lm.config.num_hidden_layers
    assert sorted(captured) == list(range(layers))
    heads, dim = (
        causal_lm.config.num_key_value_heads,
        causal_lm.config.hidden_size // causal_lm.config.num_attention_heads,
    )
    assert all(captured[layer][0] is first[layer] for layer in captured)
    assert all(key.shape == (1, heads, 4, dim) and not key.requires_grad for key, _ in captured.values())


@pytest.mark.parametrize("trainer_name", ["GRPO", "RLOO"])
def test_online_trainers_share_prompts_and_keep_their_losses(tmp_path, model_path, trainer_name):
    import trl

    config_class, trainer_class = getattr(trl, f"{trainer_name}Config"), getattr(trl, f"{trainer_name}Trainer")
    prompts = [row["prompt"] for row in _text_rows(4)]
    dataset = Dataset.from_dict({"prompt": prompts})

    def reward(completions, **kwargs):
        return [len(completion) / 10 for completion in completions]

    def make_trainer(model):
        args = _short_run(
            config_class, tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=6, beta=0.1
        )
        return trainer_class(model, reward_funcs=reward, args=args, train_dataset=dataset)

    shared, plain = _train_twice(make_trainer, AutoModelForCausalLM.from_pretrained(model_path), "_share_prefix")
    # Same rollouts, and the same log-prob-derived metrics (the on-policy loss alone hardly depends on log-probs).
    for name in ("reward", "completions/mean_length", "entropy", "kl"):
        values = [entry[name] for entry in shared.state.log_history if name in entry]
        assert values
        assert values == pytest.approx([entry[name] for entry in plain.state.log_history if name in entry], rel=1e-4)


def test_sharing_is_decided_again_at_call_time(causal_lm):
    """A model that an engine wraps or shards after the trainer is built keeps whole-row passes."""
    from trl.trainer.utils.distributed import parameters_sharded

    assert sharing_possible_now(causal_lm)
    assert not parameters_sharded(causal_lm) and not parameters_sharded(causal_lm, across_ranks=True)
    wrapper = torch.nn.Module()
    wrapper.module = causal_lm  # what DistributedDataParallel looks like from outside
    assert not sharing_possible_now(wrapper)
    fsdp_like = type("FSDPQwen2ForCausalLM", (torch.nn.Module,), {})()
    assert parameters_sharded(fsdp_like) and not sharing_possible_now(fsdp_like)


# ---------------------------------------------------------------------------------------------------------------------
# Layouts that keep the batch's padding (metrics read every position of the padded batch)
# ---------------------------------------------------------------------------------------------------------------------
def test_layout_keeping_padding_on_a_hand_written_example():
    ids, mask = _padded([[5, 6, 7], [5, 6, 8, 9]])
    layout = share_prefixes(ids, mask, [[0, 1]], pad_token_id=PAD, keep_padding=True)
    # row 0's pad position follows its suffix [7]; it continues the row's positions
    assert layout.input_ids.tolist() == [[5, 6, 7, PAD, 8, 9]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 2, 3]]
    assert layout.silent.tolist() == [[False, False, False, True, False, False]]
    assert layout.token_index.tolist() == [[0, 1, 2, 3], [0, 1, 4, 5]]
    assert layout.saved_share == pytest.approx(1 - 6 / 8)
    allowed = (layout.attention_mask(torch.float32) == 0).squeeze(1).int()
    assert allowed[0].tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # the kept pad sees its row's real tokens, not itself
        [1, 1, 0, 0, 1, 0],  # nothing attends to it
        [1, 1, 0, 0, 1, 1],
    ]
    with pytest.raises(ValueError, match="right-padded"):
        share_prefixes(ids.flip(1), mask.flip(1), [[0, 1]], keep_padding=True)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_final_hidden_states_of_every_padded_position_equal_the_padded_batch(causal_lm, checkpointing):
    ids, mask, target = _batch("paired")
    layout = share_prefixes(ids, mask, paired_groups(len(ids)), PAD, keep_padding=True)
    with pytest.raises(ValueError, match="keep_padding"):
        shared_prefix_token_logps(
            causal_lm, ids, share_prefixes(ids, mask, paired_groups(6)), target, final_hidden_states=True
        )
    if checkpointing:
        enable_activation_checkpointing(causal_lm, {"use_reentrant": False})
    causal_lm.train()

    def run(shared: bool):
        causal_lm.zero_grad()
        if shared:
            result = shared_prefix_token_logps(causal_lm, ids, layout, target, final_hidden_states=True)
        else:
            result = compute_sequence_token_logps(causal_lm, ids, mask, target, output_hidden_states=True)
        hidden = result.outputs.hidden_states[-1]
        weights = torch.linspace(0.5, 1.5, hidden.shape[-1])
        ((result.logps * target).sum() + (hidden * weights).mean()).backward()
        grads = [p.grad.clone() for p in causal_lm.parameters() if p.grad is not None]
        return result.logps.detach(), hidden.detach(), grads

    try:
        logps, hidden, grads = run(True)
        ref_logps, ref_hidden, ref_grads = run(False)
    finally:
        disable_activation_checkpointing(causal_lm)
        causal_lm.eval()
    assert hidden.shape == (*ids.shape, causal_lm.config.hidden_size)
    torch.testing.assert_close(logps, ref_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)  # pad positions included
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["orpo", "cpo"])
def test_reference_free_trainers_share_prompts_and_keep_losses_and_metrics(tmp_path, model_path, method):
    import importlib

    module = importlib.import_module(f"trl.experimental.{method}")
    config_class, trainer_class = (
        getattr(module, f"{method.upper()}Config"),
        getattr(module, f"{method.upper()}Trainer"),
    )
    dataset = Dataset.from_list(_text_rows())

    def make_trainer(model):
        args = _short_run(config_class, tmp_path)
        return trainer_class(model, args=args, train_dataset=dataset)

    shared, plain = _train_twice(make_trainer, AutoModelForCausalLM.from_pretrained(model_path), "_share_prefix")
    for name in ("logits/chosen", "logits/rejected", "logps/chosen", "nll_loss"):
        values = [[entry[name] for entry in t.state.log_history if name in entry] for t in (shared, plain)]
        assert values[0] == pytest.approx(values[1], rel=1e-4, abs=1e-6), name


# ---------------------------------------------------------------------------------------------------------------------
# Self-distillation (SDFT, SDPO): completion logits of rows that share a prompt
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpointing", [False, True])
def test_self_distillation_completion_logits_equal_whole_rows(model_path, checkpointing):
    """Left-padded prompts, two completions each (one ending early): the shared layout's logits and gradients equal
    the whole padded rows' at every position that predicts a completion token."""
    from trl.experimental._self_distillation.trainer import completion_logits
    from trl.trainer.fast_paths.prefix_sharing import same_prompt_groups

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (9, 5)]
    width = max(len(p) for p in prompts)
    prompt_rows = [[PAD] * (width - len(p)) + p for p in prompts for _ in range(2)]
    prompt_ids = torch.tensor(prompt_rows)
    prompt_mask = torch.arange(width) >= torch.tensor([width - len(p) for p in prompts for _ in range(2)])[:, None]
    prompt_mask = prompt_mask.long()
    completion_ids = torch.randint(1, 200, (4, 6), generator=g)
    completion_mask = torch.ones(4, 6, dtype=torch.long)
    completion_mask[1, 3:] = 0  # ends early: padding after its end
    completion_ids[1, 3:] = PAD
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    layout = share_prefixes(input_ids, attention_mask, same_prompt_groups(prompt_ids, prompt_mask), PAD)
    assert layout.saved_share > MIN_SHARED_SAVING
    weights = torch.randn(4, 6, model.config.vocab_size, generator=g)

    def run(shared: bool):
        model.zero_grad()
        logits = completion_logits(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7, layout if shared else None
        )
        ((logits * weights).sum(-1) * completion_mask).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    logits, grads = run(True)
    ref_logits, ref_grads = run(False)
    real = completion_mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(logits).all()
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6 * float(ref_grad.abs().max()))


@pytest.mark.parametrize("method", ["sdft", "sdpo"])
def test_self_distillation_trainers_share_prompts_and_keep_their_losses(tmp_path, model_path, method):
    from trl.experimental import sdft, sdpo

    rows = _text_rows(4)
    if method == "sdft":
        dataset = Dataset.from_dict(
            {"prompt": [r["prompt"] for r in rows], "privileged_context": [r["chosen"] for r in rows]}
        )

        def make_trainer(model):
            args = _short_run(
                sdft.SDFTConfig, tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=6
            )
            return sdft.SDFTTrainer(model, args=args, train_dataset=dataset)

    else:
        dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in rows]})

        def reward(completions, **kwargs):
            return [float(len(completion) % 2) for completion in completions]

        def make_trainer(model):
            args = _short_run(
                sdpo.SDPOConfig,
                tmp_path,
                per_device_train_batch_size=4,
                num_generations=2,
                max_completion_length=6,
                success_reward_threshold=0.5,
            )
            return sdpo.SDPOTrainer(model, reward_funcs=reward, args=args, train_dataset=dataset)

    _train_twice(make_trainer, AutoModelForCausalLM.from_pretrained(model_path), "_share_prefix")
