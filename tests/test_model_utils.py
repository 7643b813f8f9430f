"""Tests for trl.models (reference models, generation unwrapping, activation offloading) and trl.experimental.utils."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from accelerate import Accelerator
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from trl._compat import enable_activation_checkpointing, is_activation_checkpointing
from trl.experimental.utils import (
    add_bos_token_if_needed,
    add_eos_token_if_needed,
    create_reference_model,
    empty_cache,
    first_true_indices,
    get_reward,
    pad_to_length,
    truncate_right,
)
from trl.models.activation_offloading import NoOpManager, OffloadActivations, get_act_offloading_ctx_manager
from trl.models.utils import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation


def tiny_config(**kwargs):
    defaults = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    defaults.update(kwargs)
    return Qwen2Config(**defaults)


def tiny_model(**kwargs):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_config(**kwargs))


# ---------------------------------------------------------------------------------------------------------------------
# create_reference_model
# ---------------------------------------------------------------------------------------------------------------------


def test_create_reference_model_is_frozen_copy():
    model = tiny_model()
    ref = create_reference_model(model)
    assert not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters())  # the policy is untouched
    for (name, p), (ref_name, ref_p) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == ref_name
        assert torch.equal(p, ref_p)
        assert p.data_ptr() != ref_p.data_ptr()  # real copies


def test_create_reference_model_shares_leading_layers():
    model = tiny_model()
    ref = create_reference_model(model, num_shared_layers=2)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        shared = name.startswith("model.embed_tokens.") or name.startswith(("model.layers.0.", "model.layers.1."))
        if shared:
            assert ref_params[name] is param  # the very same tensor
            assert not param.requires_grad
        else:
            assert ref_params[name].data_ptr() != param.data_ptr()
            assert param.requires_grad and not ref_params[name].requires_grad
    # Sharing is real: updating the policy's embedding shows up in the reference.
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] = 123.0
        model.model.layers[2].mlp.up_proj.weight[0, 0] = 456.0
    assert ref.model.embed_tokens.weight[0, 0].item() == 123.0
    assert ref.model.layers[2].mlp.up_proj.weight[0, 0].item() != 456.0


def test_create_reference_model_keeps_weight_tying():
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = create_reference_model(model, num_shared_layers=1)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight is model.model.embed_tokens.weight


def test_create_reference_model_pattern_and_errors():
    model = tiny_model()
    ref = create_reference_model(model, num_shared_layers=1, pattern="model.layers.{layer}")
    assert ref.model.layers[0].self_attn.q_proj.weight is model.model.layers[0].self_attn.q_proj.weight
    assert ref.model.layers[1].self_attn.q_proj.weight is not model.model.layers[1].self_attn.q_proj.weight
    with pytest.raises(ValueError, match="pattern"):
        create_reference_model(tiny_model(), num_shared_layers=1, pattern="decoder.blocks.{layer}")
    with pytest.raises(ValueError, match="layer 7"):
        create_reference_model(tiny_model(), num_shared_layers=7)


def test_deprecated_create_reference_model_warns():
    import trl
    from trl.models import create_reference_model as deprecated

    assert trl.create_reference_model is deprecated
    with pytest.warns(FutureWarning, match="trl.experimental.utils.create_reference_model"):
        ref = deprecated(tiny_model())
    assert all(not p.requires_grad for p in ref.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        create_reference_model(tiny_model())  # the experimental one does not warn


# ---------------------------------------------------------------------------------------------------------------------
# unwrap_model_for_generation / DeepSpeed / FSDP
# ---------------------------------------------------------------------------------------------------------------------


def test_unwrap_model_for_generation_toggles_checkpointing_and_cache():
    accelerator = Accelerator(cpu=True)
    model = tiny_model()
    enable_activation_checkpointing(model, {"use_reentrant": False})
    model.config.use_cache = False
    prepared = accelerator.prepare(model)
    input_ids = torch.tensor([[1, 2, 3]])
    with unwrap_model_for_generation(
        prepared,
        accelerator,
        generation_kwargs={"max_new_tokens": 2, "do_sample": False},
        gradient_checkpointing_kwargs={"use_reentrant": False},
    ) as unwrapped:
        assert unwrapped is model
        assert not is_activation_checkpointing(unwrapped)
        assert unwrapped.config.use_cache is True
        assert unwrapped.generation_config.max_new_tokens == 2
        output = unwrapped.generate(input_ids, pad_token_id=0)
        assert output.shape == (1, 5)
    assert is_activation_checkpointing(model)
    assert model.config.use_cache is False
    assert model.generation_config.max_new_tokens != 2


def test_unwrap_model_for_generation_restores_after_error():
    accelerator = Accelerator(cpu=True)
    model = tiny_model()
    enable_activation_checkpointing(model)
    with pytest.raises(RuntimeError, match="boom"):
        with unwrap_model_for_generation(model, accelerator):
            raise RuntimeError("boom")
    assert is_activation_checkpointing(model)


def test_unwrap_model_without_checkpointing_leaves_it_off():
    accelerator = Accelerator(cpu=True)
    model = tiny_model()
    with unwrap_model_for_generation(model, accelerator) as unwrapped:
        assert not is_activation_checkpointing(unwrapped)
    assert not is_activation_checkpointing(model)


def test_prepare_deepspeed_and_fsdp_require_their_backend():
    accelerator = Accelerator(cpu=True)
    with pytest.raises((ImportError, ValueError)):
        prepare_deepspeed(tiny_model(), accelerator)
    with pytest.raises(ValueError, match="FSDP"):
        prepare_fsdp(tiny_model(), accelerator)


# ---------------------------------------------------------------------------------------------------------------------
# Activation offloading
# ---------------------------------------------------------------------------------------------------------------------


def loss_and_grads(model, input_ids, context=None):
    model.zero_grad(set_to_none=True)
    if context is None:
        loss = model(input_ids=input_ids, labels=input_ids).loss
    else:
        with context:
            loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("force_copies", [False, True])
def test_activation_offloading_gives_identical_gradients(force_copies):
    model = tiny_model()
    input_ids = torch.randint(1, 64, (2, 12))
    ref_loss, ref_grads = loss_and_grads(model, input_ids)

    manager = get_act_offloading_ctx_manager(model, min_offload_size=64)
    assert isinstance(manager, OffloadActivations)
    manager.offload_cpu_tensors = force_copies  # real host copies even without an accelerator
    loss, grads = loss_and_grads(model, input_ids, manager)
    assert torch.equal(loss, ref_loss)
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), name
    if force_copies:
        assert manager.num_offloaded > 0
    else:
        assert manager.num_offloaded == 0  # CPU tensors stay where they are
    assert manager.num_kept > 0

    # Repeated use of the same manager works (one context per training step).
    loss, grads = loss_and_grads(model, input_ids, manager)
    assert torch.equal(loss, ref_loss)


def test_activation_offloading_respects_size_threshold():
    model = tiny_model()
    input_ids = torch.randint(1, 64, (2, 12))
    manager = get_act_offloading_ctx_manager(model, min_offload_size=10**9)
    manager.offload_cpu_tensors = True
    loss_and_grads(model, input_ids, manager)
    assert manager.num_offloaded == 0 and manager.num_kept > 0


def test_activation_offloading_never_offloads_parameters():
    linear = nn.Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    manager = OffloadActivations(min_offload_size=0)
    manager.offload_cpu_tensors = True
    manager.track_model(linear)
    with manager:
        y = linear(x)
    y.sum().backward()
    # addmm saves the input (offloaded) and a transposed view of the weight (a parameter: kept).
    assert (manager.num_offloaded, manager.num_kept) == (1, 1)
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(8, 32))


def test_activation_offloading_exempts_output_head():
    input_ids = torch.randint(1, 64, (2, 12))

    def packed_count(model, manager):
        manager.offload_cpu_tensors = True
        with manager:
            model(input_ids=input_ids).logits.sum().backward()
        return manager.num_offloaded + manager.num_kept

    plain_model, hooked_model = tiny_model(), tiny_model()
    plain = OffloadActivations(min_offload_size=0)  # no hooks on the head
    plain.track_model(plain_model)
    with_head_hooks = get_act_offloading_ctx_manager(hooked_model, min_offload_size=0)
    baseline = packed_count(plain_model, plain)
    exempted = packed_count(hooked_model, with_head_hooks)
    assert len(with_head_hooks.head_hook_handles) == 2
    assert 0 < exempted < baseline  # what the lm_head saves no longer reaches the offloader


def test_activation_offloading_warns_without_head():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.warns(UserWarning, match="output head"):
        manager = get_act_offloading_ctx_manager(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_act_offloading_ctx_manager(model, warn_if_no_head=False)
    x = torch.randn(3, 4)
    manager.offload_cpu_tensors = True
    with manager:
        model(x).sum().backward()
    assert manager.num_offloaded == 0  # 4x4 fp32 activations are below the 1024-byte default


def test_noop_manager_overrides_offloading():
    offloader = OffloadActivations(min_offload_size=0)
    offloader.offload_cpu_tensors = True
    x = torch.randn(64, 64, requires_grad=True)
    with offloader:
        with NoOpManager():
            y = (x * x).sum()
    y.backward()
    assert offloader.num_offloaded == 0
    assert torch.allclose(x.grad, 2 * x)


# ---------------------------------------------------------------------------------------------------------------------
# trl.experimental.utils helpers
# ---------------------------------------------------------------------------------------------------------------------


def test_pad_to_length():
    tensor = torch.tensor([[1, 2], [3, 4]])
    assert pad_to_length(tensor, 4, pad_value=-1).tolist() == [[1, 2, -1, -1], [3, 4, -1, -1]]
    assert pad_to_length(tensor, 3, pad_value=0, dim=0).tolist() == [[1, 2], [3, 4], [0, 0]]
    assert pad_to_length(tensor, 2, pad_value=9) is tensor


def test_first_true_indices():
    bools = torch.tensor([[False, True, True], [False, False, False], [True, False, True]])
    assert first_true_indices(bools).tolist() == [1, 3, 0]
    assert first_true_indices(bools, dtype=torch.int32).dtype == torch.int32


def test_truncate_right():
    ids = torch.tensor([[5, 2, 7, 8], [5, 6, 7, 8], [2, 2, 3, 4]])
    out, mask = truncate_right(ids, stop_token_ids=2, pad_token_id=0)
    assert out.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    out, _ = truncate_right(ids, stop_token_ids=[7, 3], pad_token_id=-1)
    assert out.tolist() == [[5, 2, 7, -1], [5, 6, 7, -1], [2, 2, 3, -1]]


def test_add_bos_and_eos_tokens_if_needed():
    chosen = {
        "input_ids": [4, 5],
        "attention_mask": [1, 1],
        "prompt_input_ids": [1, 3],
        "prompt_attention_mask": [1, 1],
    }
    rejected = {"input_ids": [6, 9], "attention_mask": [1, 1], "prompt_input_ids": [3], "prompt_attention_mask": [1]}
    prompt = {"prompt_input_ids": [3], "prompt_attention_mask": [1]}
    prompt, chosen, rejected = add_bos_token_if_needed(1, 1, prompt, 2, chosen, 1, rejected)
    assert prompt["prompt_input_ids"] == [1, 3] and prompt["prompt_attention_mask"] == [1, 1]
    assert chosen["prompt_input_ids"] == [1, 3]  # already started with BOS
    assert rejected["prompt_input_ids"] == [1, 3]
    chosen, rejected = add_eos_token_if_needed(9, chosen, rejected)
    assert chosen["input_ids"] == [4, 5, 9] and chosen["attention_mask"] == [1, 1, 1]
    assert rejected["input_ids"] == [6, 9] and rejected["attention_mask"] == [1, 1]


def test_get_reward():
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(tiny_config(num_labels=1)).eval()
    pad = 0
    query_responses = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 9, 10, 11, 12]])
    logits, scores, lengths = get_reward(model, query_responses, pad, context_length=2)
    assert logits.shape == (2, 6, 1)
    assert lengths.tolist() == [3, 5]
    assert torch.equal(scores, logits[[0, 1], [3, 5]].squeeze(-1))
    with torch.no_grad():
        expected = model(input_ids=query_responses[1:2]).logits
    torch.testing.assert_close(scores[1:2], expected.squeeze(-1), atol=1e-5, rtol=1e-5)


def test_empty_cache_collects_garbage():
    """A tensor kept alive only by a reference cycle is freed by `empty_cache()` (its garbage collection); on a
    CPU-only machine there is no accelerator cache to release (the CUDA/XPU/MPS/NPU branches need that hardware)."""
    import gc
    import weakref

    gc.disable()
    try:
        holder = {"tensor": torch.ones(4)}
        holder["self"] = holder  # a cycle: reference counting alone never frees it
        alive = weakref.ref(holder["tensor"])
        del holder
        assert alive() is not None
        empty_cache()
        assert alive() is None
    finally:
        gc.enable()


def test_reference_model_is_independent_of_later_training():
    model = tiny_model()
    ref = create_reference_model(model)
    before = copy.deepcopy(ref.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    input_ids = torch.randint(1, 64, (1, 6))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    for name, value in ref.state_dict().items():
        assert torch.equal(value, before[name])
