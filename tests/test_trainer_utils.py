"""Tests for the shared helpers of trl.trainer.utils and trl.extras.profiling."""

import asyncio
import functools
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

from trl._compat import is_activation_checkpointing
from trl.extras.profiling import ProfilingContext, profiling_context, profiling_decorator
from trl.trainer.utils import (
    RepeatSampler,
    _log_softmax_stats,
    compute_flops_per_token,
    compute_mfu,
    create_model_from_path,
    disable_dropout_in_model,
    ensure_master_addr_port,
    entropy_from_logits,
    flush_left,
    flush_right,
    generate_model_card,
    get_callable_name,
    get_config_model_id,
    get_kbit_device_map,
    get_peak_flops,
    get_peft_config,
    get_quantization_config,
    hash_module,
    identity,
    is_async_callable,
    nanmax,
    nanmin,
    nanstd,
    pad,
    prepare_peft_model,
    print_prompt_completions_sample,
    remove_none_values,
    repeat_iterable_dataset,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
    shuffle_sequence_dict,
    split_tensor_dict,
    use_adapter,
)


def tiny_config(**kwargs):
    defaults = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    defaults.update(kwargs)
    return Qwen2Config(**defaults)


def tiny_model(**kwargs):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_config(**kwargs))


def naive_logps(logits, index, temperature=1.0):
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_probs.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits):
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


# ---------------------------------------------------------------------------------------------------------------------
# selective_log_softmax / entropy
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 5, 11), (7, 3), (2, 3, 4, 13), (9,), (1, 1, 50)])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
def test_selective_log_softmax_matches_log_softmax_gather(shape, temperature):
    torch.manual_seed(sum(shape))
    logits = torch.randn(*shape) * 4
    index = torch.randint(0, shape[-1], shape[:-1])
    out = selective_log_softmax(logits, index, temperature=temperature)
    assert out.shape == index.shape
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_logps(logits, index, temperature), atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_rows", [1, 2, 3, 7, 1000])
def test_chunking_does_not_change_results(max_rows):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17)
    index = torch.randint(0, 17, (3, 5))
    logps, entropy = _log_softmax_stats(logits, index, 1.3, None, max_rows, want_logps=True, want_entropy=True)
    torch.testing.assert_close(logps.double(), naive_logps(logits, index, 1.3), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), naive_entropy(logits / 1.3), atol=1e-5, rtol=0)


def test_selective_log_softmax_row_mask_skips_rows():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 10)
    index = torch.randint(0, 10, (3, 4))
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    out = selective_log_softmax(logits, index, temperature=0.5, row_mask=mask)
    expected = torch.where(mask, naive_logps(logits, index, 0.5), torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    assert (out[~mask] == 0).all()

    # One flag per sequence broadcasts over the positions.
    per_sequence = torch.tensor([True, False, True])
    out = selective_log_softmax(logits, index, row_mask=per_sequence)
    assert (out[1] == 0).all()
    torch.testing.assert_close(out[[0, 2]].double(), naive_logps(logits, index)[[0, 2]], atol=1e-5, rtol=0)


def test_selective_log_softmax_row_mask_skips_nan_rows():
    # Skipped rows are never read: garbage there cannot leak into the result.
    logits = torch.randn(2, 6)
    logits[1] = float("nan")
    index = torch.tensor([2, 3])
    out = selective_log_softmax(logits, index, row_mask=torch.tensor([True, False]))
    assert out[1] == 0
    assert torch.isclose(out[0].double(), naive_logps(logits[:1], index[:1])[0], atol=1e-6)


def test_selective_log_softmax_non_contiguous_input():
    torch.manual_seed(2)
    full = torch.randn(3, 8, 20)
    logits = full[:, :-1]  # the usual "drop last position" slice
    assert not logits.is_contiguous()
    index = torch.randint(0, 20, (3, 7))
    torch.testing.assert_close(
        selective_log_softmax(logits, index).double(), naive_logps(logits, index), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_selective_log_softmax_half_precision_close_to_fp32(dtype):
    torch.manual_seed(3)
    logits = (torch.randn(4, 6, 300) * 3).to(dtype)
    index = torch.randint(0, 300, (4, 6))
    out = selective_log_softmax(logits, index)
    assert out.dtype == dtype
    # The reference uses the same (rounded) logits: the only error left is the final rounding of the output.
    reference = naive_logps(logits.float(), index)
    torch.testing.assert_close(out.double(), reference, atol=0.05, rtol=0.01)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_selective_log_softmax_gradients_match_autograd(temperature):
    torch.manual_seed(4)
    base = torch.randn(2, 6, 15)
    index = torch.randint(0, 15, (2, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    weights = torch.randn(2, 5)

    ours = base.clone().requires_grad_(True)
    (selective_log_softmax(ours[:, :-1], index, temperature, row_mask=mask) * weights).sum().backward()

    reference = base.clone().requires_grad_(True)
    ref_out = torch.log_softmax(reference[:, :-1] / temperature, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    (ref_out * weights * mask).sum().backward()
    torch.testing.assert_close(ours.grad, reference.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("want", [(True, False), (False, True), (True, True)])
def test_log_softmax_stats_gradcheck(want):
    torch.manual_seed(5)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 7, (2, 3))
    mask = torch.tensor([[True, False, True], [True, True, False]])
    for row_mask in (None, mask):
        assert torch.autograd.gradcheck(
            lambda x, m=row_mask: _log_softmax_stats(x, index, 0.8, m, 2, *want), (logits,)
        )


def test_selective_log_softmax_validates_shapes():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="row_mask"):
        selective_log_softmax(logits, torch.zeros(2, 3, dtype=torch.long), row_mask=torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("chunk_size", [1, 4, 128])
def test_entropy_from_logits_matches_formula(chunk_size):
    torch.manual_seed(6)
    logits = torch.randn(3, 9, 21) * 2
    entropy = entropy_from_logits(logits, chunk_size=chunk_size)
    assert entropy.shape == (3, 9)
    # H = -sum_j p_j log p_j, written out by hand
    probs = torch.exp(logits.double()) / torch.exp(logits.double()).sum(-1, keepdim=True)
    expected = -(probs * torch.log(probs)).sum(-1)
    torch.testing.assert_close(entropy.double(), expected, atol=1e-5, rtol=0)


def test_entropy_known_values_and_masked_vocabulary():
    uniform = torch.zeros(1, 8)
    assert torch.isclose(entropy_from_logits(uniform), torch.tensor([torch.log(torch.tensor(8.0))])).all()
    # -inf logits (banned tokens) contribute nothing and must not produce NaN.
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    entropy = entropy_from_logits(logits)
    assert torch.isclose(entropy, torch.tensor([torch.log(torch.tensor(2.0))])).all()


def test_selective_log_softmax_and_entropy_agrees_with_separate_calls():
    torch.manual_seed(7)
    logits = torch.randn(2, 4, 30)
    index = torch.randint(0, 30, (2, 4))
    logps, entropy = selective_log_softmax_and_entropy(logits, index, temperature=0.9)
    torch.testing.assert_close(logps, selective_log_softmax(logits, index, temperature=0.9))
    torch.testing.assert_close(entropy, entropy_from_logits(logits / 0.9))


# ---------------------------------------------------------------------------------------------------------------------
# pad / flush
# ---------------------------------------------------------------------------------------------------------------------


def test_pad_right_left_and_multiple():
    tensors = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    assert pad(tensors).tolist() == [[1, 2, 3], [4, 5, 0]]
    assert pad(tensors, padding_side="left").tolist() == [[1, 2, 3], [0, 4, 5]]
    assert pad(tensors, padding_value=-1, pad_to_multiple_of=4).tolist() == [[1, 2, 3, -1], [4, 5, -1, -1]]
    assert pad(tensors, padding_side="left", pad_to_multiple_of=4).tolist() == [[0, 1, 2, 3], [0, 0, 4, 5]]


def test_pad_two_dimensional():
    tensors = [torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5, 6, 7]])]
    out = pad(tensors, padding_value=0)
    assert out.shape == (2, 2, 3)
    assert out.tolist() == [[[1, 2, 0], [3, 4, 0]], [[5, 6, 7], [0, 0, 0]]]
    out = pad(tensors, padding_side="left")
    assert out.tolist() == [[[0, 1, 2], [0, 3, 4]], [[0, 0, 0], [5, 6, 7]]]


def test_pad_errors():
    with pytest.raises(ValueError):
        pad([])
    with pytest.raises(ValueError, match="padding_side"):
        pad([torch.tensor([1])], padding_side="middle")


def test_flush_left_exact():
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    ids = torch.tensor([[0, 0, 2, 3, 4], [0, 5, 6, 0, 0]])
    new_mask, new_ids = flush_left(mask, ids)
    assert new_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert new_ids.tolist() == [[2, 3, 4], [5, 6, 0]]
    assert flush_left(mask).tolist() == [[1, 1, 1], [1, 1, 0]]


def test_flush_left_with_trailing_dimensions():
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    values = torch.arange(12).reshape(2, 3, 2)
    new_mask, new_values = flush_left(mask, values)
    assert new_mask.tolist() == [[1, 1], [1, 0]]
    assert new_values.tolist() == [[[2, 3], [4, 5]], [[6, 7], [8, 9]]]


def test_flush_right_exact():
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]])
    ids = torch.tensor([[1, 2, 0, 0], [0, 3, 4, 5]])
    new_mask, new_ids = flush_right(mask, ids)
    assert new_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert new_ids.tolist() == [[0, 1, 2], [3, 4, 5]]


# ---------------------------------------------------------------------------------------------------------------------
# samplers and dict helpers
# ---------------------------------------------------------------------------------------------------------------------


def test_repeat_sampler_exact_sequence_without_shuffle():
    sampler = RepeatSampler(
        ["a", "b", "c", "d", "e"], mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False
    )
    assert list(sampler) == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    assert len(sampler) == 16


def test_repeat_sampler_defaults_and_seed():
    data = list(range(6))
    assert list(RepeatSampler(data, mini_repeat_count=3, shuffle=False)) == [i for i in data for _ in range(3)]
    first = list(RepeatSampler(data, mini_repeat_count=2, batch_size=3, seed=42))
    second = list(RepeatSampler(data, mini_repeat_count=2, batch_size=3, seed=42))
    assert first == second
    order = torch.randperm(6, generator=torch.Generator().manual_seed(42)).tolist()
    assert first == [i for i in order for _ in range(2)]
    assert sorted(set(first)) == data


def test_repeat_iterable_dataset():
    from datasets import Dataset

    stream = Dataset.from_dict({"x": [0, 1, 2, 3, 4]}).to_iterable_dataset()
    repeated = repeat_iterable_dataset(stream, mini_repeat_count=2, batch_size=2, repeat_count=2)
    assert [row["x"] for row in repeated] == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]


def test_repeated_iterable_dataset_forwards_set_epoch_and_pickles():
    import pickle

    from datasets import Dataset

    stream = Dataset.from_dict({"x": list(range(8))}).to_iterable_dataset(num_shards=2).shuffle(seed=0, buffer_size=4)
    repeated = repeat_iterable_dataset(stream, mini_repeat_count=1)
    assert isinstance(repeated, torch.utils.data.IterableDataset)
    orders = []
    for epoch in (0, 1):
        repeated.set_epoch(epoch)
        orders.append([row["x"] for row in repeated])
        stream.set_epoch(epoch)
        assert orders[-1] == [row["x"] for row in stream]
    assert orders[0] != orders[1] and sorted(orders[0]) == list(range(8))
    assert [row["x"] for row in pickle.loads(pickle.dumps(repeated))] == orders[1]


def test_nan_reductions():
    values = torch.tensor([1.0, float("nan"), 3.0, 5.0])
    assert nanmin(values).item() == 1.0
    assert nanmax(values).item() == 5.0
    assert torch.isclose(nanstd(values), torch.tensor([1.0, 3.0, 5.0]).std())
    assert torch.isnan(nanmin(torch.tensor([float("nan")])))
    assert torch.isnan(nanmax(torch.tensor([float("nan"), float("nan")])))
    matrix = torch.tensor([[1.0, 3.0, float("nan")], [2.0, 2.0, 8.0]])
    expected = torch.stack([torch.tensor([1.0, 3.0]).std(), torch.tensor([2.0, 2.0, 8.0]).std()])
    torch.testing.assert_close(nanstd(matrix, dim=1), expected)
    assert nanstd(matrix, dim=1, keepdim=True).shape == (2, 1)


def test_split_tensor_dict():
    data = {"a": torch.arange(6).reshape(6, 1), "b": list("abcdef"), "c": None, "d": torch.tensor(7)}
    chunks = split_tensor_dict(data, 3)
    assert len(chunks) == 3
    assert chunks[1]["a"].tolist() == [[2], [3]]
    assert chunks[2]["b"] == ["e", "f"]
    assert chunks[0]["c"] is None
    assert chunks[0]["d"].item() == 7


def test_shuffle_sequence_dict_uses_one_permutation():
    torch.manual_seed(0)
    data = {"a": torch.arange(8), "b": [f"x{i}" for i in range(8)], "c": None, "d": torch.tensor(1.0)}
    shuffled = shuffle_sequence_dict(data)
    assert shuffled["b"] == [f"x{i}" for i in shuffled["a"].tolist()]
    assert sorted(shuffled["a"].tolist()) == list(range(8))
    assert shuffled["c"] is None and shuffled["d"].item() == 1.0


def test_print_prompt_completions_sample(capsys):
    print_prompt_completions_sample(
        prompts=["Sky is", [{"role": "user", "content": "Hi there"}]],
        completions=[" blue", [{"role": "assistant", "content": "Hello!"}]],
        rewards={"accuracy": [1.0, 0.0], "format": [0.5, 0.25]},
        advantages=[0.75, -0.75],
        step=42,
    )
    out = capsys.readouterr().out
    for expected in ("Step 42", "Sky is", "blue", "Hi there", "Hello!", "accuracy", "format", "Advantage", "-0.75"):
        assert expected in out

    print_prompt_completions_sample(["p1", "p2", "p3"], ["c1", "c2", "c3"], {"r": [1, 2, 3]}, [0, 0, 0], 1, 1)
    out = capsys.readouterr().out
    assert sum(f"c{i}" in out for i in (1, 2, 3)) == 1


# ---------------------------------------------------------------------------------------------------------------------
# model / environment helpers
# ---------------------------------------------------------------------------------------------------------------------


def test_disable_dropout_in_model():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.3), nn.Sequential(nn.Dropout(0.5), nn.Dropout2d(0.1)))
    disable_dropout_in_model(model)
    assert [m.p for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)] == [0.0, 0.0, 0.0]

    hf_model = tiny_model(attention_dropout=0.4)
    disable_dropout_in_model(hf_model)
    assert hf_model.config.attention_dropout == 0.4  # config untouched; only nn.Dropout modules are changed


def test_ensure_master_addr_port(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    ensure_master_addr_port()
    assert os.environ["MASTER_ADDR"] == "localhost"
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "12345")
    ensure_master_addr_port(addr="1.2.3.4")
    assert os.environ["MASTER_ADDR"] == "10.0.0.1"
    assert os.environ["MASTER_PORT"] == "12345"

    ensure_master_addr_port(port=23456)
    assert os.environ["MASTER_PORT"] == "23456"

    for placeholder in ("", "0", "auto", "not-a-port"):
        monkeypatch.setenv("MASTER_PORT", placeholder)
        ensure_master_addr_port()
        assert os.environ["MASTER_PORT"] not in ("", "0", "auto", "not-a-port")

    monkeypatch.delenv("MASTER_ADDR")
    ensure_master_addr_port(addr="1.2.3.4")
    assert os.environ["MASTER_ADDR"] == "1.2.3.4"


@dataclass
class FakeModelConfig:
    """Stand-in with the ModelConfig fields read by get_peft_config / get_quantization_config."""

    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | str | None = None
    lora_modules_to_save: list[str] | None = None
    lora_task_type: str = "CAUSAL_LM"
    use_rslora: bool = False
    use_dora: bool = False
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    bnb_4bit_quant_type: str = "nf4"
    use_bnb_nested_quant: bool = False
    bnb_4bit_quant_storage: str | None = None
    dtype: str | None = "float32"
    lora_target_parameters: list[str] | None = None


def test_get_peft_config():
    from peft import LoraConfig

    assert get_peft_config(FakeModelConfig()) is None
    config = get_peft_config(
        FakeModelConfig(
            use_peft=True,
            lora_r=8,
            lora_alpha=4,
            lora_dropout=0.1,
            lora_target_modules=["q_proj", "v_proj"],
            lora_modules_to_save=["lm_head"],
            lora_task_type="SEQ_CLS",
            use_rslora=True,
        )
    )
    assert isinstance(config, LoraConfig)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.bias) == (8, 4, 0.1, "none")
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    assert config.modules_to_save == ["lm_head"]
    assert config.task_type == "SEQ_CLS"
    assert config.use_rslora is True and config.use_dora is False

    config = get_peft_config(FakeModelConfig(use_peft=True, lora_target_parameters=["mlp.experts.gate_up_proj"]))
    assert list(config.target_parameters) == ["mlp.experts.gate_up_proj"]


def test_get_quantization_config():
    assert get_quantization_config(FakeModelConfig()) is None
    config = get_quantization_config(
        FakeModelConfig(load_in_4bit=True, dtype="bfloat16", bnb_4bit_quant_type="fp4", use_bnb_nested_quant=True)
    )
    assert config.load_in_4bit is True
    assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert config.bnb_4bit_quant_type == "fp4"
    assert config.bnb_4bit_use_double_quant is True
    config = get_quantization_config(FakeModelConfig(load_in_8bit=True))
    assert config.load_in_8bit is True and config.load_in_4bit is False


def test_get_kbit_device_map_on_cpu():
    if not torch.cuda.is_available():
        assert get_kbit_device_map() is None


@pytest.fixture(scope="module")
def saved_bf16_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bf16")
    tiny_model().to(torch.bfloat16).save_pretrained(path)
    return str(path)


def test_create_model_from_path_dtypes(saved_bf16_model):
    model = create_model_from_path(saved_bf16_model)
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.dtype == torch.float32  # float32 by default, whatever the checkpoint dtype
    assert create_model_from_path(saved_bf16_model, dtype="auto").dtype == torch.bfloat16
    assert create_model_from_path(saved_bf16_model, dtype="bfloat16").dtype == torch.bfloat16
    assert create_model_from_path(saved_bf16_model, dtype="float16").dtype == torch.float16
    assert create_model_from_path(saved_bf16_model, dtype=torch.float16).dtype == torch.float16
    if not torch.cuda.is_available():
        assert getattr(model, "hf_device_map", None) is None
    assert get_config_model_id(model.config) == saved_bf16_model


def test_create_model_from_path_rejects_unknown_dtype(saved_bf16_model):
    with pytest.raises(ValueError) as error:
        create_model_from_path(saved_bf16_model, dtype="float8")
    message = str(error.value)
    assert "float8" in message
    for allowed in ("auto", "bfloat16", "float16", "float32"):
        assert allowed in message


def test_create_model_from_path_architecture(saved_bf16_model):
    model = create_model_from_path(saved_bf16_model, architecture=AutoModelForSequenceClassification, num_labels=1)
    assert model.score.out_features == 1
    assert isinstance(create_model_from_path(saved_bf16_model, architecture=AutoModelForCausalLM), Qwen2ForCausalLM)


def test_create_model_from_path_auto_map_fallback(tmp_path):
    # A config naming a class transformers does not have falls back to AutoModelForCausalLM.
    model = tiny_model()
    model.config.architectures = ["MyCustomForCausalLM"]
    model.save_pretrained(tmp_path)
    assert isinstance(create_model_from_path(str(tmp_path)), Qwen2ForCausalLM)


def test_identity_and_remove_none_values():
    obj = object()
    assert identity(obj) is obj
    example = {"a": 1, "b": None, "c": [{"x": None, "y": 2}, {"z": 3}], "d": {"e": None}}
    assert remove_none_values(example) == {"a": 1, "c": [{"y": 2}, {"z": 3}], "d": {}}


def test_hash_module():
    model = nn.Linear(3, 2)
    copy = nn.Linear(3, 2)
    copy.load_state_dict(model.state_dict())
    assert hash_module(model) == hash_module(copy)
    assert len(hash_module(model)) == 64
    with torch.no_grad():
        copy.weight[0, 0] += 1
    assert hash_module(model) != hash_module(copy)


def test_hash_module_matches_hand_computed_digest():
    """TRL's digest: state-dict entries in sorted key order, each as its dtype name then its bytes (bfloat16 as
    float32 bytes); names and shapes are not hashed."""
    import hashlib

    model = nn.Sequential(nn.Linear(2, 1), nn.BatchNorm1d(1))  # keys 0.bias, 0.weight, 1.bias, ..., an int64 buffer
    expected = hashlib.sha256()
    for key in sorted(model.state_dict()):
        tensor = model.state_dict()[key]
        expected.update(str(tensor.dtype).encode() + tensor.numpy().tobytes())
    assert hash_module(model) == expected.hexdigest()
    assert hash_module(nn.Module()) == hashlib.sha256(b"").hexdigest()

    half = nn.Linear(2, 2, bias=False).to(torch.bfloat16)
    as_float = half.weight.detach().float().numpy().tobytes()
    assert hash_module(half) == hashlib.sha256(b"torch.bfloat16" + as_float).hexdigest()
    # a parameter and a buffer with the same values and dtype hash alike (names are not part of the digest)
    first, second = nn.Module(), nn.Module()
    first.w = nn.Parameter(torch.tensor([1.0, 2.0]))
    second.register_buffer("other", torch.tensor([[1.0, 2.0]]))
    assert hash_module(first) == hash_module(second)


def test_cast_lm_head_to_fp32_unties_tied_embeddings():
    from trl.trainer.online_base import _OnlineTrainer

    config = Qwen2Config(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    shared = model.lm_head.weight.detach().clone()
    _OnlineTrainer._cast_lm_head_to_fp32(model)
    # the head gets its own float32 copy; the embeddings keep bfloat16; the config flag is left as it is (as TRL)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight.to(torch.bfloat16), shared) and model.config.tie_word_embeddings
    ids = torch.tensor([[1, 2, 3]])
    assert model(input_ids=ids).logits.dtype == torch.float32


def test_get_callable_name_and_is_async_callable():
    def reward_fn(x):
        return x

    async def async_reward(x):
        return x

    class Scorer:
        def __call__(self, x):
            return x

    class AsyncScorer:
        async def __call__(self, x):
            return x

    assert get_callable_name(reward_fn) == "reward_fn"
    assert get_callable_name(functools.partial(reward_fn)) == "reward_fn"
    assert get_callable_name(Scorer()) == "Scorer"
    assert get_callable_name(Scorer().__call__) == "__call__"
    assert not is_async_callable(reward_fn)
    assert is_async_callable(async_reward)
    assert is_async_callable(functools.partial(async_reward))
    assert is_async_callable(AsyncScorer())
    assert not is_async_callable(Scorer())
    assert asyncio.run(async_reward(3)) == 3


def test_generate_model_card(tmp_path):
    card = generate_model_card(
        base_model="org/base",
        model_name="my-model",
        hub_model_id="me/my-model",
        dataset_name="org/data",
        tags=["sft"],
        wandb_url="https://wandb.ai/run/1",
        trackio_url=None,
        trainer_name="SFT",
        paper_title="A paper",
        paper_id="1234.5678",
    )
    text = str(card)
    assert "my-model" in text and "me/my-model" in text and "https://wandb.ai/run/1" in text
    assert card.data.tags == ["generated_from_trainer", "sft"]
    assert card.data.base_model == "org/base"

    template = tmp_path / "card.md"
    template.write_text("---\n{{ card_data }}\n---\n# {{ model_name }} by {{ trainer_name }}\n")
    card = generate_model_card(None, "m", "h", None, None, None, None, "DPO", template_file=str(template))
    assert "# m by DPO" in str(card)


def test_flops_and_mfu():
    """TRL's accounting, by hand: 6 x (weight matrices a token passes: q, k, v, o, 3 MLP, LM head) + 12 L A S."""
    from transformers import Qwen2Config

    from trl.trainer.utils import adjusted_mfu, get_peak_flops_per_device

    config = Qwen2Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        intermediate_size=256,
        num_hidden_layers=3,
        vocab_size=1000,
    )
    attention, key_value = 4 * 48, 2 * 48
    per_layer = 128 * attention + 2 * 128 * key_value + attention * 128 + 3 * 128 * 256
    num_params = 3 * per_layer + 1000 * 128
    assert compute_flops_per_token(config, 7) == 6 * num_params + 12 * 3 * attention * 7
    assert isinstance(compute_flops_per_token(config, 7), int)
    # MFU in percent over world_size devices; the causal adjustment halves the attention term.
    assert compute_mfu(1000, 10.0, 2, 1e4) == pytest.approx(50.0)
    total = compute_flops_per_token(config, 100)
    expected = 50.0 * (total - 6 * 3 * attention * 100) / total
    assert adjusted_mfu(50.0, config, 100) == pytest.approx(expected)
    assert get_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert get_peak_flops("Tesla T4", "bfloat16") is None and get_peak_flops("Tesla T4", "float16") == 65e12
    assert get_peak_flops("NVIDIA A100-SXM4-80GB", "float32") is None
    assert get_peak_flops("cpu", "bfloat16") is None

    class _CPU:
        device = torch.device("cpu")

    assert get_peak_flops_per_device(_CPU(), "bfloat16") is None


# ---------------------------------------------------------------------------------------------------------------------
# PEFT
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Args:
    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict | None = None
    bf16: bool = False


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def test_prepare_peft_model_trains_only_lora():
    from peft import PeftModel

    model = prepare_peft_model(tiny_model(), lora_config(), Args())
    assert isinstance(model, PeftModel)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert len(trainable) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)


@pytest.mark.parametrize("gc_kwargs", [None, {"use_reentrant": True}])
def test_prepare_peft_model_with_gradient_checkpointing_trains(gc_kwargs):
    args = Args(gradient_checkpointing=True, gradient_checkpointing_kwargs=gc_kwargs)
    model = prepare_peft_model(tiny_model(), lora_config(), args)
    assert is_activation_checkpointing(model.base_model.model)
    model.train()
    input_ids = torch.randint(0, 64, (2, 6))
    embeddings = model.get_input_embeddings()(input_ids)
    assert embeddings.requires_grad  # input grads enabled, so checkpointed blocks propagate to the adapters
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    # lora_B starts at zero, so it is the one with a non-zero gradient after the first backward.
    grads = [p.grad for name, p in model.named_parameters() if "lora_B" in name]
    assert len(grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_prepare_peft_model_errors():
    model = tiny_model()
    with pytest.raises(TypeError, match="PeftConfig"):
        prepare_peft_model(model, {"r": 4}, Args())
    peft_model = prepare_peft_model(model, lora_config(), Args())
    with pytest.raises(ValueError, match="PeftModel"):
        prepare_peft_model(peft_model, lora_config(), Args())
    assert prepare_peft_model(peft_model, None, Args()) is peft_model


def test_use_adapter():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), lora_config())
    model.add_adapter("ref", LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.set_adapter("default")
    for name, param in model.named_parameters():
        if "lora_B" in name and "default" in name:  # make the default adapter non-trivial
            torch.nn.init.normal_(param)
    model.eval()
    input_ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        default_out = model(input_ids).logits
        with model.disable_adapter():
            base_out = model(input_ids).logits
        with use_adapter(model, None):
            assert torch.allclose(model(input_ids).logits, base_out)
        flags = {name: p.requires_grad for name, p in model.named_parameters()}
        with use_adapter(model, "ref"):
            assert model.active_adapter == "ref"
            ref_out = model(input_ids).logits
        assert model.active_adapter == "default"
        assert torch.allclose(model(input_ids).logits, default_out)
    assert not torch.allclose(ref_out, default_out)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags


# ---------------------------------------------------------------------------------------------------------------------
# profiling
# ---------------------------------------------------------------------------------------------------------------------


class _Args:
    report_to = ["none"]


class _Accelerator:
    is_main_process = True


class _State:
    global_step = 3


class DummyTrainer:
    args = _Args()
    accelerator = _Accelerator()
    state = _State()

    @profiling_decorator
    def compute(self, x):
        return x * 2


def test_profiling_context_and_decorator():
    with ProfilingContext("section", report_to=[]) as ctx:
        sum(range(1000))
    assert ctx.duration is not None and ctx.duration >= 0
    assert ctx.metric_name == "profiling/Time taken: section"

    trainer = DummyTrainer()
    context = profiling_context(trainer, "generate")
    assert context.metric_name == "profiling/Time taken: DummyTrainer.generate"
    assert context.step == 3 and context.is_main_process
    with context:
        pass
    assert context.duration >= 0
    assert trainer.compute(4) == 8
    assert DummyTrainer.compute.__name__ == "compute"


# --- shared trainer construction ---------------------------------------------------------------------------------


def _trainer_with_tokenizer(name: str, tmp_path, tokenizer):
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
    from trl.assets import get_model_path, load_test_dataset

    common = {"output_dir": str(tmp_path), "report_to": "none"}
    causal = get_model_path("tiny-Qwen2ForCausalLM")
    if name == "sft":
        data = load_test_dataset("standard_language_modeling", split="train")
        return SFTTrainer(causal, args=SFTConfig(**common), train_dataset=data, processing_class=tokenizer)
    if name == "dpo":
        data = load_test_dataset("standard_preference", split="train")
        return DPOTrainer(causal, args=DPOConfig(**common), train_dataset=data, processing_class=tokenizer)
    if name == "reward":
        data = load_test_dataset("standard_preference", split="train")
        model = get_model_path("tiny-Qwen2ForSequenceClassification")
        return RewardTrainer(model, args=RewardConfig(**common), train_dataset=data, processing_class=tokenizer)
    data = load_test_dataset("standard_prompt_only", split="train")
    args = GRPOConfig(**common, per_device_train_batch_size=2, num_generations=2)
    return GRPOTrainer(
        causal,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("name", ["sft", "dpo", "reward", "grpo"])
def test_trainers_need_a_pad_or_eos_token(name, tmp_path):
    """A tokenizer without pad token gets its eos token as pad token; with neither, every trainer says how to fix it
    before anything is tokenized."""
    from transformers import AutoTokenizer

    from trl.assets import get_model_path

    tokenizer = AutoTokenizer.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    tokenizer.pad_token = None
    trainer = _trainer_with_tokenizer(name, tmp_path / "with_eos", tokenizer)
    assert trainer.processing_class.pad_token == tokenizer.eos_token is not None
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="neither a pad_token nor an eos_token; set tokenizer.pad_token"):
        _trainer_with_tokenizer(name, tmp_path / "without", tokenizer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_log_softmax_scores_several_tokens_per_position(dtype):
    """`index` of shape `(..., K)`: each of the K tokens scored against the full softmax (values and gradients)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11, dtype=dtype, requires_grad=True)
    index = torch.randint(0, 11, (2, 3, 4))
    got = selective_log_softmax(logits, index, temperature=0.7)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, index)
    assert got.shape == (2, 3, 4) and got.dtype == dtype
    torch.testing.assert_close(got, expected)
    (grad_got,) = torch.autograd.grad((got * torch.arange(4.0, dtype=dtype)).sum(), logits)
    (grad_expected,) = torch.autograd.grad((expected * torch.arange(4.0, dtype=dtype)).sum(), logits)
    torch.testing.assert_close(grad_got, grad_expected)
    masked = selective_log_softmax(logits, index, row_mask=torch.tensor([True, False]))
    assert torch.equal(masked[1], torch.zeros_like(masked[1]))
