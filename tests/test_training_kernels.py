"""The kernels trainers put in place while training: packed-sequence SDPA, the memory-lean SwiGLU MLP and RMSNorm.

Each equals what it stands in for (values and gradients), applies only where it is safe, and leaves the model as it
was (classes, state-dict keys, attention implementation) once training is over."""

import contextlib
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from trl import SFTConfig, SFTTrainer
from trl.kernels.decoder_layers import rms_norm, swiglu_mlp
from trl.kernels.packed_attention import PACKED_SDPA
from trl.trainer.fast_paths.lean_modules import lean_module_kernel, lean_modules
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from trl.trainer.utils.packing import packed_sdpa_applicable, packed_sdpa_attention, plain_sdpa_attention


pytestmark = pytest.mark.usefixtures("single_thread")


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close_dicts(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}")


def _packed_batch(lengths, pad_to_multiple_of=None):
    torch.manual_seed(0)
    examples = [{"input_ids": torch.randint(0, 100, (n,)).tolist()} for n in lengths]
    collator = DataCollatorForLanguageModeling(
        pad_token_id=0, padding_free=True, pad_to_multiple_of=pad_to_multiple_of
    )
    return collator(examples)


@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
def test_packed_sdpa_equals_block_diagonal_sdpa(tiny_qwen_path, pad_to_multiple_of):
    batch = _packed_batch([7, 1, 12, 5], pad_to_multiple_of)
    labels = batch.pop("labels")
    results = {}
    for name in ("sdpa", PACKED_SDPA):
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path, attn_implementation="sdpa")
        with packed_sdpa_attention(model) if name == PACKED_SDPA else torch.enable_grad():
            assert model.config._attn_implementation == name
            out = model(**batch, labels=labels, use_cache=False)
            out.loss.backward()
        assert model.config._attn_implementation == "sdpa"
        results[name] = (out.logits.detach(), _grads(model))
    torch.testing.assert_close(results["sdpa"][0], results[PACKED_SDPA][0], rtol=1e-5, atol=1e-5)
    _assert_close_dicts(results["sdpa"][1], results[PACKED_SDPA][1])


def test_packed_sdpa_matches_separate_sequences(tiny_qwen_path):
    batch = _packed_batch([6, 9])
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path, attn_implementation="sdpa")
    with torch.no_grad(), packed_sdpa_attention(model):
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                       cu_seq_lens_q=batch["cu_seq_lens_q"], cu_seq_lens_k=batch["cu_seq_lens_k"]).logits  # fmt: skip
        ids = batch["input_ids"]
        separate = torch.cat([model(input_ids=ids[:, :6]).logits, model(input_ids=ids[:, 6:]).logits], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)


def test_packed_sdpa_falls_back_to_sdpa_on_padded_batches(tiny_qwen_path):
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path, attn_implementation="sdpa")
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        with packed_sdpa_attention(model):
            got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected)


def test_packed_sdpa_applies_to_sdpa_text_models_only(tiny_qwen_path):
    assert packed_sdpa_applicable(AutoModelForCausalLM.from_pretrained(tiny_qwen_path, attn_implementation="sdpa"))
    eager = AutoModelForCausalLM.from_pretrained(tiny_qwen_path, attn_implementation="eager")
    assert not packed_sdpa_applicable(eager)
    with packed_sdpa_attention(eager):
        assert eager.config._attn_implementation == "eager"
    assert not packed_sdpa_applicable(nn.Linear(2, 2))


def test_plain_sdpa_inside_packed_sdpa_for_transformers_only_names(tiny_qwen_path):
    """Continuous batching accepts transformers' implementation names only: the packed kernel steps aside for it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path, attn_implementation="sdpa")
    with packed_sdpa_attention(model):
        assert model.config._attn_implementation == PACKED_SDPA
        with plain_sdpa_attention(model):
            assert model.config._attn_implementation == "sdpa"
        assert model.config._attn_implementation == PACKED_SDPA
    with plain_sdpa_attention(model):  # nothing to switch
        assert model.config._attn_implementation == "sdpa"


def _mlp_weights(hidden=16, inter=24, dtype=torch.float32):
    torch.manual_seed(1)
    return [
        torch.randn(s, dtype=dtype, requires_grad=True) for s in ((inter, hidden), (inter, hidden), (hidden, inter))
    ]


def _reference_mlp(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _reference_rms_norm(x, weight, eps):
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("kernel", ["mlp", "norm"])
def test_kernels_equal_plain_autograd_with_padding_and_accumulation(kernel):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)  # a padded batch: loss on real tokens
    inputs = [torch.randn(2, 5, 16) for _ in range(2)]  # two micro-batches, gradients accumulated
    params = _mlp_weights() if kernel == "mlp" else [torch.rand(16, requires_grad=True)]
    grads = {}
    for name in ("plain", "kernel"):
        for p in params:
            p.grad = None
        outputs = []
        for x in inputs:
            x = x.clone().requires_grad_(True)
            if kernel == "mlp":
                y = swiglu_mlp(x, *params) if name == "kernel" else _reference_mlp(x, *params)
            else:
                y = rms_norm(x, params[0], 1e-6) if name == "kernel" else _reference_rms_norm(x, params[0], 1e-6)
            (y[mask] ** 2).sum().backward()
            outputs.append((y.detach(), x.grad))
        grads[name] = (outputs, [p.grad.clone() for p in params])
    for (y_a, gx_a), (y_b, gx_b) in zip(grads["plain"][0], grads["kernel"][0]):
        torch.testing.assert_close(y_a, y_b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx_a, gx_b, rtol=1e-5, atol=1e-5)
    for g_a, g_b in zip(grads["plain"][1], grads["kernel"][1]):
        torch.testing.assert_close(g_a, g_b, rtol=1e-5, atol=1e-5)


def test_kernels_gradcheck():
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    weights = _mlp_weights(8, 12, torch.float64)
    assert torch.autograd.gradcheck(swiglu_mlp, (x, *weights))
    weight = torch.rand(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-6), (x, weight))


def test_rms_norm_bfloat16_matches_module_formula():
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.rand(8, dtype=torch.bfloat16, requires_grad=True)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), _reference_rms_norm(x, weight, 1e-6))


def test_lean_module_predicate(tiny_qwen_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path)
    layer = model.model.layers[0]
    assert lean_module_kernel(layer.mlp) is not None
    assert lean_module_kernel(layer.input_layernorm) is not None
    assert lean_module_kernel(layer.self_attn) is None
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(model, peft.LoraConfig(target_modules=["gate_proj", "q_proj"], r=2))
    mlp = lora.base_model.model.model.layers[0].mlp
    assert lean_module_kernel(mlp) is None  # LoRA-wrapped projection: the stock module runs
    assert lean_module_kernel(lora.base_model.model.model.layers[0].post_attention_layernorm) is not None


@pytest.mark.parametrize(
    "settings", [dict(gradient_checkpointing=True), dict(gradient_checkpointing=False, fsdp="full_shard")]
)
def test_lean_modules_off_with_checkpointing_or_sharding(tiny_qwen_path, settings):
    args = SFTConfig("out", **settings)  # transformers 4.x exports FSDP settings to os.environ: conftest restores it
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path)
    with lean_modules(model, args) as switched:
        assert switched == 0
        assert not any("forward" in vars(m) for m in model.modules())


def test_lean_modules_leave_model_and_state_dict_unchanged(tiny_qwen_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path)
    keys, classes = list(model.state_dict()), [type(m) for m in model.modules()]
    ids = torch.randint(0, 100, (2, 9))
    expected = model(input_ids=ids, labels=ids)
    expected.loss.backward()
    expected_grads = _grads(model)
    model.zero_grad()
    with lean_modules(model) as switched:
        assert switched == 2 * model.config.num_hidden_layers + model.config.num_hidden_layers + 1
        with lean_modules(model) as inner:
            assert inner == 0
        assert list(model.state_dict()) == keys
        got = model(input_ids=ids, labels=ids)
        got.loss.backward()
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-6)
    _assert_close_dicts(_grads(model), expected_grads)
    assert [type(m) for m in model.modules()] == classes
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_sft_packed_training_with_kernels_equals_without(tiny_qwen_path, tmp_path, gradient_checkpointing):
    texts = [" ".join(f"w{i * j % 37}" for j in range(3 + (i * 7) % 40)) for i in range(24)]
    dataset = Dataset.from_dict({"text": texts})
    losses, models = {}, {}
    for name in ("kernels", "stock"):
        args = SFTConfig(
            str(tmp_path / name), max_steps=3, per_device_train_batch_size=4, packing=True, max_length=64,
            logging_steps=1, report_to="none", save_strategy="no", seed=0, bf16=False,
            gradient_checkpointing=gradient_checkpointing, learning_rate=1e-3,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path, attn_implementation="sdpa")
        trainer = SFTTrainer(model, args=args, train_dataset=dataset)
        if name == "stock":
            trainer._training_kernels = lambda: torch.enable_grad()
        trainer.train()
        losses[name] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        models[name] = trainer.model
        assert trainer.model.config._attn_implementation == "sdpa"
        assert not any("forward" in vars(m) for m in trainer.model.modules())
    assert losses["kernels"] == pytest.approx(losses["stock"], rel=1e-5)
    # AdamW moves an element whose gradient is float noise by a noise-dependent fraction of lr (1e-3): 1e-5 absolute.
    _assert_close_dicts(
        dict(models["kernels"].named_parameters()), dict(models["stock"].named_parameters()), atol=1e-5
    )
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert list(reloaded.state_dict()) == list(models["stock"].state_dict())
    assert type(reloaded.model.layers[0].mlp) is type(models["stock"].model.layers[0].mlp)


@pytest.mark.parametrize("groups", [1, 4])
def test_packed_continuations_attend_to_their_own_prefix(groups):
    """`attend_after_prefixes`: each packed continuation equals SDPA over its prefix and itself (causal), for
    grouped-query attention too; empty continuations and an empty prefix included."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from trl.kernels.packed_attention import attend_after_prefixes, packed_sdpa_attention_forward

    torch.manual_seed(0)
    kv_heads, dim, prefix_lengths, own = 2, 8, [3, 5, 0, 2], [4, 0, 3, 1]
    module = nn.Module()
    module.layer_idx, module.num_key_value_groups, module.is_causal = 0, groups, True
    prefix_k = torch.randn(4, kv_heads, 5, dim)
    prefix_v = torch.randn(4, kv_heads, 5, dim)
    total = sum(own)
    query = torch.randn(1, kv_heads * groups, total, dim)
    key, value = torch.randn(1, kv_heads, total, dim), torch.randn(1, kv_heads, total, dim)
    bounds = [0, 4, 4, 7, 8]
    with attend_after_prefixes({0: (prefix_k, prefix_v)}, prefix_lengths, bounds):
        out, _ = packed_sdpa_attention_forward(module, query, key, value, attention_mask=None)
    assert out.shape == (1, total, kv_heads * groups, dim)
    with attend_after_prefixes({0: (prefix_k, prefix_v)}, prefix_lengths, bounds):
        with pytest.raises(RuntimeError, match="one packed row of 8 tokens"):
            packed_sdpa_attention_forward(module, query[:, :, :5], key[:, :, :5], value[:, :, :5], None)
    for row, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        past = prefix_lengths[row]
        # The whole sequence (prefix + continuation) through causal SDPA; its last `own` queries are the ones packed.
        keys = repeat_kv(torch.cat([prefix_k[row : row + 1, :, :past], key[:, :, start:end]], dim=2), groups)
        values = repeat_kv(torch.cat([prefix_v[row : row + 1, :, :past], value[:, :, start:end]], dim=2), groups)
        queries = torch.cat([torch.zeros(1, kv_heads * groups, past, dim), query[:, :, start:end]], dim=2)
        expected = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)[:, :, past:]
        torch.testing.assert_close(out[:, start:end], expected.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_single_packed_row_carries_its_sequence_boundaries(tiny_qwen_path, monkeypatch):
    """A padding-free row gets `cu_seq_lens_*` from its positions, so the packed SDPA function attends per sequence
    (instead of a dense block-diagonal mask over the row); values equal the padded layout's."""
    from trl.kernels import packed_attention
    from trl.trainer.utils.packing import compute_sequence_token_logps, sequence_boundaries

    boundaries = sequence_boundaries(torch.tensor([[0, 1, 2, 0, 1, 0, 0]]))
    assert boundaries["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 7]
    assert boundaries["cu_seq_lens_q"].dtype == torch.int32
    assert boundaries["max_length_q"] == boundaries["max_length_k"] == 3

    torch.manual_seed(0)
    lengths = [9, 4, 12]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, 100, (n,))
        mask[row, :n] = 1
    target = mask[:, 1:].bool()
    seen = []
    original = packed_attention._sequence_bounds
    monkeypatch.setattr(packed_attention, "_sequence_bounds", lambda *a: seen.append(original(*a)) or seen[-1])
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path, attn_implementation="sdpa")
    with torch.no_grad():
        padded = compute_sequence_token_logps(model, ids, mask, target, layout="padded")
        with packed_sdpa_attention(model):
            single_row = compute_sequence_token_logps(model, ids, mask, target, layout="padding_free")
    # Every layer but the last sees the boundaries (the last one, run only at the scored positions by the last-layer
    # selection, attends with the gathered dense mask instead).
    assert seen[:-1] and all(bounds == [0, 9, 13, 25] for bounds in seen[:-1])
    torch.testing.assert_close(single_row.logps, padded.logps, rtol=1e-5, atol=1e-5)


def test_swiglu_backward_keeps_at_most_four_intermediate_tensors_and_can_run_twice():
    """The backward pass holds the saved gate and up projections and at most two more `tokens x intermediate`
    temporaries at once; it leaves the saved projections intact, so a graph kept with `retain_graph` gives the same
    gradients again."""
    tokens, hidden, inter = 7, 16, 24
    weights = _mlp_weights(hidden, inter)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    live, most = {}, [0]

    class CountIntermediates(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.numel() == tokens * inter:
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() not in live:
                        live[storage.data_ptr()] = True
                        weakref.finalize(storage, live.pop, storage.data_ptr(), None)
            most[0] = max(most[0], len(live))
            return out

    with CountIntermediates():
        output = swiglu_mlp(x, *weights)
        output.backward(torch.ones_like(output), retain_graph=True)
    first = [x.grad.clone()] + [w.grad.clone() for w in weights]
    assert most[0] <= 4, f"{most[0]} tokens x intermediate tensors were live at once"
    for tensor in [x, *weights]:
        tensor.grad = None
    output.backward(torch.ones_like(output))
    for a, b in zip(first, [x.grad] + [w.grad for w in weights]):
        assert torch.equal(a, b)


def test_swiglu_gradients_are_plain_autograds_with_or_without_the_output():
    """The kernel's backward runs plain autograd's operations on the same values: bitwise the same gradients. A
    checkpointed layer's recompute reads none of the MLP's output: with `output_unused=True` the kernel skips the
    activation and the down product, returns zeros, and back-propagates the same."""
    torch.manual_seed(0)
    weights = _mlp_weights()
    x = torch.randn(2, 5, 16)
    grad_output = torch.randn(2, 5, 16)
    grads = {}
    for name in ("plain", "kernel", "output_unused"):
        for weight in weights:
            weight.grad = None
        inputs = x.clone().requires_grad_(True)
        if name == "plain":
            output = _reference_mlp(inputs, *weights)
        else:
            output = swiglu_mlp(inputs, *weights, output_unused=name == "output_unused")
        if name == "output_unused":
            assert output.shape == (2, 5, 16) and not output.any()
        else:
            grads[f"{name}_output"] = [output.detach()]
        output.backward(grad_output)
        grads[name] = [inputs.grad] + [weight.grad.clone() for weight in weights]
    assert torch.equal(grads["plain_output"][0], grads["kernel_output"][0])
    for plain, kernel, unused in zip(grads["plain"], grads["kernel"], grads["output_unused"]):
        assert torch.equal(plain, kernel) and torch.equal(kernel, unused)


class _CountBlockTemporaries(TorchDispatchMode):
    """Counts the live `rows x inter` tensors made inside the block (weights and their gradients, `(hidden, inter)`,
    excluded), the most at once, and asserts none has more than `max_rows` rows."""

    def __init__(self, hidden: int, inter: int, max_rows: int):
        super().__init__()
        self.hidden, self.inter, self.max_rows = hidden, inter, max_rows
        self.live: set[int] = set()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if not (isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == self.inter):
                continue
            if tensor.shape[-2] == self.hidden:
                continue
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in self.live:
                self.live.add(pointer)
                weakref.finalize(tensor.untyped_storage(), self.live.discard, pointer)
                assert tensor.numel() <= self.max_rows * self.inter, f"{func} made {tuple(tensor.shape)}"
        self.most = max(self.most, len(self.live))
        return out


@pytest.mark.parametrize("needs", ["all", "weights_only", "input_only"])
def test_swiglu_recompute_in_blocks_equals_plain_autograd(monkeypatch, needs):
    """With its output unused, the kernel computes the projections in the backward pass, a block of rows at a time:
    over several blocks (the last one partial) the gradients equal plain autograd's to float rounding, and no more
    than four `block x intermediate` temporaries (none of all the rows) are live at once."""
    import trl.kernels.decoder_layers as decoder_layers

    tokens, hidden, inter, block = 23, 16, 24, 8  # blocks of 8, 8 and 7 rows
    monkeypatch.setattr(decoder_layers, "_MIN_BLOCK_ROWS", block)
    monkeypatch.setattr(decoder_layers, "_RECOMPUTE_BLOCK_BYTES", block * inter * 4)
    torch.manual_seed(0)
    weights = _mlp_weights(hidden, inter)
    x = torch.randn(1, tokens, hidden)
    grad_output = torch.randn(1, tokens, hidden)
    input_grad, weight_grad = needs != "weights_only", needs != "input_only"
    results = {}
    for name in ("plain", "blocks"):
        params = [w.detach().clone().requires_grad_(weight_grad) for w in weights]
        inputs = x.clone().requires_grad_(input_grad)
        if name == "plain":
            _reference_mlp(inputs, *params).backward(grad_output)
        else:
            counter = _CountBlockTemporaries(hidden, inter, max_rows=block)
            with counter:
                output = swiglu_mlp(inputs, *params, output_unused=True)
                assert not output.any()
                output.backward(grad_output)
            assert counter.most <= 4, f"{counter.most} block x intermediate tensors were live at once"
        results[name] = [t.grad for t in (inputs, *params) if t.requires_grad]
    assert len(results["plain"]) == len(results["blocks"]) == (input_grad + 3 * weight_grad)
    for plain, blocks in zip(results["plain"], results["blocks"]):  # float32 rounding of sums in another order
        torch.testing.assert_close(blocks, plain, rtol=1e-5, atol=1e-6 * plain.abs().max().item())


def test_swiglu_under_autocast_runs_the_plain_expression():
    """Under autocast (bf16 mixed precision with float32 weights, the GPU default) the projections are bf16 casts of
    float32 operands, which plain autograd replays in the backward pass: the kernel runs the plain expression itself,
    with the same values and gradients, and leaves the float32 weights' gradients float32."""
    torch.manual_seed(0)
    weights = _mlp_weights()
    x = torch.randn(2, 5, 16)
    results = {}
    for name in ("plain", "kernel"):
        for weight in weights:
            weight.grad = None
        inputs = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = _reference_mlp(inputs, *weights) if name == "plain" else swiglu_mlp(inputs, *weights)
        assert output.dtype == torch.bfloat16
        output.float().pow(2).sum().backward()
        results[name] = [output.detach(), inputs.grad] + [weight.grad for weight in weights]
    for plain, kernel in zip(results["plain"], results["kernel"]):
        assert torch.equal(plain, kernel)
    assert all(weight.grad.dtype == torch.float32 for weight in weights)


def test_sft_trains_in_bf16_mixed_precision_without_checkpointing(tiny_qwen_path, tmp_path):
    """bf16 mixed precision (on the CPU here, the default on a GPU) with the lean modules in place: no dtype clash in
    the MLP kernel's backward pass, and the model trains."""
    dataset = Dataset.from_dict(
        {"text": [f"The number {i} comes after {i - 1} and before {i + 1}." for i in range(8)]}
    )
    args = SFTConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none", bf16=True,
        use_cpu=True, gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = SFTTrainer(tiny_qwen_path, args=args, train_dataset=dataset)
    assert trainer.accelerator.native_amp
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    assert torch.isfinite(torch.tensor(trainer.train().training_loss))
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


def test_swiglu_without_gradients_holds_two_intermediate_tensors():
    """Without gradients the kernel computes the activation and the product in place: bitwise the plain
    expression's output, with at most two `tokens x intermediate` tensors live at once (the plain one holds three)."""
    tokens, hidden, inter = 9, 16, 24
    weights = _mlp_weights(hidden, inter)
    x = torch.randn(2, tokens, hidden)
    counts = {}
    for name, run in (("plain", lambda: _reference_mlp(x, *weights)), ("kernel", lambda: swiglu_mlp(x, *weights))):
        with torch.no_grad(), _CountBlockTemporaries(hidden, inter, max_rows=2 * tokens) as counter:
            output = run()
        counts[name] = (output, counter.most)
    assert torch.equal(counts["plain"][0], counts["kernel"][0])
    assert counts["plain"][1] == 3 and counts["kernel"][1] == 2


def test_mlps_without_grad_switches_plain_unhooked_mlps_and_restores_them(tiny_qwen_path):
    """Reference passes run the model's MLPs through the in-place kernel: the same logits, a hooked MLP keeps its own
    forward (and its hook runs), and every forward is the class's again afterwards."""
    from trl.trainer.fast_paths.lean_modules import mlps_without_grad

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    calls = []
    hooked = model.model.layers[0].mlp
    hooked.register_forward_hook(lambda module, args, output: calls.append(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with mlps_without_grad(model) as switched:
            assert switched == model.config.num_hidden_layers - 1
            assert "forward" not in vars(hooked)
            logits = model(input_ids=ids).logits
    assert torch.equal(logits, expected)
    assert len(calls) == 2
    assert not any("forward" in vars(module) for module in model.modules())


@pytest.mark.parametrize("prefixed", [False, True])
def test_packed_attention_without_gradients_uses_grouped_queries_with_the_same_outputs(prefixed, monkeypatch):
    """Passes without gradients (a reference's, a checkpointed layer's first forward) attend with SDPA's grouped-query
    mode instead of repeating keys and values per query head: bitwise the same outputs. With gradients the keys and
    values are repeated as before."""
    from transformers.integrations import sdpa_attention

    from trl.kernels import packed_attention
    from trl.kernels.packed_attention import attend_after_prefixes, packed_sdpa_attention_forward

    assert packed_attention._grouped_query_matches_expanded()
    generator = torch.Generator().manual_seed(0)
    module = nn.Module()
    module.layer_idx, module.num_key_value_groups, module.is_causal = 0, 4, True
    bounds = [0, 5, 9, 21]
    query = torch.randn(1, 8, 21, 16, generator=generator)
    key, value = torch.randn(2, 1, 2, 21, 16, generator=generator)
    prefixes = {0: tuple(torch.randn(2, 3, 2, 6, 16, generator=generator))}
    kwargs = {} if prefixed else {"cu_seq_lens_q": torch.tensor(bounds), "cu_seq_lens_k": torch.tensor(bounds)}
    repeats = []
    original_repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: repeats.append(1) or original_repeat(*a))

    def attend(q, k, v):
        context = attend_after_prefixes(prefixes, [6, 2, 4], bounds) if prefixed else contextlib.nullcontext()
        with context:
            return packed_sdpa_attention_forward(module, q, k, v, attention_mask=None, **kwargs)[0]

    with torch.no_grad():
        grouped = attend(query, key, value)
    assert not repeats
    repeated = attend(query.requires_grad_(), key, value)
    assert repeats
    assert torch.equal(grouped, repeated.detach())
