"""Checkpointed decoder layers with their kept outputs outside the heap (`trl/trainer/fast_paths/layer_checkpoints.py`):
the values and gradients of torch's checkpoint, the arena reused step after step, and transformers' checkpoint kept
wherever the layer or the settings do not qualify."""

import contextlib

import pytest
import torch
from trainer_utils import LLAMA_STYLE_FAMILIES, args_builder, llama_style_decoder, record_calls, train_logs

from trl import SFTConfig, SFTTrainer
from trl._compat import enable_activation_checkpointing
from trl.trainer.fast_paths import layer_checkpoints
from trl.trainer.fast_paths.layer_checkpoints import (
    CheckpointArena,
    layer_checkpoint_fallback_reason,
    lean_layer_checkpoints,
)
from trl.trainer.utils import logprobs
from trl.trainer.utils.logprobs import capture_lm_head_inputs, compute_token_logps


pytestmark = pytest.mark.usefixtures("single_thread")


def _loss_and_grads(model, ids, arena=None, keep_activations=False, zero_grad=True):
    if zero_grad:
        model.zero_grad(set_to_none=True)
    if arena is None:
        logits = model(input_ids=ids).logits
    else:
        with lean_layer_checkpoints(model, arena, keep_activations=keep_activations) as switched:
            assert switched == model.config.num_hidden_layers
            logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _fused_loss_and_grads(model, ids, arena=None, zero_grad=True):
    """Minus the mean label log-prob through the fused LM head (no logits materialised), and the gradients."""
    if zero_grad:
        model.zero_grad(set_to_none=True)
    with lean_layer_checkpoints(model, arena) if arena is not None else contextlib.nullcontext():
        loss = -compute_token_logps(model, ids).logps.mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture
def no_head_margin(monkeypatch):
    """The fused head's working memory left out of the budget's margin: at a tiny width it exceeds every layer."""
    monkeypatch.setattr(logprobs, "fused_head_working_bytes", lambda: 0)


@pytest.mark.parametrize("family", LLAMA_STYLE_FAMILIES)
def test_layers_kept_within_the_gradient_budget_are_bitwise_the_checkpoint(family, no_head_margin):
    torch.manual_seed(0)
    model = llama_style_decoder(family).train()
    enable_activation_checkpointing(model)
    layers = model.config.num_hidden_layers
    ids = torch.randint(1, 300, (2, 11))
    loss, grads = _fused_loss_and_grads(model, ids)
    arena = CheckpointArena()
    for step in range(2):  # the first forward keeps the last layer and measures it; the second keeps what fits
        lean_loss, lean_grads = _fused_loss_and_grads(model, ids, arena)
        torch.testing.assert_close(lean_loss, loss, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(lean_grads[name], grad, rtol=0, atol=0, msg=name)
        # The first forward keeps the last layer only; at this tiny width the second keeps more.
        assert arena.budget.keep_from == layers - 1 if step == 0 else arena.budget.keep_from < layers - 1
        assert arena.budget.outstanding == 0 and arena.live == 0  # every kept layer's backward has run


def _measured_budget():
    """A checkpointed tiny decoder after one fused-head step (its budget has measured a layer's bytes per token):
    `(model, arena, ids, budget, per-layer gradient sizes)`."""
    torch.manual_seed(0)
    model = llama_style_decoder("qwen2").train()
    enable_activation_checkpointing(model)
    arena = CheckpointArena()
    ids = torch.randint(1, 300, (2, 11))
    _fused_loss_and_grads(model, ids, arena)
    budget = arena.budget
    sizes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in budget.layers]
    return model, arena, ids, budget, sizes


def test_the_budget_is_the_unallocated_gradients_of_the_layers(no_head_margin):
    model, arena, ids, budget, sizes = _measured_budget()
    per_layer = budget.bytes_per_token * ids.numel()
    assert per_layer > 0
    model.zero_grad(set_to_none=True)
    head = model.get_output_embeddings()
    with capture_lm_head_inputs(head):
        budget.plan(ids.numel())
        assert len(budget.layers) - budget.keep_from == min(len(sizes), int((sum(sizes) - max(sizes)) // per_layer))
        tokens = int((sum(sizes) - max(sizes)) // budget.bytes_per_token)  # exactly one layer's activations fit
        budget.plan(tokens)
        assert budget.keep_from == len(sizes) - 1
        budget.plan(tokens + 1)
        assert budget.keep_from == len(sizes)
    budget.plan(1)  # logits materialised in this forward: they would sit on top of kept activations
    assert budget.keep_from == len(sizes)
    # Gradient accumulation: the gradients of the first micro-batch are allocated, nothing is kept in the next one.
    _fused_loss_and_grads(model, ids, arena)
    assert budget.keep_from < len(sizes)
    _fused_loss_and_grads(model, ids, arena, zero_grad=False)
    assert budget.keep_from == len(sizes)


def test_declared_small_logits_leave_the_rest_of_the_budget(no_head_margin):
    model, _, _, budget, sizes = _measured_budget()
    model.zero_grad(set_to_none=True)
    tokens = int((sum(sizes) - max(sizes)) // budget.bytes_per_token)  # one layer's activations fit, no more
    budget.plan(tokens)
    assert budget.keep_from == len(sizes)  # full logits: nothing kept
    with logprobs.small_head_output(0):
        budget.plan(tokens)
        assert budget.keep_from == len(sizes) - 1
        with logprobs.small_head_output(int(budget.bytes_per_token)):  # the innermost declaration counts
            budget.plan(tokens)
            assert budget.keep_from == len(sizes)
    assert logprobs.head_output_bytes(model) is None


def test_a_forward_with_logits_keeps_no_layer():
    torch.manual_seed(0)
    model = llama_style_decoder("qwen2").train()
    enable_activation_checkpointing(model)
    arena = CheckpointArena()
    _loss_and_grads(model, torch.randint(1, 300, (2, 11)), arena, keep_activations=True)
    assert arena.budget.keep_from == model.config.num_hidden_layers and arena.budget.bytes_per_token is None


@pytest.mark.parametrize("family", LLAMA_STYLE_FAMILIES)
def test_values_and_gradients_are_the_checkpoint(family):
    torch.manual_seed(0)
    model = llama_style_decoder(family).train()
    enable_activation_checkpointing(model)
    ids = torch.randint(1, 300, (2, 11))
    loss, grads = _loss_and_grads(model, ids)
    arena = CheckpointArena()
    lean_loss, lean_grads = _loss_and_grads(model, ids, arena)
    torch.testing.assert_close(lean_loss, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    # Every kept output was released by its layer's backward pass: the next step starts at the beginning, in one
    # chunk (the first step's chunks, grown while its need was unknown, are merged).
    assert arena.live == 0 and arena.offset == 0 and len(arena.chunks) <= 1
    _loss_and_grads(model, ids, arena)
    assert arena.live == 0 and arena.offset == 0 and len(arena.chunks) == 1


def test_kept_outputs_live_in_the_arena_and_are_reused():
    torch.manual_seed(0)
    model = llama_style_decoder("qwen2").train()
    enable_activation_checkpointing(model)
    arena = CheckpointArena()
    kept = []
    original = arena.keep

    def recording_keep(output):
        result = original(output)
        kept.append(result.untyped_storage().data_ptr())
        return result

    arena.keep = recording_keep
    for _ in range(3):
        _loss_and_grads(model, torch.randint(1, 300, (2, 9)), arena)
    (chunk,) = arena.chunks  # the first step's chunks merged into one, sized to what a step keeps
    assert chunk.numel() * chunk.element_size() == arena.needed
    assert set(kept[-model.config.num_hidden_layers :]) == {chunk.untyped_storage().data_ptr()}
    assert len(kept) == 3 * model.config.num_hidden_layers


def test_arena_grows_and_merges_its_chunks():
    arena = CheckpointArena()
    small = torch.ones(4)
    first = arena.keep(small)
    big = torch.ones(1024)  # does not fit behind `first`
    second = arena.keep(big)
    assert len(arena.chunks) == 2 and torch.equal(first, small) and torch.equal(second, big)
    neighbour = arena.keep(small)  # right behind `second`, in the same chunk
    assert neighbour.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    version = second._version
    neighbour.add_(1)  # kept outputs are tensors of their own: writing one leaves the others' version counters alone
    assert second._version == version and torch.equal(second, big)
    for _ in range(3):
        arena.release()
    assert arena.chunks == [] and arena.needed >= big.numel() * 4  # one chunk large enough for both next time
    arena.keep(small)
    arena.keep(big)
    assert len(arena.chunks) == 1


def test_a_step_after_a_dropped_graph_does_not_overwrite_its_outputs():
    torch.manual_seed(0)
    model = llama_style_decoder("llama").train()
    enable_activation_checkpointing(model)
    arena = CheckpointArena()
    with lean_layer_checkpoints(model, arena, keep_activations=False):
        dropped = model(input_ids=torch.randint(1, 300, (1, 7)), output_hidden_states=True)
    assert arena.live == model.config.num_hidden_layers
    kept = [state.clone() for state in dropped.hidden_states[1:-1]]
    _loss_and_grads(model, torch.randint(1, 300, (1, 7)), arena)
    for state, copy in zip(dropped.hidden_states[1:-1], kept):
        assert torch.equal(state, copy)


def test_recompute_runs_the_lean_mlp_unless_hooked(monkeypatch):
    """The backward pass's recompute runs a plain SwiGLU MLP through the lean kernel with its output unused (it keeps
    two `tokens x intermediate` tensors instead of four); an MLP with a hook on a projection keeps its own calls (the
    hook runs), with only the down product skipped. Gradients are transformers' checkpoint's either way."""
    torch.manual_seed(0)
    model = llama_style_decoder("qwen2").train()
    enable_activation_checkpointing(model)
    ids = torch.randint(1, 300, (2, 9))
    _, grads = _loss_and_grads(model, ids)
    hooked = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda *args: hooked.append(1))
    lean_calls, gradient_only_calls = [], []
    original_lean, original_gradient_only = layer_checkpoints.swiglu_mlp, layer_checkpoints._GradientOnlyLinear.apply
    monkeypatch.setattr(
        layer_checkpoints, "swiglu_mlp", lambda *a, **k: lean_calls.append(k) or original_lean(*a, **k)
    )
    monkeypatch.setattr(
        layer_checkpoints._GradientOnlyLinear,
        "apply",
        lambda *a: gradient_only_calls.append(1) or original_gradient_only(*a),
    )
    hooked.clear()
    _, lean_grads = _loss_and_grads(model, ids, CheckpointArena())
    layers = model.config.num_hidden_layers
    assert lean_calls == [{"output_unused": True}] * (layers - 1) and gradient_only_calls == [1]
    assert hooked == [1, 1]  # the hooked layer's forward, then its recompute
    for name, grad in grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=1e-6, atol=1e-8, msg=name)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_recompute_skips_the_base_product_of_a_lora_down_projection(monkeypatch, dora):
    """Under LoRA (frozen base weights, adapters on every projection) the recompute skips the down projection's base
    product, whose value it never reads; its adapters' terms still run. Gradients are transformers' checkpoint's.
    A DoRA adapter, whose terms read the base output, keeps the product."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, use_dora=dora)
    model = get_peft_model(llama_style_decoder("qwen2"), config).base_model.model.train()
    enable_activation_checkpointing(model)
    model.enable_input_require_grads()  # frozen embeddings: as the trainers do under PEFT (reentrant checkpoints)
    ids = torch.randint(1, 300, (2, 9))
    _, grads = _loss_and_grads(model, ids)
    calls = []
    original = layer_checkpoints._GradientOnlyLinear.apply
    monkeypatch.setattr(layer_checkpoints._GradientOnlyLinear, "apply", lambda *a: calls.append(1) or original(*a))
    _, lean_grads = _loss_and_grads(model, ids, CheckpointArena())
    assert calls == ([] if dora else [1] * model.config.num_hidden_layers)
    assert grads.keys() == lean_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(lean_grads[name], grad, rtol=1e-6, atol=1e-8, msg=name)


def test_layers_and_settings_that_keep_transformers_checkpoint():
    torch.manual_seed(0)
    model = llama_style_decoder("qwen2").train()
    layer = model.model.layers[0]
    assert layer_checkpoint_fallback_reason(layer) == "gradient checkpointing off"
    enable_activation_checkpointing(model)
    assert layer_checkpoint_fallback_reason(layer) is None
    layer.self_attn.attention_dropout = 0.1
    assert layer_checkpoint_fallback_reason(layer) == "attention dropout"
    layer.self_attn.attention_dropout = 0.0
    with (
        lean_layer_checkpoints(model, CheckpointArena(), keep_activations=False),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        calls = []
        original = layer_checkpoints.checkpointed_layer
        layer_checkpoints.checkpointed_layer = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            model(input_ids=torch.randint(1, 300, (1, 5))).logits.sum().backward()
        finally:
            layer_checkpoints.checkpointed_layer = original
    assert calls == []  # autocast: transformers' checkpoint replays its state, so it keeps the layers


make_args = args_builder(SFTConfig, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, seed=0)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_sft_trains_as_with_transformers_checkpoint(tmp_path, model_path, monkeypatch, peft):
    """SFT end to end, also with LoRA adapters inside the checkpointed layers (their projections are PEFT layers,
    the base weights frozen): the same losses and trained weights as with transformers' checkpoint."""
    from datasets import Dataset
    from peft import LoraConfig

    dataset = Dataset.from_dict({"text": [f"row {i} " + "word " * (3 + i % 5) for i in range(8)]})
    results = []
    for lean in (True, False):
        if not lean:
            monkeypatch.setattr(layer_checkpoints, "layer_checkpoint_fallback_reason", lambda layer: "off")
        args = make_args(tmp_path / str(lean), gradient_checkpointing=True)
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0) if peft else None
        trainer = SFTTrainer(model_path, args=args, train_dataset=dataset, peft_config=peft_config)
        trainer.train()
        assert trainer.__dict__.get("_checkpoint_arena") is None  # released when `train()` returns
        trained = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
        results.append(([log["loss"] for log in train_logs(trainer)], trained))
    (losses, weights), (plain_losses, plain_weights) = results
    assert losses == pytest.approx(plain_losses, rel=1e-6) and weights.keys() == plain_weights.keys()
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("trainer_name", ["dpo", "kto", "reward"])
def test_preference_trainers_train_as_with_transformers_checkpoint(tmp_path, trainer_name, monkeypatch):
    """Two-pass trainers (a reference pass, chosen and rejected rows, KL rows) with checkpointing: the same logged
    losses and weights as with transformers' checkpoint, gradient accumulation included; DPO and KTO, which hold a
    reference model, back-propagate their layers one residual block at a time."""
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer
    from trl.assets import get_model_path, load_test_dataset

    trainers = {
        "dpo": (DPOTrainer, DPOConfig, "standard_preference", "tiny-Qwen2ForCausalLM"),
        "kto": (KTOTrainer, KTOConfig, "standard_unpaired_preference", "tiny-Qwen2ForCausalLM"),
        "reward": (RewardTrainer, RewardConfig, "standard_preference", "tiny-Qwen2ForSequenceClassification"),
    }
    trainer_class, config_class, dataset_name, model_name = trainers[trainer_name]
    dataset = load_test_dataset(dataset_name, split="train").select(range(8))
    results = []
    for lean in (True, False):
        if not lean:
            monkeypatch.setattr(layer_checkpoints, "layer_checkpoint_fallback_reason", lambda layer: "off")
        args = config_class(
            output_dir=str(tmp_path / str(lean)), max_steps=2, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=1e-2, gradient_checkpointing=True, logging_steps=1,
            report_to="none", save_strategy="no", disable_tqdm=True, seed=0, bf16=False,
        )  # fmt: skip
        trainer = trainer_class(get_model_path(model_name), args=args, train_dataset=dataset)
        switched, split, kept = [], [], []
        with pytest.MonkeyPatch.context() as patch:
            record_calls(patch, layer_checkpoints, "checkpointed_layer", switched)
            record_calls(patch, layer_checkpoints, "_backward_by_halves", split)
            record_calls(patch, layer_checkpoints.LayerBudget, "run_kept", kept)
            trainer.train()
        assert bool(switched) == lean
        # Trainers holding a separate reference model back-propagate their layers one block at a time.
        assert bool(split) == (lean and trainer_name != "reward")
        # DPO and KTO score with their reference before the policy's forward, whose last layers may then keep
        # activations; the reward model's score head outputs a few numbers per position.
        assert bool(kept) == lean, kept
        results.append(([log["loss"] for log in train_logs(trainer)], trainer.model.state_dict()))
    (losses, weights), (plain_losses, plain_weights) = results
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", ["default", "dropout", "override"])
@pytest.mark.parametrize("trainer_name", ["dpo", "kto"])
def test_preference_reference_pass_runs_before_the_policy_forward_unless_order_matters(tmp_path, trainer_name, case):
    """DPO and KTO score the batch with the reference before the policy's forward (its memory is gone when the
    policy's last layers keep activations). After it, where TRL runs it, with dropout drawing random numbers
    (`disable_dropout=False`, attention dropout in the model: the numbers depend on the order) and when a subclass
    overrides `compute_ref_log_probs`."""
    from transformers import AutoModelForCausalLM

    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
    from trl.assets import get_model_path, load_test_dataset

    trainer_class, config_class, dataset_name, policy_pass = {
        "dpo": (DPOTrainer, DPOConfig, "standard_preference", "_token_logps"),
        "kto": (KTOTrainer, KTOConfig, "standard_unpaired_preference", "_policy_pass"),
    }[trainer_name]
    if case == "override":  # an override that only calls the parent's: TRL's order all the same
        base = trainer_class

        def compute_ref_log_probs(self, model, inputs):
            return base.compute_ref_log_probs(self, model, inputs)

        trainer_class = type("OwnReferenceTrainer", (base,), {"compute_ref_log_probs": compute_ref_log_probs})
    dropout = case == "dropout"
    model = AutoModelForCausalLM.from_pretrained(
        get_model_path("tiny-Qwen2ForCausalLM"), attention_dropout=0.1 if dropout else 0.0
    )
    args = config_class(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=0, bf16=False, disable_dropout=not dropout,
    )  # fmt: skip
    dataset = load_test_dataset(dataset_name, split="train").select(range(8))
    trainer = trainer_class(model, args=args, train_dataset=dataset)
    events = []
    with pytest.MonkeyPatch.context() as patch:
        record_calls(patch, trainer, "compute_ref_log_probs", events, "ref")
        record_calls(patch, trainer, policy_pass, events, "policy", when=torch.is_grad_enabled)
        trainer.train()
    after = case != "default"
    assert events[:2] == (["policy", "ref"] if after else ["ref", "policy"])
    assert trainer._reference_pass_after_policy_forward == after


def _odd_length(prompts, completions, **kwargs):
    return [float(len(text) % 2) for text in completions]


@pytest.mark.parametrize("trainer_name", ["a2po", "grpo"])
def test_trainers_scoring_with_the_reference_before_the_loss_keep_layers(tmp_path, trainer_name, monkeypatch):
    """A2PO and GRPO with `beta` score each batch with their reference model before the loss's forward pass, so that
    pass may keep its last layers' activations (`LayerBudget`; at the tiny width the first forward keeps one): the
    same losses and weights as with transformers' checkpoint."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.a2po import A2POConfig, A2POTrainer

    dataset = load_test_dataset("standard_prompt_only", split="train").select(range(4))
    common = dict(
        max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, gradient_checkpointing=True, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0, bf16=False, max_completion_length=6,
    )  # fmt: skip
    results = []
    for lean in (True, False):
        if not lean:
            monkeypatch.setattr(layer_checkpoints, "layer_checkpoint_fallback_reason", lambda layer: "off")
        output_dir = str(tmp_path / str(lean))
        if trainer_name == "a2po":
            args = A2POConfig(output_dir=output_dir, num_value_samples=2, **common)
            trainer = A2POTrainer(
                get_model_path("tiny-Qwen2ForCausalLM"), reward_funcs=_odd_length, args=args, train_dataset=dataset
            )
        else:
            args = GRPOConfig(output_dir=output_dir, num_generations=2, beta=0.04, **common)
            trainer = GRPOTrainer(
                get_model_path("tiny-Qwen2ForCausalLM"), reward_funcs=_odd_length, args=args, train_dataset=dataset
            )
        assert trainer.ref_model is not None
        kept = []
        with pytest.MonkeyPatch.context() as patch:
            record_calls(patch, layer_checkpoints.LayerBudget, "run_kept", kept)
            trainer.train()
        assert bool(kept) == lean
        results.append(([log["loss"] for log in train_logs(trainer)], trainer.model.state_dict()))
    (losses, weights), (plain_losses, plain_weights) = results
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-9)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("family", LLAMA_STYLE_FAMILIES)
def test_backward_by_halves_is_the_whole_layers_backward(family, monkeypatch):
    """The backward pass through a layer's attention and MLP blocks one after the other gives bitwise the gradients
    of the backward pass through the whole recomputed layer, with a padded batch and a first layer whose attention
    block, like the embeddings, is frozen; each layer class is checked once (its halves give its output) before any
    layer is split."""
    torch.manual_seed(0)
    model = llama_style_decoder(family).train()
    enable_activation_checkpointing(model)
    frozen = [*model.model.embed_tokens.parameters(), *model.model.layers[0].self_attn.parameters()]
    frozen += [*model.model.layers[0].input_layernorm.parameters()]
    for parameter in frozen:  # layer 0: no gradient below its MLP block
        parameter.requires_grad_(False)
    if hasattr(model, "_require_grads_hook"):  # the hook checkpointing puts on the embeddings would ask for one
        model.disable_input_require_grads()
    ids = torch.randint(1, 300, (3, 13))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0

    def run():
        model.zero_grad(set_to_none=True)
        with lean_layer_checkpoints(model, CheckpointArena(split_layers=True), keep_activations=False):
            logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    layer_class = type(model.model.layers[0])
    split = []
    original = layer_checkpoints._backward_by_halves
    monkeypatch.setattr(layer_checkpoints, "_backward_by_halves", lambda *a: split.append(1) or original(*a))
    monkeypatch.delitem(layer_checkpoints._HALVES_VERIFIED, layer_class, raising=False)
    by_halves = run()
    assert layer_checkpoints._HALVES_VERIFIED[layer_class] is True
    assert len(split) == model.config.num_hidden_layers
    monkeypatch.setitem(layer_checkpoints._HALVES_VERIFIED, layer_class, False)
    whole = run()
    assert by_halves.keys() == whole.keys()
    assert not any(name.startswith(("model.embed_tokens", "model.layers.0.self_attn")) for name in whole)
    assert any(name.startswith("model.layers.0.mlp") for name in whole)
    for name, grad in whole.items():
        assert torch.equal(by_halves[name], grad), name
    # Without `split_layers` (the default: trainers without a separate reference model), layers are never split.
    monkeypatch.setitem(layer_checkpoints._HALVES_VERIFIED, layer_class, True)
    split.clear()
    model.zero_grad(set_to_none=True)
    with lean_layer_checkpoints(model, CheckpointArena(), keep_activations=False):
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert not split
