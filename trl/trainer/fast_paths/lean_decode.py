"""A lean one-token decode step for Llama-style decoders, bitwise equal to the transformers forward it replaces.

One decode step of a small model through the transformers forward spends ~40 % of its time outside the matmuls:
`nn.Module.__call__` machinery, keyword handling, a causal mask built per call, cache bookkeeping, gradient
checkpointing checks and output dataclasses. [`LeanDecoder`] runs the step of the rollout decode loop
(`rollout_decode.decode_rollouts`) directly through the layers instead, calling the same torch ops on the same tensors
in the same order as the modules do:

- the RMSNorms and MLPs through their own `forward` (so a forward swapped in by `lean_modules` while a trainer trains
  is the one used, as in the model), the projections with `F.linear` and the modules' weights and biases;
- the model's own rotary embedding module, once per step, and the modeling file's own `apply_rotary_pos_emb`;
- the attention function transformers registers for the model's attention implementation (SDPA, eager, or the
  project's packed SDPA, which is SDPA outside packed batches), with the mask `create_causal_mask` would build for
  these inputs, built once per rollout and sliced per step;
- keys and values written into the rollout's preallocated cache layers.

[`lean_decode_fallback_reason`] is the single place that says which models qualify (and why not).
"""

import sys
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..._compat import CACHE_KEYWORD, attention_interface, cache_keyword
from ...kernels.packed_attention import PACKED_SDPA
from ..utils.distributed import parameters_sharded
from .tied_embedding_grad import replaced_by_plain_lookup


# Model classes whose decoder layer is the standard Llama one (pre-norm attention with rotary embeddings, pre-norm
# SwiGLU MLP); Qwen3 adds per-head RMSNorms on queries and keys. Matched by exact name and modeling module so that a
# subclass or remote code with other arithmetic never qualifies.
_FAMILIES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
_FAMILIES["Qwen3ForCausalLM"] = "qwen3"
_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", PACKED_SDPA)


def _global_hooks() -> bool:
    """Whether torch's global module hooks (which `__call__` would run and the lean step skips) are registered."""
    from torch.nn.modules import module as torch_module

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called")
    return any(getattr(torch_module, name, None) for name in names)


def _plain_linear(module: Any) -> bool:
    """An unwrapped `nn.Linear` (PEFT / quantized linears are other classes) with dense weights of this process."""
    if type(module) is not nn.Linear or "forward" in vars(module):
        return False
    return all(
        p is None or (type(p) is nn.Parameter and not hasattr(p, "ds_id")) for p in (module.weight, module.bias)
    )


def _own_class(module: Any, name: str, modeling: str) -> bool:
    """`module` is transformers' class `name` from `modeling`, with that class's own forward."""
    cls = type(module)
    return cls.__name__ == name and cls.__module__ == modeling and "forward" not in vars(module)


def lean_decode_fallback_reason(model: nn.Module) -> str | None:
    """Why [`LeanDecoder`] cannot reproduce `model`'s forward bitwise for rollout decoding, or None when it can.

    Qualify: transformers' own Qwen2 / Llama / Mistral / Qwen3 causal LMs with plain `nn.Linear` projections, full
    (not sliding-window) causal attention through SDPA, eager or packed SDPA, no hooks on their inner modules (forward
    hooks on the model itself run around each step, as `__call__` runs them), no sharded parameters, no attention
    dropout in train mode, and no autocast.

    Args:
        model: The unwrapped causal LM.

    Returns:
        A short reason, or None.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    name = type(model).__name__
    family = _FAMILIES.get(name)
    modeling = f"transformers.models.{family}.modeling_{family}"
    if family is None or type(model).__module__ != modeling:
        return f"model class {type(model).__module__}.{name} not one of the Llama-style decoders"
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _ATTENTION_IMPLEMENTATIONS:
        return f"attention implementation {impl!r}"
    expected_mask = eager_mask if impl == "eager" else sdpa_mask
    if ALL_MASK_ATTENTION_FUNCTIONS.get(impl) is not expected_mask:
        return f"mask builder of {impl!r} replaced"
    if not getattr(config, "is_causal", True):
        return "bidirectional attention"
    if getattr(config, "sliding_window", None) is not None and family == "mistral":
        return "sliding-window attention"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window or other non-full attention layers"
    if parameters_sharded(model):
        return "parameters sharded (DeepSpeed ZeRO-3 / FSDP)"
    if getattr(model, "use_kernels", False) or getattr(model, "_use_kernels", False):
        return "hub kernels in use"
    device_type = model.lm_head.weight.device.type if isinstance(model.lm_head, nn.Module) else "cpu"
    if torch.is_autocast_enabled(device_type) or torch.is_autocast_enabled("cpu"):
        return "autocast active"
    if _global_hooks():
        return "global module hooks registered"
    if model._backward_hooks or model._backward_pre_hooks or model._forward_hooks_always_called:
        return f"backward or always-called hooks on {name}"
    # The model's own forward hooks run around every lean step as `__call__` would run them, and the modules the step
    # calls whole (embeddings, rotary embedding, norms, MLPs) are called through `__call__` when they have hooks (such
    # as the one gradient checkpointing puts on the input embeddings); a hook anywhere else would be skipped.
    called = _modules_called_whole(model)
    for module in model.modules():
        hooked = module._forward_hooks or module._forward_pre_hooks
        if hasattr(module, "_hf_hook") or (hooked and module is not model and module not in called):
            return f"hooks on {type(module).__name__}"
    prefix = name[: -len("ForCausalLM")]
    base = getattr(model, "model", None)
    if not _own_class(model, name, modeling) or not _own_class(base, f"{prefix}Model", modeling):
        return "model forward replaced"
    if not _plain_linear(model.lm_head) or type(base.embed_tokens) is not nn.Embedding:
        return "lm_head / embeddings are not plain nn.Linear / nn.Embedding"
    embedding_replaced = "forward" in vars(base.embed_tokens) and not replaced_by_plain_lookup(base.embed_tokens)
    if embedding_replaced or not _own_class(base.rotary_emb, f"{prefix}RotaryEmbedding", modeling):
        return "embedding or rotary embedding forward replaced"
    norm_name = f"{prefix}RMSNorm"
    if type(base.norm).__name__ != norm_name:
        return "final norm is not the model's RMSNorm"
    layers = base.layers[: config.num_hidden_layers]
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not _own_class(layer, f"{prefix}DecoderLayer", modeling) or not _own_class(
            attn, f"{prefix}Attention", modeling
        ):
            return "decoder layer or attention forward replaced"
        if type(mlp).__name__ != f"{prefix}MLP" or type(mlp).__module__ != modeling:
            return f"MLP class {type(mlp).__name__}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if family == "qwen3":
            norms += [attn.q_norm, attn.k_norm]
        elif hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "unexpected query / key norms"
        if any(type(norm).__name__ != norm_name for norm in norms):
            return "norm classes other than the model's RMSNorm"
        if not all(_plain_linear(getattr(attn, key)) for key in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention projections are not plain nn.Linear (PEFT, quantized, ...)"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention"
        if attn.training and attn.attention_dropout > 0:
            return "attention dropout in train mode"
    return None


def _modules_called_whole(model: nn.Module) -> set[nn.Module]:
    """The modules the lean step calls as modules (so their hooks can run): embeddings, rotary embedding, norms, and
    the MLPs with everything inside them."""
    base = model.model
    called = {base.embed_tokens, base.rotary_emb, base.norm}
    for layer in base.layers:
        called.update((layer.input_layernorm, layer.post_attention_layernorm, *layer.mlp.modules()))
        for name in ("q_norm", "k_norm"):
            if hasattr(layer.self_attn, name):
                called.add(getattr(layer.self_attn, name))
    return called


def _hooked(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _entry(module: nn.Module):
    """`module`'s forward without the module-call overhead, or the module itself when it (or a module inside it) has
    hooks that the call must run."""
    return module if _hooked(module) else module.forward


def _mlp_forward(mlp: nn.Module, modeling: str):
    """The MLP's forward without module call overhead: the instance's own when one is swapped in (`lean_modules`),
    else the class's `down(act(gate(x)) * up(x))` with `F.linear` on the projections' weights and biases; the module
    itself when hooks inside it must run."""
    if _hooked(mlp):
        return mlp
    if "forward" in vars(mlp) or type(mlp).forward.__module__ != modeling:
        return mlp.forward
    gate, up, down, act = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(
            act(F.linear(x, gate.weight, gate.bias)) * F.linear(x, up.weight, up.bias), down.weight, down.bias
        )

    return forward


class _LayerPlan:
    """What one decoder layer's step reads, resolved once per rollout (parameters do not change during a rollout)."""

    def __init__(self, layer: nn.Module, modeling: str):
        attn = layer.self_attn
        self.attn = attn
        self.input_norm = _entry(layer.input_layernorm)
        self.post_norm = _entry(layer.post_attention_layernorm)
        self.mlp = _mlp_forward(layer.mlp, modeling)
        self.q = (attn.q_proj.weight, attn.q_proj.bias)
        self.k = (attn.k_proj.weight, attn.k_proj.bias)
        self.v = (attn.v_proj.weight, attn.v_proj.bias)
        self.o = (attn.o_proj.weight, attn.o_proj.bias)
        self.qk_norms = (_entry(attn.q_norm), _entry(attn.k_norm)) if hasattr(attn, "q_norm") else None
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.dropout = 0.0 if not attn.training else attn.attention_dropout


class LeanDecoder:
    """The one-token decode step of a model that [`lean_decode_fallback_reason`] accepts, bitwise equal to
    `model(input_ids, attention_mask, position_ids, cache, logits_to_keep=1).logits` for the rollout loop's inputs.

    Build it once per rollout (it resolves the modules' weights and the rollout's mask up front).

    Args:
        model: The causal LM.
        padding_mask: `(N, capacity)` 0/1 mask of the whole rollout (prompt left padding, then ones), or None when
            nothing is padded (the loop then passes no mask to the model either).
        num_rows: `N`.
        capacity: Prompt length plus the most new tokens.
    """

    def __init__(self, model: nn.Module, padding_mask: torch.Tensor | None, num_rows: int, capacity: int):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.model = model
        self.padding_mask = padding_mask
        base = model.model
        modeling = type(model).__module__
        self.embed = _entry(base.embed_tokens)
        self.rotary = base.rotary_emb
        self.final_norm = _entry(base.norm)
        self.head = (model.lm_head.weight, model.lm_head.bias)
        self.layers = [_LayerPlan(layer, modeling) for layer in base.layers[: model.config.num_hidden_layers]]
        self.apply_rotary = sys.modules[modeling].apply_rotary_pos_emb
        impl = model.config._attn_implementation
        default = sdpa_attention_forward if impl != "eager" else sys.modules[modeling].eager_attention_forward
        self.attention = attention_interface(impl, default)
        # The mask `create_causal_mask` builds for one query at the last position: the padding mask itself (causality
        # masks nothing); SDPA gets None when nothing is padded, eager an additive float mask always.
        self.mask = None
        weight = base.embed_tokens.weight
        if impl == "eager":
            if padding_mask is None:
                padding_mask = torch.ones((num_rows, capacity), dtype=torch.bool, device=weight.device)
            keep = padding_mask.bool()[:, None, None, :]
            zero = torch.zeros((), dtype=weight.dtype, device=keep.device)
            self.mask = torch.where(keep, zero, torch.finfo(weight.dtype).min)
        elif padding_mask is not None and not bool(padding_mask.bool().all()):
            self.mask = padding_mask.bool()[:, None, None, :]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any, length: int) -> torch.Tensor:
        """Logits `(N, 1, vocab)` of the next token.

        Args:
            input_ids: `(N, 1)` the last sampled tokens.
            position_ids: `(N, 1)` their positions.
            cache: The rollout's `DynamicCache` with preallocated layers; the new keys and values are appended.
            length: Number of positions attended to after this step (cached ones plus this one).
        """
        model = self.model
        if not (model._forward_pre_hooks or model._forward_hooks):
            return self._step(input_ids, position_ids, cache, length)
        # What the rollout loop would pass to `model(...)`: the model's hooks see (and may change) exactly that.
        kwargs = {
            "input_ids": input_ids,
            "attention_mask": None if self.padding_mask is None else self.padding_mask[:, :length],
            "position_ids": position_ids,
            cache_keyword(model): cache,
            "use_cache": True,
            "logits_to_keep": 1,
            "return_dict": True,
        }
        return _call_with_model_hooks(model, kwargs, lambda: self._step(input_ids, position_ids, cache, length))

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any, length: int) -> torch.Tensor:
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)
        mask = None if self.mask is None else self.mask[..., :length]
        for plan, cache_layer in zip(self.layers, cache.layers):
            residual = hidden
            hidden = plan.input_norm(hidden)
            hidden = residual + self._attention(plan, hidden, cos, sin, mask, cache_layer)
            residual = hidden
            hidden = plan.post_norm(hidden)
            hidden = residual + plan.mlp(hidden)
        hidden = self.final_norm(hidden)[:, -1:, :]
        return F.linear(hidden, *self.head)

    def _attention(self, plan: _LayerPlan, hidden, cos, sin, mask, cache_layer) -> torch.Tensor:
        """The attention block's forward (the model's arithmetic, without its call overhead)."""
        input_shape = hidden.shape[:-1]
        hidden_shape = (*input_shape, -1, plan.head_dim)
        query = F.linear(hidden, *plan.q).view(hidden_shape)
        key = F.linear(hidden, *plan.k).view(hidden_shape)
        if plan.qk_norms is not None:
            query, key = plan.qk_norms[0](query), plan.qk_norms[1](key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = F.linear(hidden, *plan.v).view(hidden_shape).transpose(1, 2)
        query, key = self.apply_rotary(query, key, cos, sin)
        key, value = cache_layer.update(key, value)
        output, _ = self.attention(
            plan.attn, query, key, value, mask, dropout=plan.dropout, scaling=plan.scaling, sliding_window=None
        )
        output = output.reshape(*input_shape, -1).contiguous()
        return F.linear(output, *plan.o)


def _call_with_model_hooks(model: nn.Module, kwargs: dict[str, Any], lean_step: Any) -> torch.Tensor:
    """The logits of `model(**kwargs)` as `nn.Module.__call__` would produce them: the model's forward pre-hooks, then
    the lean step (or, when a pre-hook changed the inputs, the model's forward on the changed inputs), then its
    forward hooks, each with the arguments `__call__` gives it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    args: tuple = ()
    changed = False
    for hook_id, hook in list(model._forward_pre_hooks.items()):
        if hook_id in model._forward_pre_hooks_with_kwargs:
            result = hook(model, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), but got {result}."
                    )
                (args, kwargs), changed = result, True
        else:
            result = hook(model, args)
            if result is not None:
                args, changed = (result if isinstance(result, tuple) else (result,)), True
    if changed:
        output = model.forward(*args, **kwargs)
    else:
        output = CausalLMOutputWithPast(logits=lean_step(), **{CACHE_KEYWORD: kwargs[cache_keyword(model)]})
    for hook_id, hook in list(model._forward_hooks.items()):
        if hook_id in model._forward_hooks_with_kwargs:
            result = hook(model, args, kwargs, output)
        else:
            result = hook(model, args, output)
        if result is not None:
            output = result
    return output.logits
