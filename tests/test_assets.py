import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from trainer_utils import requires_qwen2_vl_processor
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from trl import assets
from trl._compat import saved_files_suffix
from trl.assets import (
    DATASET_NAMES,
    build_all,
    get_dataset_path,
    get_model_path,
    get_tokenizer_path,
    load_test_dataset,
)


try:  # the shared format check, when trl.data_utils is available
    from trl.data_utils import is_conversational
except ImportError:  # pragma: no cover - only while trl.data_utils is being written

    def is_conversational(example):
        for key in ("prompt", "chosen", "rejected", "completion", "messages"):
            value = example.get(key)
            if isinstance(value, list) and value and isinstance(value[0], dict) and "role" in value[0]:
                return True
        return False


CHAT_TEMPLATES = Path(assets.__file__).parent / "chat_templates"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """Point the asset cache at an empty directory for the duration of a test."""

    def use(name: str) -> Path:
        root = tmp_path / name
        monkeypatch.setenv("TRL_ASSETS_CACHE", str(root))
        return root

    return use


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------------------------


class TestTokenizers:
    def test_qwen2_5_special_tokens(self, qwen_tokenizer):
        tok = qwen_tokenizer
        assert len(tok) == 4096
        assert tok.bos_token is None
        assert tok.eos_token == "<|im_end|>"
        assert tok.pad_token == "<|endoftext|>"
        assert tok.convert_ids_to_tokens([4089, 4090, 4091]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        assert (tok.pad_token_id, tok.eos_token_id) == (4089, 4091)
        assert sorted(tok.all_special_ids) == [4089, 4090, 4091]
        # Tool tags are single added tokens that are not special (like Qwen2.5).
        for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
            assert len(tok(tag, add_special_tokens=False).input_ids) == 1
            assert tok.convert_tokens_to_ids(tag) not in tok.all_special_ids
        assert tok.chat_template == (CHAT_TEMPLATES / "tiny_qwen2_5.jinja").read_text()

    def test_llama3_special_tokens(self, llama_tokenizer):
        tok = llama_tokenizer
        assert len(tok) == 4096
        assert tok.bos_token == "<|begin_of_text|>"
        assert tok.eos_token == "<|eot_id|>"
        assert tok.pad_token == "<|finetune_right_pad_id|>"
        assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
        for token in ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"):
            assert tok.added_tokens_decoder[tok.convert_tokens_to_ids(token)].special
        # Like Llama 3, plain tokenization prepends the bos token.
        ids = tok("Hello world").input_ids
        assert ids[0] == tok.bos_token_id
        assert tok("Hello world", add_special_tokens=False).input_ids == ids[1:]
        assert tok.chat_template == (CHAT_TEMPLATES / "tiny_llama3.jinja").read_text()

    @pytest.mark.parametrize("name", ["qwen2_5", "llama3"])
    def test_round_trip(self, name):
        tok = AutoTokenizer.from_pretrained(get_tokenizer_path(name))
        text = "The capital of France is Paris. 12 + 30 = 42.\ndef add(a, b):\n    return a + b  # ünïcödé ✓"
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
        # The corpus makes common words single tokens.
        assert tok.tokenize(" capital") == ["Ġcapital"]

    @pytest.mark.parametrize("name", ["qwen2_5", "llama3"])
    def test_chat_template_rendering_without_double_bos(self, name):
        tok = AutoTokenizer.from_pretrained(get_tokenizer_path(name))
        ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True, return_dict=True)[
            "input_ids"
        ]
        if tok.bos_token_id is not None:
            assert ids[0] == tok.bos_token_id
            assert ids[1] != tok.bos_token_id
        text = tok.decode(ids)
        assert text.count("Hi") == 1

    def test_tokenizers_are_deterministic(self, fresh_cache):
        fresh_cache("a")
        paths_a = [Path(get_tokenizer_path(n)) for n in ("qwen2_5", "llama3")]
        fresh_cache("b")
        paths_b = [Path(get_tokenizer_path(n)) for n in ("qwen2_5", "llama3")]
        for a, b in zip(paths_a, paths_b):
            assert a != b
            assert _sha(a / "tokenizer.json") == _sha(b / "tokenizer.json")
            model_a = json.loads((a / "tokenizer.json").read_text())["model"]
            model_b = json.loads((b / "tokenizer.json").read_text())["model"]
            assert model_a["vocab"] == model_b["vocab"]
            assert model_a["merges"] == model_b["merges"]
            assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------

TINY_MODELS = {
    "tiny-Qwen2ForCausalLM": AutoModelForCausalLM,
    "tiny-LlamaForCausalLM": AutoModelForCausalLM,
    "tiny-Qwen2ForSequenceClassification": AutoModelForSequenceClassification,
    "tiny-LlamaForSequenceClassification": AutoModelForSequenceClassification,
    "tiny-Qwen2ForTokenClassification": AutoModelForTokenClassification,
    "tiny-LlamaForTokenClassification": AutoModelForTokenClassification,
    "tiny-T5ForConditionalGeneration": AutoModelForSeq2SeqLM,
    "tiny-Qwen2MoeForCausalLM": AutoModelForCausalLM,
}


class TestModels:
    @pytest.mark.parametrize("name", list(TINY_MODELS))
    def test_load_and_forward(self, name):
        path = get_model_path(name)
        model = TINY_MODELS[name].from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = model.config
        assert config.architectures == [name.removeprefix("tiny-")]
        assert config.vocab_size == len(tokenizer) == 4096
        assert config.pad_token_id == tokenizer.pad_token_id is not None
        if model.can_generate():
            assert model.generation_config.eos_token_id == tokenizer.eos_token_id
            assert model.generation_config.pad_token_id == tokenizer.pad_token_id
        else:
            assert not Path(path, "generation_config.json").exists()
        batch = tokenizer(["The sky is blue.", "Hi"], return_tensors="pt", padding=True)
        extra = {"decoder_input_ids": batch["input_ids"][:, :3]} if config.is_encoder_decoder else {}
        with torch.no_grad():
            out = model(**batch, **extra)
        seq = batch["input_ids"].shape[1]
        if "SequenceClassification" in name:
            assert out.logits.shape == (2, 1)
        elif "TokenClassification" in name:
            assert out.logits.shape == (2, seq, 2)
        elif config.is_encoder_decoder:
            assert out.logits.shape == (2, 3, 4096)
        else:
            assert out.logits.shape == (2, seq, 4096)
        assert torch.isfinite(out.logits).all()

    @pytest.mark.parametrize("name", ["tiny-Qwen2ForCausalLM", "tiny-LlamaForCausalLM", "tiny-Qwen2MoeForCausalLM"])
    def test_decoder_shapes(self, name):
        config = AutoModelForCausalLM.from_pretrained(get_model_path(name)).config
        assert config.hidden_size == 64
        assert config.num_hidden_layers == 2
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        assert head_dim == 64

    def test_tie_word_embeddings_follow_config_defaults(self):
        from transformers import LlamaConfig, Qwen2Config

        qwen = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
        llama = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-LlamaForCausalLM"))
        assert qwen.config.tie_word_embeddings == Qwen2Config().tie_word_embeddings
        assert llama.config.tie_word_embeddings == LlamaConfig().tie_word_embeddings

    def test_moe_returns_router_logits(self):
        model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2MoeForCausalLM"))
        assert model.config.output_router_logits is True
        input_ids = torch.tensor([[1, 2, 3, 4, 5]])
        with torch.no_grad():
            out = model(input_ids=input_ids, labels=input_ids)
        assert len(out.router_logits) == 2
        assert out.router_logits[0].shape == (5, model.config.num_experts)
        assert out.aux_loss is not None and torch.isfinite(out.aux_loss)

    def test_generate(self, tiny_qwen_path):
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen_path)
        tokenizer = AutoTokenizer.from_pretrained(tiny_qwen_path)
        prompt = tokenizer(["The sky is"], return_tensors="pt")
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
        assert out.shape == (1, prompt["input_ids"].shape[1] + 4)

    def test_small_model_size(self):
        model = AutoModelForCausalLM.from_pretrained(get_model_path("small-Qwen2ForCausalLM"))
        n_params = sum(p.numel() for p in model.parameters())
        assert 25_000_000 < n_params < 35_000_000
        assert model.config.hidden_size // model.config.num_attention_heads == 64

    def test_models_are_deterministic(self, fresh_cache):
        fresh_cache("a")
        path_a = Path(get_model_path("tiny-Qwen2ForCausalLM"))
        fresh_cache("b")
        path_b = Path(get_model_path("tiny-Qwen2ForCausalLM"))
        assert path_a != path_b
        assert _sha(path_a / "model.safetensors") == _sha(path_b / "model.safetensors")
        state_a = AutoModelForCausalLM.from_pretrained(path_a).state_dict()
        state_b = AutoModelForCausalLM.from_pretrained(path_b).state_dict()
        assert state_a.keys() == state_b.keys()
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
        assert state_a["model.embed_tokens.weight"].std() > 0  # random, not zeros

    def test_different_models_get_different_weights(self):
        qwen = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
        moe = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2MoeForCausalLM"))
        assert not torch.equal(qwen.model.embed_tokens.weight, moe.model.embed_tokens.weight)


# ----------------------------------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------------------------------

EXPECTED_COLUMNS = {
    "standard_language_modeling": ["text"],
    "standard_prompt_only": ["prompt"],
    "standard_prompt_completion": ["prompt", "completion"],
    "standard_preference": ["prompt", "chosen", "rejected"],
    "standard_implicit_prompt_preference": ["chosen", "rejected"],
    "standard_unpaired_preference": ["prompt", "completion", "label"],
    "standard_stepwise_supervision": ["prompt", "completions", "labels"],
    "conversational_language_modeling": ["messages"],
    "conversational_prompt_only": ["prompt"],
    "conversational_prompt_completion": ["prompt", "completion"],
    "conversational_preference": ["prompt", "chosen", "rejected"],
    "conversational_implicit_prompt_preference": ["chosen", "rejected"],
    "conversational_unpaired_preference": ["prompt", "completion", "label"],
    "conversational_language_modeling_tools": ["messages", "tools"],
    "length_skewed_language_modeling": ["text"],
}


def _is_messages(value) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and m["role"] in ("system", "user", "assistant", "tool") for m in value)
    )


class TestDatasets:
    def test_every_dataset_has_expected_columns(self):
        # Image datasets (saved with save_to_disk) are checked in tests/test_vlm_trainers.py.
        assert sorted(EXPECTED_COLUMNS) == sorted(n for n in DATASET_NAMES if not n.startswith("vision_"))

    @pytest.mark.parametrize("name", list(EXPECTED_COLUMNS))
    def test_columns_and_types(self, name):
        dataset = load_test_dataset(name)
        assert sorted(dataset.keys()) == ["test", "train"]
        train, test = dataset["train"], dataset["test"]
        if name == "length_skewed_language_modeling":
            assert (len(train), len(test)) == (512, 32)
        else:
            assert 40 <= len(train) <= 64 and 8 <= len(test) <= 16
        for split in (train, test):
            assert split.column_names == EXPECTED_COLUMNS[name]
            for row in split:
                assert is_conversational(row) == name.startswith("conversational")
                for column, value in row.items():
                    if column == "label":
                        assert isinstance(value, bool)
                    elif column == "labels":
                        assert 1 <= len(value) <= 4 and all(isinstance(v, bool) for v in value)
                    elif column == "completions":
                        assert len(value) == len(row["labels"]) and all(isinstance(v, str) for v in value)
                    elif column == "tools":
                        assert [t["function"]["name"] for t in value] == ["add", "multiply", "subtract"]
                    elif name.startswith("conversational"):
                        assert _is_messages(value)
                    else:
                        assert isinstance(value, str) and value

    @pytest.mark.parametrize("name", ["standard_unpaired_preference", "conversational_unpaired_preference"])
    def test_unpaired_labels_are_mixed(self, name):
        labels = load_test_dataset(name, split="train")["label"]
        assert 0.25 < sum(labels) / len(labels) < 0.75

    def test_stepwise_labels_are_mixed(self):
        labels = [
            label for row in load_test_dataset("standard_stepwise_supervision", "train")["labels"] for label in row
        ]
        assert True in labels and False in labels
        lengths = {len(row) for row in load_test_dataset("standard_stepwise_supervision", "train")["labels"]}
        assert lengths == {1, 2, 3, 4}

    def test_stepwise_steps_are_arithmetic(self):
        row = load_test_dataset("standard_stepwise_supervision", "train")[0]
        for step, label in zip(row["completions"], row["labels"]):
            left, right = step.split(" = ")
            a, b = (int(x) for x in left.split(" + "))
            assert (a + b == int(right)) or not label

    def test_preference_chosen_differs_from_rejected(self):
        for name in ("standard_preference", "conversational_preference", "conversational_implicit_prompt_preference"):
            for row in load_test_dataset(name, "train"):
                assert row["chosen"] != row["rejected"]

    def test_implicit_prompt_preference_shares_the_prompt(self):
        for row in load_test_dataset("conversational_implicit_prompt_preference", "train"):
            assert row["chosen"][:-1] == row["rejected"][:-1]
            assert row["chosen"][-1]["role"] == "assistant"
        for row in load_test_dataset("standard_implicit_prompt_preference", "train"):
            prefix = os.path.commonprefix([row["chosen"], row["rejected"]])
            assert len(prefix) > 3

    def test_some_conversations_have_system_prompts(self):
        for name in ("conversational_language_modeling", "conversational_prompt_only", "conversational_preference"):
            column = "messages" if "language" in name else "prompt"
            first_roles = [m[0]["role"] for m in load_test_dataset(name, "train")[column]]
            assert "system" in first_roles and "user" in first_roles

    def test_conversational_language_modeling_has_multi_turn_rows(self):
        messages = load_test_dataset("conversational_language_modeling", "train")["messages"]
        assert any(sum(m["role"] == "assistant" for m in row) == 2 for row in messages)
        assert all(row[-1]["role"] == "assistant" for row in messages)

    def test_tools_dataset_renders_with_both_families(self, qwen_tokenizer, llama_tokenizer):
        dataset = load_test_dataset("conversational_language_modeling_tools", "train")
        with_calls = [row for row in dataset if any(m.get("tool_calls") for m in row["messages"])]
        assert len(with_calls) >= len(dataset) // 2
        assert any(len(m.get("tool_calls") or []) == 2 for row in dataset for m in row["messages"])
        row = with_calls[0]
        call = next(m for m in row["messages"] if m.get("tool_calls"))["tool_calls"][0]["function"]
        assert set(call["arguments"]) == {"a", "b"}
        text = qwen_tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
        assert (
            f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {json.dumps(call["arguments"])}}}\n</tool_call>'
            in text
        )
        assert "<tool_response>\n" in text and "<tools>\n" in text
        text = llama_tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
        assert f'{{"name": "{call["name"]}", "parameters": {json.dumps(call["arguments"])}}}<|eot_id|>' in text
        assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in text

    def test_length_skewed_distribution(self, qwen_tokenizer):
        texts = load_test_dataset("length_skewed_language_modeling", "train")["text"]
        lengths = sorted(len(qwen_tokenizer(t).input_ids) for t in texts)
        median = lengths[len(lengths) // 2]
        assert median < 64
        assert 900 <= lengths[-1] <= 1100
        assert sum(n > 256 for n in lengths) >= 5
        assert sum(n < 64 for n in lengths) > len(lengths) // 2

    def test_split_argument(self):
        train = load_test_dataset("standard_prompt_only", split="train")
        assert train.num_rows == 64
        assert load_test_dataset("standard_prompt_only", split="test").num_rows == 12
        with pytest.raises(ValueError, match="expected 'train', 'test' or None"):
            load_test_dataset("standard_prompt_only", split="validation")

    def test_files_on_disk(self):
        path = Path(get_dataset_path("standard_preference"))
        assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) == ["test.jsonl", "train.jsonl"]
        first = json.loads((path / "train.jsonl").read_text().splitlines()[0])
        assert set(first) == {"prompt", "chosen", "rejected"}

    def test_datasets_are_deterministic(self, fresh_cache):
        fresh_cache("a")
        path_a = Path(get_dataset_path("conversational_language_modeling_tools"))
        fresh_cache("b")
        path_b = Path(get_dataset_path("conversational_language_modeling_tools"))
        for split in ("train.jsonl", "test.jsonl"):
            assert _sha(path_a / split) == _sha(path_b / split)


# ----------------------------------------------------------------------------------------------------------------------
# Cache behaviour
# ----------------------------------------------------------------------------------------------------------------------


class TestCache:
    def test_env_override_and_version_in_path(self, fresh_cache):
        root = fresh_cache("cache")
        path = Path(get_dataset_path("standard_prompt_only"))
        assert path == root / (assets.ASSETS_VERSION + saved_files_suffix()) / "datasets" / "standard_prompt_only"
        assert (path / ".complete").is_file()
        # No temporary build directories are left behind.
        assert [p.name for p in path.parent.iterdir()] == ["standard_prompt_only"]

    def test_default_location(self, monkeypatch, tmp_path):
        monkeypatch.delenv("TRL_ASSETS_CACHE", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))
        assert assets._cache_root() == tmp_path / ".cache" / "trl" / "assets" / ("v1" + saved_files_suffix())

    def test_concurrent_builds_agree(self, fresh_cache):
        fresh_cache("concurrent")
        results, errors = [], []

        def build():
            try:
                results.append(get_dataset_path("standard_stepwise_supervision"))
            except Exception as error:  # pragma: no cover - surfaced by the assertion below
                errors.append(error)

        threads = [threading.Thread(target=build) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert len(set(results)) == 1
        path = Path(results[0])
        assert sum(1 for _ in open(path / "train.jsonl")) == 64
        assert [p.name for p in path.parent.iterdir()] == ["standard_stepwise_supervision"]

    def test_incomplete_directory_is_rebuilt(self, fresh_cache):
        root = fresh_cache("partial")
        partial = root / (assets.ASSETS_VERSION + saved_files_suffix()) / "datasets" / "standard_prompt_only"
        partial.mkdir(parents=True)
        (partial / "train.jsonl").write_text("garbage\n")
        path = Path(get_dataset_path("standard_prompt_only"))
        assert path == partial
        assert (path / ".complete").is_file()
        assert json.loads((path / "train.jsonl").read_text().splitlines()[0])["prompt"]

    @pytest.mark.parametrize(
        "getter, kind", [(get_model_path, "model"), (get_tokenizer_path, "tokenizer"), (get_dataset_path, "dataset")]
    )
    def test_unknown_names(self, getter, kind):
        with pytest.raises(ValueError, match=f"Unknown {kind} 'nope'. Expected one of"):
            getter("nope")

    @requires_qwen2_vl_processor  # build_all builds the tiny Qwen2-VL model too
    def test_build_all_and_main(self):
        paths = build_all()
        assert len(paths) == len(assets.TOKENIZER_NAMES) + len(assets.MODEL_NAMES) + len(assets.DATASET_NAMES)
        assert all(Path(p, ".complete").is_file() for p in paths.values())
        # Everything is cached now, so the module entry point only prints the paths.
        result = subprocess.run(
            [sys.executable, "-m", "trl.assets"], capture_output=True, text=True, check=True, env=dict(os.environ)
        )
        lines = result.stdout.strip().splitlines()
        assert lines[0] == f"tokenizers/qwen2_5: {paths['tokenizers/qwen2_5']}"
        assert len(lines) == len(paths)
