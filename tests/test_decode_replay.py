"""The rollout decode's layer outputs replayed as the gradient checkpoints of the loss pass
(`trl/trainer/fast_paths/decode_replay.py`): the recorded outputs are the forward's, the replayed pass gives the
checkpointed pass's loss and gradients, and the trainers replay only while the parameters are the decoding ones."""

import pytest
import torch
from trainer_utils import GROUP_ARGS, SGD_STEP_ARGS, args_builder, low_id_reward, train_logs
from transformers import AutoModelForCausalLM, GenerationConfig

from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl._compat import enable_activation_checkpointing
from trl.assets import get_model_path
from trl.trainer.fast_paths.decode_replay import (
    DecodeLayerOutputs,
    layer_outputs_fallback_reason,
    recording_layer_outputs,
    replay_decoder_layers,
    replayed_layer_outputs,
)
from trl.trainer.fast_paths.prefix_sharing import same_prompt_groups, share_prefixes, shared_prefix_token_logps
from trl.trainer.fast_paths.rollout_decode import decode_rollouts


pytestmark = pytest.mark.usefixtures("single_thread")

PAD = 0


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM")).eval()


def _rollout(model, share, max_new_tokens=6):
    """Three prompts (two left-padded) three times each, sampled with end-of-sequence tokens some rows emit early;
    returns the decode output, the batch's attended mask and its shared-prefix layout."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(12, model.config.vocab_size - 10, (3, 9), generator=generator)
    mask = torch.ones_like(ids)
    for row, padding in ((1, 3), (2, 5)):
        ids[row, :padding], mask[row, :padding] = PAD, 0
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    settings = dict(do_sample=True, max_new_tokens=max_new_tokens, pad_token_id=PAD, temperature=0.5)
    torch.manual_seed(3)
    probe = decode_rollouts(model, ids, mask, rows, GenerationConfig(**settings)).sequences[:, ids.shape[1] :]
    # End tokens: what two rows emit early on with this seed, so that rows end at different steps.
    eos = sorted({int(probe[0, 2]), int(probe[4, 3])})
    torch.manual_seed(3)
    config = GenerationConfig(**settings, eos_token_id=eos)
    output = decode_rollouts(model, ids, mask, rows, config, share_prompt_cache=share, record_layer_outputs=True)
    completions = output.sequences[:, ids.shape[1] :]
    attended = torch.ones_like(completions)
    ends = torch.isin(completions, torch.tensor(eos))
    assert ends.any(dim=1).any() and not ends.any(dim=1).all()  # some rows end early, others run to the end
    for row in range(completions.shape[0]):
        hits = ends[row].nonzero()
        if len(hits):
            attended[row, int(hits[0]) + 1 :] = 0
    attention_mask = torch.cat([mask[rows], attended], dim=1)
    layout = share_prefixes(output.sequences, attention_mask, same_prompt_groups(ids[rows], mask[rows]), PAD)
    return output, attention_mask, layout


def _needed(attention_mask, layout):
    """Layout positions some scored token depends on: every attended token but each row's last."""
    mask = attention_mask.bool()
    positions = mask.long().cumsum(dim=1) - 1
    needed = mask & (positions < mask.long().sum(dim=1, keepdim=True) - 1)
    flat = torch.zeros(layout.input_ids.numel(), dtype=torch.bool)
    flat[layout.token_index[needed]] = True
    return flat.view(layout.input_ids.shape)


@pytest.mark.parametrize("share", [True, False], ids=["shared_prefill", "whole_prompts"])
def test_recorded_outputs_are_the_forward_outputs(model, share):
    output, attention_mask, layout = _rollout(model, share)
    assert output.layer_outputs is not None
    replayed = replayed_layer_outputs(
        output.layer_outputs, output.sequences, attention_mask, layout.token_index, tuple(layout.input_ids.shape)
    )
    forward = []
    with torch.no_grad(), recording_layer_outputs(model, forward):
        model(
            input_ids=layout.input_ids,
            attention_mask=layout.attention_mask(torch.float32),
            position_ids=layout.position_ids,
        )
    needed = _needed(attention_mask, layout)
    assert len(replayed) == len(forward) == model.config.num_hidden_layers
    for recorded, computed in zip(replayed, forward):
        assert recorded.shape == computed.shape
        torch.testing.assert_close(recorded[needed], computed[needed], rtol=1e-5, atol=1e-6)
        assert not recorded[layout.segment_ids < 0].any()  # the layout's padding holds zeros


def test_a_batch_the_rollout_did_not_decode_is_not_replayed(model):
    output, attention_mask, layout = _rollout(model, True)
    other = output.sequences.clone()
    row = int(attention_mask[:, -3].nonzero()[0])
    other[row, -3] = (other[row, -3] + 1) % model.config.vocab_size
    shape = tuple(layout.input_ids.shape)
    assert replayed_layer_outputs(output.layer_outputs, other, attention_mask, layout.token_index, shape) is None


def test_replayed_pass_gives_the_checkpointed_loss_and_gradients(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    output, attention_mask, layout = _rollout(model.eval(), True)
    model.train()
    enable_activation_checkpointing(model)
    target_mask = torch.zeros(attention_mask.shape[0], attention_mask.shape[1] - 1, dtype=torch.bool)
    target_mask[:, 8:] = attention_mask[:, 9:].bool()
    replayed = replayed_layer_outputs(
        output.layer_outputs, output.sequences, attention_mask, layout.token_index, tuple(layout.input_ids.shape)
    )
    results = []
    for replay in (False, True):
        model.zero_grad(set_to_none=True)
        calls = []
        originals = [layer._gradient_checkpointing_func for layer in model.model.layers]
        for layer, original in zip(model.model.layers, originals):
            layer._gradient_checkpointing_func = lambda *a, original=original, calls=calls, **k: (
                calls.append(1) or original(*a, **k)
            )
        context = replay_decoder_layers(model, replayed) if replay else torch.enable_grad()
        with context:
            result = shared_prefix_token_logps(model, output.sequences, layout, target_mask, compute_entropy=True)
        loss = -(result.logps * target_mask).sum() + 0.1 * result.entropy.sum()
        loss.backward()
        for layer, original in zip(model.model.layers, originals):
            layer._gradient_checkpointing_func = original
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)))
    (loss, grads, calls), (replay_loss, replay_grads, replay_calls) = results
    assert calls == model.config.num_hidden_layers and replay_calls == 0  # the replay ran no checkpointed forward
    torch.testing.assert_close(replay_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(replay_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_models_that_draw_random_numbers_do_not_record(model):
    assert layer_outputs_fallback_reason(model) is None
    config = model.config.to_dict()
    dropout_model = type(model)(type(model.config)(**{**config, "attention_dropout": 0.1}))
    assert layer_outputs_fallback_reason(dropout_model.eval()) == "attention dropout"


make_grpo_args = args_builder(GRPOConfig, **GROUP_ARGS)


def _sgd_updates(trainer_class, args, model_path, prompts, replay):
    trainer = trainer_class(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    trainer._decode_replay = replay
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    updates = {name: before[name] - p.detach() for name, p in trainer.model.named_parameters()}
    return trainer, updates


@pytest.mark.parametrize("trainer_class, config_class", [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)])
def test_trainers_replay_and_update_as_without(tmp_path, model_path, prompts, trainer_class, config_class):
    make_args = args_builder(config_class, **GROUP_ARGS)
    results = []
    for replay in (True, False):
        args = make_args(tmp_path / str(replay), **SGD_STEP_ARGS, gradient_checkpointing=True, max_completion_length=8)
        results.append(_sgd_updates(trainer_class, args, model_path, prompts, replay))
    (replayed, replay_updates), (plain, updates) = results
    assert replayed._decode_replays == 1 and plain._decode_replays == 0
    for name, update in updates.items():
        assert update.abs().sum() > 0, name
        torch.testing.assert_close(replay_updates[name], update, rtol=1e-4, atol=1e-7, msg=name)
    (log,), (plain_log,) = train_logs(replayed), train_logs(plain)
    for key in ("loss", "entropy", "grad_norm", "reward"):
        assert log[key] == pytest.approx(plain_log[key], rel=1e-4, abs=1e-7), key


def _replays_per_pass(trainer):
    """Record, for every loss pass with gradients, the optimizer step it ran at and whether it replayed."""
    passes = []
    original = trainer._token_logps_pass

    def recording(model, *args, **kwargs):
        before = trainer._decode_replays
        result = original(model, *args, **kwargs)
        if torch.is_grad_enabled():
            passes.append((trainer.state.global_step, trainer._decode_replays > before))
        return result

    trainer._token_logps_pass = recording
    return passes


@pytest.mark.parametrize(
    "settings, expected",
    [
        # On-policy with gradient accumulation: both micro-batches of a rollout are trained before the update.
        (dict(gradient_accumulation_steps=2, num_generations=4), [(0, True), (0, True), (1, True), (1, True)]),
        # Off-policy: the ratios compare with old log-probabilities computed by a pass of the layers.
        (dict(num_iterations=2, num_generations=4), [(0, False), (1, False)]),
        (dict(steps_per_generation=2, num_generations=4), [(0, False), (1, False)]),
        # Without gradient checkpointing there is no checkpointed pass to replay, and nothing is recorded.
        (dict(gradient_checkpointing=False), [(0, False), (1, False)]),
    ],
    ids=["accumulation", "iterations", "steps_per_generation", "no_checkpointing"],
)
def test_replay_only_on_policy_with_checkpointing(tmp_path, model_path, prompts, settings, expected):
    args = make_grpo_args(tmp_path, **{"gradient_checkpointing": True, **settings})
    trainer = GRPOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    passes = _replays_per_pass(trainer)
    trainer.train()
    assert passes == expected
    if not args.gradient_checkpointing:
        assert trainer._rollout_layer_outputs is None


def test_parameters_changed_in_place_are_not_replayed(tmp_path, model_path, prompts):
    """An in-place change of a parameter between the rollout and the loss pass (here by a reward function) stops the
    replay, and the loss pass then equals the pass that never recorded."""
    results = []
    for replay in (True, False):
        holder = []

        def nudging_reward(completion_ids, holder=holder, **kwargs):
            with torch.no_grad():
                holder[0].model.model.layers[0].mlp.up_proj.weight.add_(1e-3)
            return low_id_reward(completion_ids)

        args = make_grpo_args(tmp_path / str(replay), **SGD_STEP_ARGS, gradient_checkpointing=True)
        trainer = GRPOTrainer(model_path, reward_funcs=nudging_reward, args=args, train_dataset=prompts)
        holder.append(trainer)
        trainer._decode_replay = replay
        trainer.train()
        results.append(trainer)
    assert results[0]._decode_replays == 0
    assert train_logs(results[0])[0]["loss"] == train_logs(results[1])[0]["loss"]


@pytest.mark.parametrize("bias", [True, False])
def test_gradient_only_linear_back_propagates_as_the_linear(bias):
    """The recompute's down projection skips its product but gives the linear's gradients (written out by hand)."""
    from trl.trainer.fast_paths.layer_checkpoints import _GradientOnlyLinear

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(2, 5, 6, generator=generator, requires_grad=True)
    weight = torch.randn(4, 6, generator=generator, requires_grad=True)
    bias_tensor = torch.randn(4, generator=generator, requires_grad=True) if bias else None
    grad_output = torch.randn(2, 5, 4, generator=generator)
    output = _GradientOnlyLinear.apply(inputs, weight, bias_tensor)
    assert output.shape == (2, 5, 4) and not output.any()
    output.backward(grad_output)
    torch.testing.assert_close(inputs.grad, torch.einsum("bto,oi->bti", grad_output, weight.detach()))
    torch.testing.assert_close(weight.grad, torch.einsum("bto,bti->oi", grad_output, inputs.detach()))
    if bias:
        torch.testing.assert_close(bias_tensor.grad, grad_output.sum(dim=(0, 1)))


def test_index_places_every_call_at_its_rows_and_positions(model):
    # Two prompts (the first left-padded by one) for three rollout rows: a shared prefill computes each prompt once
    # (rows 0 and 1 share prompt 0), then a two-token step and three one-token steps feed every row.
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    recorded = DecodeLayerOutputs(model, torch.zeros(3, 4, dtype=torch.long), prompt_mask, max_new_tokens=5)
    hidden = model.config.hidden_size
    layers = recorded.num_layers
    all_rows = torch.arange(3)
    calls = [(torch.tensor([0, 0, 1]), 0, 4, 2)]  # (call_rows, first_column, length, rows in the call)
    calls += [(all_rows, 4, 2, 3)] + [(all_rows, column, 1, 3) for column in (6, 7, 8)]
    for call_rows, first_column, length, rows in calls:
        recorded.record_call([torch.zeros(rows, length, hidden)] * layers, call_rows, first_column)
    # Hand-computed: entry numbers run call by call, within a call row by row, then column by column.
    expected = torch.full((3, 9), -1)
    padding = [1, 1, 0]
    entry = 0
    for call_rows, first_column, length, rows in calls:
        for row in range(3):
            for offset in range(length):
                position = first_column + offset - padding[row]
                if position >= 0:
                    expected[row, position] = entry + int(call_rows[row]) * length + offset
        entry += rows * length
    assert recorded.num_entries == entry == 2 * 4 + 3 * 2 + 3 * 3
    assert torch.equal(recorded.index, expected)
    assert torch.equal(recorded.index, expected)  # reading again changes nothing
    assert recorded.table(0).shape == (entry + 1, hidden)
