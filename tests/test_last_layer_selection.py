"""The last decoder layer on selected positions (`trl/trainer/fast_paths/last_layer_selection.py`) against the full layer:
equal hidden states at the selected positions and matching gradients for every supported family, mask kind,
attention implementation and gradient checkpointing; the fallback for what it does not handle."""

import pytest
import torch
from trainer_utils import LLAMA_STYLE_FAMILIES, llama_style_decoder
from transformers import AutoModelForSequenceClassification

from trl.assets import get_model_path
from trl.trainer.fast_paths import last_layer_selection
from trl.trainer.fast_paths.last_layer_selection import last_layer_at, last_layer_selection_fallback_reason
from trl.trainer.utils.packing import packed_sdpa_attention


pytestmark = pytest.mark.usefixtures("single_thread")

ROWS, LENGTH = 3, 12
# Positions read: a few per row, unevenly many, as `row * LENGTH + column`, out of order and one of them twice (as
# when two rows share a prefix whose last token predicts both rows' first completion token).
SELECTED = torch.tensor([2, 11, 3, LENGTH + 5, 2 * LENGTH + 0, 2 * LENGTH + 8, 2 * LENGTH + 7, 3])


def _build(family: str, attn_implementation: str = "sdpa", checkpointing: str | None = None):
    torch.manual_seed(0)
    model = llama_style_decoder(family).train()
    model.set_attn_implementation(attn_implementation)
    if checkpointing:
        # transformers' default is the reentrant variant (with a hook making the input embeddings require grad).
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _inputs(mask_kind: str) -> dict:
    torch.manual_seed(1)
    ids = torch.randint(1, 300, (ROWS, LENGTH))
    if mask_kind == "none":
        return {"input_ids": ids}
    if mask_kind == "padding":
        mask = torch.ones_like(ids)
        mask[1, 8:] = 0
        return {"input_ids": ids, "attention_mask": mask}
    # A shared-prefix style 4D additive mask: a 5-token prefix, then two suffixes that do not see each other.
    segment = torch.tensor([0] * 5 + [1] * 4 + [2] * 3)
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    allowed = causal & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None].expand(ROWS, 1, -1, -1)
    position_ids = torch.cat([torch.arange(5), torch.arange(5, 9), torch.arange(5, 8)])[None].expand(ROWS, -1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}


def _hidden_and_grads(model, inputs: dict, selected: torch.Tensor | None):
    model.zero_grad(set_to_none=True)
    with last_layer_at(model, selected if selected is not None else SELECTED[:0], LENGTH) as active:
        hidden = model.model(**inputs, use_cache=False).last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1])[SELECTED]
    (picked.square().sum() + picked.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return active, picked.detach(), grads


@pytest.mark.parametrize("family", LLAMA_STYLE_FAMILIES)
@pytest.mark.parametrize("mask_kind", ["none", "padding", "shared_prefix"])
@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non_reentrant"])
def test_equals_full_layer(family, mask_kind, checkpointing, monkeypatch):
    model = _build(family, checkpointing=checkpointing)
    assert last_layer_selection_fallback_reason(model) is None
    calls = []
    selected_layer = last_layer_selection._selected_layer
    monkeypatch.setattr(last_layer_selection, "_selected_layer", lambda *a: calls.append(1) or selected_layer(*a))
    inputs = _inputs(mask_kind)
    _, full, full_grads = _hidden_and_grads(model, inputs, None)
    assert not calls
    active, picked, grads = _hidden_and_grads(model, inputs, SELECTED)
    assert active and calls  # the selected path ran (and, checkpointed, ran again in backward)
    assert len(calls) == (2 if checkpointing else 1)
    torch.testing.assert_close(picked, full, rtol=1e-5, atol=1e-6)
    assert grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        _assert_grad_close(grads[name], grad, name)
    assert "forward" not in vars(model.model.layers[-1])  # the swap is undone


@pytest.mark.parametrize("attn_implementation", ["eager", "trl_packed_sdpa"])
def test_other_attention_implementations(attn_implementation):
    model = _build("qwen2")
    with packed_sdpa_attention(model) if attn_implementation == "trl_packed_sdpa" else _nothing():
        if attn_implementation == "eager":
            model.set_attn_implementation("eager")
        assert last_layer_selection_fallback_reason(model) is None
        inputs = _inputs("padding")
        _, full, full_grads = _hidden_and_grads(model, inputs, None)
        active, picked, grads = _hidden_and_grads(model, inputs, SELECTED)
    assert active
    torch.testing.assert_close(picked, full, rtol=1e-5, atol=1e-6)
    for name, grad in full_grads.items():
        _assert_grad_close(grads[name], grad, name)


def _assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    # Sums over fewer rows round differently: compare against the gradient's own scale.
    scale = float(expected.abs().max()) + 1e-12
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale, msg=name)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_sequence_classifier_scores_equal():
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(get_model_path("tiny-Qwen2ForSequenceClassification"))
    assert last_layer_selection_fallback_reason(model) is None
    ids = torch.randint(1, 100, (2, 9))
    last = torch.tensor([8, 9 + 8])
    full = model.model(input_ids=ids, use_cache=False).last_hidden_state.reshape(-1, model.config.hidden_size)
    with last_layer_at(model, last, 9) as active:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state.reshape(-1, model.config.hidden_size)
    assert active
    torch.testing.assert_close(model.score(hidden[last]), model.score(full[last]), rtol=1e-5, atol=1e-6)
    # Positions that were not selected are zero (the final norm keeps them so).
    assert hidden[[0, 1, 9]].abs().max() == 0


def test_runs_full_layer_where_it_cannot_select(monkeypatch):
    model = _build("qwen2")
    calls = []
    selected_layer = last_layer_selection._selected_layer
    monkeypatch.setattr(last_layer_selection, "_selected_layer", lambda *a: calls.append(1) or selected_layer(*a))
    ids = _inputs("none")["input_ids"]
    expected = model.model(input_ids=ids, use_cache=False).last_hidden_state
    # With a cache (generation) the layer runs whole.
    with last_layer_at(model, SELECTED, LENGTH) as active:
        assert active
        with_cache = model.model(input_ids=ids, use_cache=True).last_hidden_state
    assert not calls
    torch.testing.assert_close(with_cache, expected)
    # Restarting positions (packed rows): transformers' mask says where each sequence starts, and the selection
    # follows it.
    restart = torch.cat([torch.arange(6), torch.arange(6)])[None].expand(ROWS, -1)
    packed = model.model(input_ids=ids, position_ids=restart, use_cache=False).last_hidden_state
    with last_layer_at(model, SELECTED, LENGTH):
        selected = model.model(input_ids=ids, position_ids=restart, use_cache=False).last_hidden_state
    flat = lambda h: h.reshape(-1, h.shape[-1])[SELECTED]  # noqa: E731
    torch.testing.assert_close(flat(selected), flat(packed), rtol=1e-5, atol=1e-6)
    # Selecting most positions saves nothing: the block leaves the layer alone.
    with last_layer_at(model, torch.arange(ROWS * LENGTH), LENGTH) as active:
        assert not active


def test_fallback_reasons():
    from peft import LoraConfig, get_peft_model

    model = _build("qwen2")
    assert last_layer_selection_fallback_reason(model) is None
    # LoRA dropout would draw fewer random numbers on fewer positions: every later draw would change.
    lora = get_peft_model(_build("qwen2"), LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_dropout=0.1))
    assert "dropout" in last_layer_selection_fallback_reason(lora)
    lora.eval()
    assert last_layer_selection_fallback_reason(lora) is None
    hooked = _build("qwen2")
    hooked.model.layers[-1].mlp.register_forward_hook(lambda *a: None)
    assert "hooks" in last_layer_selection_fallback_reason(hooked)
    model.config._attn_implementation = "flash_attention_2"
    assert "attention implementation" in last_layer_selection_fallback_reason(model)
    with last_layer_at(hooked, SELECTED, LENGTH) as active:
        assert not active


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "down_proj"]])
def test_lora_layers_equal_full_layer(targets):
    """LoRA projections (no dropout) are called as the layer calls them: same values, same gradients (LoRA's too)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_build("qwen2", checkpointing="reentrant"), LoraConfig(target_modules=targets, r=4))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # non-zero B, so the adapters change the outputs
            torch.nn.init.normal_(param, std=0.1)
    assert last_layer_selection_fallback_reason(model) is None
    inputs = _inputs("shared_prefix")

    def run(selected):
        model.zero_grad(set_to_none=True)
        with last_layer_at(model, selected, LENGTH) as active:
            hidden = model.base_model.model.model(**inputs, use_cache=False).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1])[SELECTED]
        (picked.square().sum() + picked.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return active, picked.detach(), grads

    _, full, full_grads = run(SELECTED[:0])
    active, picked, grads = run(SELECTED)
    assert active and any("lora" in name for name in grads)
    torch.testing.assert_close(picked, full, rtol=1e-5, atol=1e-6)
    assert grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        _assert_grad_close(grads[name], grad, name)


def test_fused_log_probs_keep_every_hidden_state_when_asked(monkeypatch):
    """`compute_token_logps` selects the scored positions, except when the caller also asks for the hidden states
    (PPO's value head reads them everywhere): then the last layer runs whole."""
    from trl.trainer.utils.logprobs import compute_token_logps

    model = _build("qwen2")
    calls = []
    selected_layer = last_layer_selection._selected_layer
    monkeypatch.setattr(last_layer_selection, "_selected_layer", lambda *a: calls.append(1) or selected_layer(*a))
    ids = _inputs("none")["input_ids"]
    target_mask = torch.zeros(ROWS, LENGTH - 1, dtype=torch.bool)
    target_mask[:, 8:] = True
    plain = compute_token_logps(model, ids, target_mask=target_mask)
    assert calls == [1]
    with_hidden = compute_token_logps(model, ids, target_mask=target_mask, output_hidden_states=True)
    assert calls == [1]
    assert with_hidden.outputs.hidden_states[-1].abs().amin(dim=-1).gt(0).all()
    torch.testing.assert_close(plain.logps, with_hidden.logps, rtol=1e-5, atol=1e-6)
