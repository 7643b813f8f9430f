"""Offline test assets: tiny tokenizers, random-weight models and small datasets, built locally and cached on disk.

Nothing here touches the network. Every asset is generated deterministically (fixed corpora, fixed seeds), so two
builds in different cache directories produce identical tokenizers, identical weights and identical data files.

Assets are built lazily on first use and cached under `$TRL_ASSETS_CACHE/<version>/` (default
`~/.cache/trl/assets/<version>/`). Each asset is built into a temporary directory next to its final location and
moved into place with an atomic rename, under a `filelock.FileLock`, so concurrent test workers (pytest-xdist) never
see a half-written asset.

Usage:

```python
from trl.assets import get_model_path, get_tokenizer_path, load_test_dataset

model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_path("qwen2_5"))
dataset = load_test_dataset("conversational_preference", split="train")
```

Run `python -m trl.assets` to build everything and print the paths.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict


# Bump whenever the content of any asset changes, so stale caches are never reused.
ASSETS_VERSION = "v1"

TOKENIZER_NAMES = ("qwen2_5", "llama3")

MODEL_NAMES = (
    "tiny-Qwen2ForCausalLM",
    "tiny-LlamaForCausalLM",
    "tiny-Qwen2ForSequenceClassification",
    "tiny-LlamaForSequenceClassification",
    "tiny-Qwen2ForTokenClassification",
    "tiny-LlamaForTokenClassification",
    "tiny-T5ForConditionalGeneration",
    "tiny-Qwen2MoeForCausalLM",
    "small-Qwen2ForCausalLM",
    # Vision-language models (built by trl/_assets_vlm.py): grid patches, fixed-size images, image tiles.
    "tiny-Qwen2VLForConditionalGeneration",
    "tiny-LlavaForConditionalGeneration",
    "tiny-Idefics3ForConditionalGeneration",
)

DATASET_NAMES = (
    "standard_language_modeling",
    "standard_prompt_only",
    "standard_prompt_completion",
    "standard_preference",
    "standard_implicit_prompt_preference",
    "standard_unpaired_preference",
    "standard_stepwise_supervision",
    "conversational_language_modeling",
    "conversational_prompt_only",
    "conversational_prompt_completion",
    "conversational_preference",
    "conversational_implicit_prompt_preference",
    "conversational_unpaired_preference",
    "conversational_language_modeling_tools",
    "length_skewed_language_modeling",
    # Image datasets (PIL images under `images`, or `image`), saved with `save_to_disk` by trl/_assets_vlm.py.
    "vision_conversational_language_modeling",
    "vision_conversational_prompt_completion",
    "vision_conversational_prompt_only",
    "vision_conversational_preference",
    "vision_conversational_unpaired_preference",
    "vision_standard_prompt_only",
)

_COMPLETE_MARKER = ".complete"


# ---------------------------------------------------------------------------------------------------------------------
# Cache handling
# ---------------------------------------------------------------------------------------------------------------------


def _cache_root() -> Path:
    base = os.environ.get("TRL_ASSETS_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "trl" / "assets"
    from ._compat import saved_files_suffix  # transformers 4 cannot read what transformers 5 saved: kept apart

    return root / f"{ASSETS_VERSION}{saved_files_suffix()}"


def offline_model_name(path: str | None) -> str | None:
    """The asset name (`tiny-Qwen2ForCausalLM`, ...) when `path` is one of the offline test models, else None."""
    if not path or not os.path.isdir(path):
        return None
    resolved = Path(path).resolve()
    # Wherever the cache lives (`$TRL_ASSETS_CACHE`, the repository's `.trl-assets`): `<root>/models/<name>`,
    # completed with the marker `_ensure_built` writes.
    if resolved.parent.name == "models" and (resolved / ".complete").is_file() and resolved.name in MODEL_NAMES:
        return resolved.name
    return None


def _ensure_built(kind: str, name: str, builder: Callable[[Path], None]) -> str:
    """Return the cached directory of an asset, building it first (once, across processes) when missing."""
    final = _cache_root() / kind / name
    if (final / _COMPLETE_MARKER).is_file():
        return str(final)

    from filelock import FileLock

    lock_dir = _cache_root() / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f"{kind}-{name}.lock"), timeout=900):
        # Another process may have finished the build while this one waited for the lock.
        if (final / _COMPLETE_MARKER).is_file():
            return str(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():  # no completion marker: an interrupted or hand-made directory, rebuild it
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700 directories; cached assets should be readable by everyone
        try:
            builder(tmp)
            (tmp / _COMPLETE_MARKER).write_text(ASSETS_VERSION + "\n")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(final)


def _check_name(name: str, allowed: tuple[str, ...], what: str) -> None:
    if name not in allowed:
        raise ValueError(f"Unknown {what} {name!r}. Expected one of: {', '.join(allowed)}.")


# ---------------------------------------------------------------------------------------------------------------------
# Deterministic text material shared by the tokenizer corpus and the datasets
# ---------------------------------------------------------------------------------------------------------------------

_COLOURS = [
    ("the sky", "sky", "blue", "green"),
    ("grass", "grass", "green", "purple"),
    ("snow", "snow", "white", "black"),
    ("coal", "coal", "black", "white"),
    ("a banana", "a banana", "yellow", "blue"),
    ("a strawberry", "a strawberry", "red", "grey"),
    ("a carrot", "a carrot", "orange", "blue"),
    ("a lemon", "a lemon", "yellow", "purple"),
    ("a plum", "a plum", "purple", "white"),
    ("chocolate", "chocolate", "brown", "green"),
    ("milk", "milk", "white", "red"),
    ("a tomato", "a tomato", "red", "blue"),
    ("a lime", "a lime", "green", "pink"),
    ("a cherry", "a cherry", "red", "white"),
    ("an emerald", "an emerald", "green", "orange"),
    ("a pumpkin", "a pumpkin", "orange", "blue"),
    ("a flamingo", "a flamingo", "pink", "green"),
    ("the ocean", "the ocean", "blue", "red"),
]

_CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Portugal", "Lisbon"),
    ("Greece", "Athens"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Poland", "Warsaw"),
    ("Ireland", "Dublin"),
    ("Austria", "Vienna"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Chile", "Santiago"),
    ("Cuba", "Havana"),
]

_YES_NO = [
    ("Is water wet?", True),
    ("Do fish live in water?", True),
    ("Can dogs fly?", False),
    ("Is ice cold?", True),
    ("Is fire cold?", False),
    ("Do cats bark?", False),
    ("Is the moon made of cheese?", False),
    ("Do birds have feathers?", True),
    ("Is two bigger than five?", False),
    ("Do plants need light?", True),
    ("Is the sun a star?", True),
    ("Can a stone swim?", False),
    ("Do cows give milk?", True),
    ("Is a week seven days long?", True),
    ("Is a square round?", False),
    ("Do trees have leaves?", True),
]

_SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly.", "You are a friendly tutor."]

# Word lists for the tokenizer corpus: broad enough that BPE finds a few thousand merges.
_NOUNS = (
    "cat dog bird fish horse cow sheep goat mouse rabbit lion tiger bear wolf fox deer owl eagle duck frog snake "
    "apple banana orange lemon grape cherry peach pear plum melon carrot potato tomato onion garlic pepper bread "
    "cheese butter milk water coffee tea juice soup rice pasta salad cake cookie sugar salt honey egg chicken "
    "house garden kitchen window door table chair bed lamp clock book pen paper letter phone computer screen "
    "keyboard program function variable number string list array matrix vector tensor model layer token "
    "teacher student doctor farmer driver pilot singer painter writer baker builder nurse scientist engineer "
    "city village river mountain forest desert ocean island valley lake bridge road street station market "
    "school library museum hospital office factory airport harbour castle tower church park beach field "
    "morning evening night summer winter spring autumn weekend holiday birthday journey story song game "
    "problem answer question idea reason result method system process theory example lesson exercise "
    "friend family mother father brother sister child baby neighbour stranger king queen prince princess "
    "car train plane boat bicycle bus truck ship rocket wheel engine battery light sound music picture"
).split()
_VERBS = (
    "runs walks jumps swims flies reads writes sings paints cooks bakes builds drives opens closes finds "
    "loses keeps gives takes makes brings sends buys sells watches hears sees knows thinks learns teaches "
    "helps plays works rests sleeps wakes starts stops moves carries holds pulls pushes throws catches "
    "counts adds computes solves explains describes answers asks calls visits leaves enters returns grows "
    "waits listens remembers forgets chooses changes fixes breaks cleans washes fills empties measures"
).split()
_ADJECTIVES = (
    "big small tall short long quick slow happy sad bright dark warm cold hot soft hard loud quiet old new "
    "young early late clean dirty empty full heavy light rich poor simple complex strange famous gentle "
    "brave clever kind calm busy lazy careful curious honest polite proud quiet round sharp smooth sweet "
    "sour bitter fresh green blue red yellow white black purple orange brown pink grey golden silver"
).split()
_ADVERBS = "quickly slowly happily quietly loudly carefully easily often always never sometimes rarely".split()
_PLACES = (
    "in the garden|near the river|at the station|on the mountain|in the kitchen|at school|in the city|"
    "by the lake|under the bridge|inside the museum|at the market|on the beach|in the forest|at home"
).split("|")
_TIMES = "today|yesterday|every morning|at night|in the evening|on Sunday|last year|next week|after lunch".split("|")
_NAMES = "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Maria Nina Oscar Paul Rosa Sam Tom".split()
_CODE_LINES = [
    "def add(a, b):\n    return a + b",
    "def multiply(a, b):\n    return a * b",
    "for i in range(10):\n    print(i)",
    "import numpy as np\nx = np.zeros((3, 4))",
    "import torch\ny = torch.ones(2, 2)",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y",
    'if value is None:\n    raise ValueError("value is required")',
    "result = [x * x for x in numbers if x % 2 == 0]",
    'with open("data.json") as f:\n    data = json.load(f)',
    "while count < limit:\n    count += 1",
    'return {"name": name, "arguments": arguments}',
    'print(f"The answer is {answer}.")',
]


def _pseudo_words(rng: random.Random, count: int) -> list[str]:
    # Made-up place and person names give BPE enough distinct material to learn a few thousand merges.
    onsets = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "sh", "ch", "th"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    codas = ["", "", "n", "r", "s", "l", "m", "nd", "rk"]
    words = []
    for _ in range(count):
        n_syllables = rng.randrange(2, 4)
        word = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(n_syllables))
        words.append(word.capitalize())
    return words


def _corpus() -> list[str]:
    """Deterministic English/maths/code corpus used to train the byte-level BPE tokenizers."""
    rng = random.Random(1234)
    lines: list[str] = []
    pseudo = _pseudo_words(rng, 3000)
    for i, word in enumerate(pseudo):
        other = pseudo[(i * 17 + 5) % len(pseudo)]
        lines.append(f"{word} is a {rng.choice(_ADJECTIVES)} town near {other}, where {rng.choice(_NAMES)} lives.")
        lines.append(f"In {word}, the {rng.choice(_NOUNS)} {rng.choice(_VERBS)} {rng.choice(_TIMES)}.")
    for _ in range(2500):
        kind = rng.randrange(6)
        name = rng.choice(_NAMES)
        noun, other = rng.choice(_NOUNS), rng.choice(_NOUNS)
        adj, verb = rng.choice(_ADJECTIVES), rng.choice(_VERBS)
        if kind == 0:
            lines.append(f"The {adj} {noun} {verb} {rng.choice(_PLACES)} {rng.choice(_TIMES)}.")
        elif kind == 1:
            lines.append(f"{name} {verb} the {noun} {rng.choice(_ADVERBS)}, and the {other} is {adj}.")
        elif kind == 2:
            a, b = rng.randrange(100), rng.randrange(100)
            op, val = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
            lines.append(f"What is {a} {op} {b}? The answer is {val}.")
        elif kind == 3:
            lines.append(f"Why does the {noun} {verb.rstrip('s')}? Because the {other} is {adj}.")
        elif kind == 4:
            lines.append(rng.choice(_CODE_LINES))
        else:
            lines.append(f'{name} said: "My {noun} is {adj}, and I like {other}s {rng.choice(_TIMES)}."')
    for subject, short, colour, _ in _COLOURS:
        lines.append(f"The colour of {subject} is {colour}. What colour is {short}? {short.capitalize()} is {colour}.")
    for country, city in _CAPITALS:
        lines.append(f"The capital of {country} is {city}. What is the capital of {country}?")
    for question, answer in _YES_NO:
        lines.append(f"Question: {question} Answer: {'Yes' if answer else 'No'}.")
    lines += [
        "You are a helpful assistant.",
        "system user assistant tool ipython",
        '{"name": "multiply", "arguments": {"a": 12, "b": 7}}',
        '{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {}}}',
        "<tools></tools> <tool_call></tool_call> <tool_response></tool_response>",
    ]
    return lines


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------------------

# Pre-tokenisation regexes in the style of the two families (Qwen splits digits one by one, Llama 3 in runs of 3).
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_TOKENIZER_SPECS: dict[str, dict[str, Any]] = {
    "qwen2_5": {
        "split": _QWEN_SPLIT,
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        # Like Qwen2.5, the tool tags are added tokens that are not special (they survive skip_special_tokens).
        "added": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        # Listed among the tokenizer's special tokens (`all_special_ids`), as in Qwen2.5's tokenizer config.
        "extra_special": ["<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "template": "tiny_qwen2_5.jinja",
        "model_max_length": 32768,
    },
    "llama3": {
        "split": _LLAMA_SPLIT,
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>",
            "<|reserved_special_token_2|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ]
        + [f"<|reserved_special_token_{i}|>" for i in range(3, 8)],
        "added": [],
        "extra_special": [],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": "<|finetune_right_pad_id|>",
        "template": "tiny_llama3.jinja",
        "model_max_length": 131072,
    },
}

# Total vocabulary size of each tokenizer (trained tokens + added tokens).
_TOKENIZER_VOCAB_SIZE = 4096


def _read_template(filename: str) -> str:
    return (Path(__file__).parent / "chat_templates" / filename).read_text()


def _build_tokenizer(name: str, out_dir: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from ._compat import decoder_tokenizer_kwargs, extra_special_tokens_kwargs

    spec = _TOKENIZER_SPECS[name]
    n_added = len(spec["special"]) + len(spec["added"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB_SIZE - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Added tokens go after the learned vocabulary, as in the real families (eos/pad get the highest ids).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    if spec["added"]:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    if spec["bos"] is not None:
        bos = spec["bos"]
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    kwargs = {"eos_token": spec["eos"], "pad_token": spec["pad"]}
    if spec["extra_special"]:
        kwargs.update(extra_special_tokens_kwargs(spec["extra_special"]))
    kwargs.update(decoder_tokenizer_kwargs())
    if spec["bos"] is not None:
        kwargs["bos_token"] = spec["bos"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=_read_template(spec["template"]),
        model_max_length=spec["model_max_length"],
        clean_up_tokenization_spaces=False,
        **kwargs,
    )
    tokenizer.save_pretrained(str(out_dir))


def get_tokenizer_path(name: str) -> str:
    """Return the directory of a locally built tokenizer, building it on first use.

    Args:
        name (`str`):
            Tokenizer family: `"qwen2_5"` (ChatML, eos `<|im_end|>`, pad `<|endoftext|>`, no bos) or `"llama3"`
            (bos `<|begin_of_text|>`, eos `<|eot_id|>`, pad `<|finetune_right_pad_id|>`).

    Returns:
        `str`: A directory loadable with `AutoTokenizer.from_pretrained`, with the family's chat template set.
    """
    _check_name(name, TOKENIZER_NAMES, "tokenizer")
    return _ensure_built("tokenizers", name, lambda out: _build_tokenizer(name, out))


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------

_TINY_DECODER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 2048}
# Qwen2 derives head_dim from hidden_size / heads, so one head gives head_dim 64 (vLLM needs 64).
_TINY_QWEN = {**_TINY_DECODER, "num_attention_heads": 1, "num_key_value_heads": 1}
_TINY_LLAMA = {**_TINY_DECODER, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}

# name -> (tokenizer family, config class, model class, config kwargs)
_MODEL_SPECS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "tiny-Qwen2ForCausalLM": ("qwen2_5", "Qwen2Config", "Qwen2ForCausalLM", _TINY_QWEN),
    "tiny-LlamaForCausalLM": ("llama3", "LlamaConfig", "LlamaForCausalLM", _TINY_LLAMA),
    "tiny-Qwen2ForSequenceClassification": (
        "qwen2_5",
        "Qwen2Config",
        "Qwen2ForSequenceClassification",
        {**_TINY_QWEN, "num_labels": 1},
    ),
    "tiny-LlamaForSequenceClassification": (
        "llama3",
        "LlamaConfig",
        "LlamaForSequenceClassification",
        {**_TINY_LLAMA, "num_labels": 1},
    ),
    "tiny-Qwen2ForTokenClassification": (
        "qwen2_5",
        "Qwen2Config",
        "Qwen2ForTokenClassification",
        {**_TINY_QWEN, "num_labels": 2},
    ),
    "tiny-LlamaForTokenClassification": (
        "llama3",
        "LlamaConfig",
        "LlamaForTokenClassification",
        {**_TINY_LLAMA, "num_labels": 2},
    ),
    "tiny-T5ForConditionalGeneration": (
        "qwen2_5",
        "T5Config",
        "T5ForConditionalGeneration",
        {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4},
    ),
    "tiny-Qwen2MoeForCausalLM": (
        "qwen2_5",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **_TINY_QWEN,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": True,
        },
    ),
    # ~30M parameters, for benchmarks.
    "small-Qwen2ForCausalLM": (
        "qwen2_5",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
        },
    ),
}


def _build_model(name: str, out_dir: Path) -> None:
    if name.endswith("ForConditionalGeneration") and name != "tiny-T5ForConditionalGeneration":
        from trl._assets_vlm import build_vlm_model, template_file

        build_vlm_model(name, out_dir, get_tokenizer_path("qwen2_5"), _read_template(template_file(name)))
        return
    import torch
    import transformers
    from transformers import AutoTokenizer, GenerationConfig

    family, config_cls_name, model_cls_name, config_kwargs = _MODEL_SPECS[name]
    tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_path(family))
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    if config_cls_name == "T5Config":
        ids["decoder_start_token_id"] = tokenizer.pad_token_id
    config = getattr(transformers, config_cls_name)(**ids, **config_kwargs)
    model_cls = getattr(transformers, model_cls_name)
    # Seed from the name so each model is reproducible on its own, whatever was built before it.
    torch.manual_seed(zlib.crc32(name.encode()))
    model = model_cls(config).eval()
    model.config.architectures = [model_cls_name]
    # Only generative models keep a generation config (save_pretrained drops it for the others anyway).
    if model.can_generate():
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **({"decoder_start_token_id": tokenizer.pad_token_id} if config_cls_name == "T5Config" else {}),
        )

    save_model_quietly(model, out_dir)
    tokenizer.save_pretrained(str(out_dir))


def save_model_quietly(model: Any, out_dir: Path) -> None:
    """`model.save_pretrained(out_dir)` without the shard-writing progress bar (noise in test logs)."""
    from transformers.utils import logging as hf_logging

    bars_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out_dir))
    finally:
        if bars_enabled:
            hf_logging.enable_progress_bar()


def get_model_path(name: str) -> str:
    """Return the directory of a locally built random-weight model, building it on first use.

    Args:
        name (`str`):
            One of `"tiny-Qwen2ForCausalLM"`, `"tiny-LlamaForCausalLM"`, `"tiny-Qwen2ForSequenceClassification"`,
            `"tiny-LlamaForSequenceClassification"`, `"tiny-Qwen2ForTokenClassification"`,
            `"tiny-LlamaForTokenClassification"`, `"tiny-T5ForConditionalGeneration"`, `"tiny-Qwen2MoeForCausalLM"`
            `"small-Qwen2ForCausalLM"` (about 30M parameters, for benchmarks), or one of the tiny vision-language
            models `"tiny-Qwen2VLForConditionalGeneration"`, `"tiny-LlavaForConditionalGeneration"`,
            `"tiny-Idefics3ForConditionalGeneration"` (their directories hold a processor instead of a tokenizer).

    Returns:
        `str`: A directory holding the config, generation config, seeded random weights and the tokenizer files, so
        that both `AutoModel*.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)` work.
    """
    _check_name(name, MODEL_NAMES, "model")
    return _ensure_built("models", name, lambda out: _build_model(name, out))


DIFFUSION_PIPELINE_NAMES = ("tiny-StableDiffusionPipeline",)


def get_diffusion_pipeline_path(name: str = "tiny-StableDiffusionPipeline") -> str:
    """Return the directory of a locally built random-weight Stable Diffusion pipeline (needs `diffusers`).

    Args:
        name (`str`, *optional*, defaults to `"tiny-StableDiffusionPipeline"`):
            The only pipeline: a tiny UNet, VAE and CLIP text encoder with a character-level CLIP tokenizer,
            a DDIM scheduler, 32x32 images.

    Returns:
        `str`: A directory loadable with `diffusers.StableDiffusionPipeline.from_pretrained`.
    """
    from ._diffusion_assets import build_tiny_stable_diffusion

    _check_name(name, DIFFUSION_PIPELINE_NAMES, "diffusion pipeline")
    return _ensure_built("pipelines", name, build_tiny_stable_diffusion)


# ---------------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------------


def _qa_items() -> list[dict[str, str]]:
    """Short facts, each with a standard (text continuation) and a conversational (question/answer) rendering."""
    items = []
    for subject, short, colour, wrong in _COLOURS:
        items.append(
            {
                "prompt": f"The colour of {subject} is",
                "good": f" {colour}.",
                "bad": f" {wrong}.",
                "question": f"What colour is {short}?",
                "answer": f"{short[0].upper() + short[1:]} is {colour}.",
                "wrong": f"{short[0].upper() + short[1:]} is {wrong}.",
            }
        )
    for i, (country, city) in enumerate(_CAPITALS):
        wrong = _CAPITALS[(i + 5) % len(_CAPITALS)][1]
        items.append(
            {
                "prompt": f"The capital of {country} is",
                "good": f" {city}.",
                "bad": f" {wrong}.",
                "question": f"What is the capital of {country}?",
                "answer": f"The capital of {country} is {city}.",
                "wrong": f"The capital of {country} is {wrong}.",
            }
        )
    rng = random.Random(7)
    for _ in range(24):
        a, b = rng.randrange(1, 20), rng.randrange(1, 20)
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        items.append(
            {
                "prompt": f"{a} + {b} =",
                "good": f" {a + b}",
                "bad": f" {wrong}",
                "question": f"What is {a} + {b}?",
                "answer": f"{a} + {b} = {a + b}.",
                "wrong": f"{a} + {b} = {wrong}.",
            }
        )
    for question, truth in _YES_NO:
        good, bad = ("Yes", "No") if truth else ("No", "Yes")
        items.append(
            {
                "prompt": f"Question: {question} Answer:",
                "good": f" {good}.",
                "bad": f" {bad}.",
                "question": question,
                "answer": f"{good}.",
                "wrong": f"{bad}.",
            }
        )
    rng = random.Random(11)
    rng.shuffle(items)
    # A few rejected answers are evasive rather than wrong, so "chosen is better" has more than one shape.
    for i, item in enumerate(items):
        if i % 7 == 3:
            item["bad"], item["wrong"] = " I don't know.", "I don't know."
    return items


def _split(rows: list[dict], n_test: int) -> dict[str, list[dict]]:
    return {"train": rows[:-n_test], "test": rows[-n_test:]}


def _conversation_prefix(i: int) -> list[dict[str, str]]:
    # Every third row starts with a system prompt.
    if i % 3 == 0:
        return [{"role": "system", "content": _SYSTEM_PROMPTS[(i // 3) % len(_SYSTEM_PROMPTS)]}]
    return []


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _standard_rows(name: str) -> list[dict]:
    items = _qa_items()
    if name == "standard_language_modeling":
        return [{"text": it["prompt"] + it["good"]} for it in items]
    if name == "standard_prompt_only":
        return [{"prompt": it["prompt"]} for it in items]
    if name == "standard_prompt_completion":
        return [{"prompt": it["prompt"], "completion": it["good"]} for it in items]
    if name == "standard_preference":
        return [{"prompt": it["prompt"], "chosen": it["good"], "rejected": it["bad"]} for it in items]
    if name == "standard_implicit_prompt_preference":
        return [{"chosen": it["prompt"] + it["good"], "rejected": it["prompt"] + it["bad"]} for it in items]
    if name == "standard_unpaired_preference":
        rng = random.Random(3)
        rows = []
        for it in items:
            label = rng.random() < 0.5
            rows.append({"prompt": it["prompt"], "completion": it["good"] if label else it["bad"], "label": label})
        return rows
    raise AssertionError(name)


def _conversational_rows(name: str) -> list[dict]:
    items = _qa_items()
    rows = []
    for i, it in enumerate(items):
        prompt = _conversation_prefix(i) + [_user(it["question"])]
        if name == "conversational_language_modeling":
            messages = prompt + [_assistant(it["answer"])]
            if i % 4 == 1:  # some multi-turn conversations
                nxt = items[(i + 1) % len(items)]
                messages += [_user(nxt["question"]), _assistant(nxt["answer"])]
            rows.append({"messages": messages})
        elif name == "conversational_prompt_only":
            rows.append({"prompt": prompt})
        elif name == "conversational_prompt_completion":
            rows.append({"prompt": prompt, "completion": [_assistant(it["answer"])]})
        elif name == "conversational_preference":
            rows.append(
                {"prompt": prompt, "chosen": [_assistant(it["answer"])], "rejected": [_assistant(it["wrong"])]}
            )
        elif name == "conversational_implicit_prompt_preference":
            rows.append(
                {"chosen": prompt + [_assistant(it["answer"])], "rejected": prompt + [_assistant(it["wrong"])]}
            )
        elif name == "conversational_unpaired_preference":
            label = (i * 7919) % 5 < 3  # deterministic mix of True / False
            completion = [_assistant(it["answer"] if label else it["wrong"])]
            rows.append({"prompt": prompt, "completion": completion, "label": label})
        else:
            raise AssertionError(name)
    return rows


def _stepwise_rows() -> list[dict]:
    rng = random.Random(5)
    rows = []
    for _ in range(76):
        terms = [rng.randrange(1, 10) for _ in range(rng.randrange(2, 6))]  # 1 to 4 steps
        error_at = rng.randrange(len(terms) - 1) if rng.random() < 0.4 else None
        total, steps, labels, ok = terms[0], [], [], True
        for k, term in enumerate(terms[1:]):
            value = total + term
            if k == error_at:
                value += rng.choice([-2, -1, 1, 2])
                ok = False
            steps.append(f"{total} + {term} = {value}")
            labels.append(ok)
            total = value
        rows.append({"prompt": "What is " + " + ".join(map(str, terms)) + "?", "completions": steps, "labels": labels})
    return rows


_TOOL_OPS = {"add": ("plus", "Add two integers.", lambda a, b: a + b),
             "multiply": ("times", "Multiply two integers.", lambda a, b: a * b),
             "subtract": ("minus", "Subtract the second integer from the first.", lambda a, b: a - b)}  # fmt: skip


def _tool_schema(name: str) -> dict:
    # Every tool takes the same two integer arguments, so the Arrow struct types stay identical across rows.
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": _TOOL_OPS[name][1],
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first integer."},
                    "b": {"type": "integer", "description": "The second integer."},
                },
                "required": ["a", "b"],
            },
        },
    }


def _tool_rows() -> list[dict]:
    rng = random.Random(9)
    tools = [_tool_schema(n) for n in _TOOL_OPS]
    rows = []
    for i in range(60):
        messages = _conversation_prefix(i)
        op = rng.choice(list(_TOOL_OPS))
        word, _, fn = _TOOL_OPS[op]
        a, b = rng.randrange(2, 50), rng.randrange(2, 20)
        if i % 5 == 4:  # plain answer without a tool call
            messages += [_user(f"Say hello to {rng.choice(_NAMES)}."), _assistant("Hello!")]
        elif i % 5 == 2:  # two calls in one assistant turn
            c, d = rng.randrange(2, 50), rng.randrange(2, 20)
            messages += [
                _user(f"What are {a} {word} {b} and {c} {word} {d}?"),
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": op, "arguments": {"a": a, "b": b}}},
                        {"type": "function", "function": {"name": op, "arguments": {"a": c, "b": d}}},
                    ],
                },
                {"role": "tool", "name": op, "content": str(fn(a, b))},
                {"role": "tool", "name": op, "content": str(fn(c, d))},
                _assistant(f"{a} {word} {b} is {fn(a, b)}, and {c} {word} {d} is {fn(c, d)}."),
            ]
        else:
            messages += [
                _user(f"What is {a} {word} {b}?"),
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": op, "arguments": {"a": a, "b": b}}}],
                },
                {"role": "tool", "name": op, "content": str(fn(a, b))},
                _assistant(f"{a} {word} {b} is {fn(a, b)}."),
            ]
        rows.append({"messages": messages, "tools": tools})
    return rows


def _length_skewed_rows() -> list[dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(get_tokenizer_path("qwen2_5")) / "tokenizer.json"))
    sentences = _corpus()
    rng = random.Random(21)
    rows = []
    for i in range(544):
        # Mostly short rows, some medium ones, a few long ones (up to ~1024 tokens).
        r = rng.random()
        if i == 0:
            target = 1000
        elif r < 0.75:
            target = rng.randrange(8, 64)
        elif r < 0.95:
            target = rng.randrange(64, 256)
        else:
            target = rng.randrange(256, 1024)
        parts, n_tokens = [], 0
        while n_tokens < target:
            sentence = rng.choice(sentences)
            parts.append(sentence)
            n_tokens += len(tok.encode(" " + sentence).ids)
        text = " ".join(parts)
        ids = tok.encode(text).ids[:target]
        rows.append({"text": tok.decode(ids).strip() or parts[0]})
    return rows


def _dataset_splits(name: str) -> dict[str, list[dict]]:
    if name.startswith("standard_") and name != "standard_stepwise_supervision":
        return _split(_standard_rows(name), 12)
    if name == "standard_stepwise_supervision":
        return _split(_stepwise_rows(), 12)
    if name == "conversational_language_modeling_tools":
        return _split(_tool_rows(), 12)
    if name == "length_skewed_language_modeling":
        return _split(_length_skewed_rows(), 32)
    return _split(_conversational_rows(name), 12)


def _build_dataset(name: str, out_dir: Path) -> None:
    if name.startswith("vision_"):
        from trl._assets_vlm import build_vision_dataset

        build_vision_dataset(name, out_dir)
        return
    for split, rows in _dataset_splits(name).items():
        with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


def get_dataset_path(name: str) -> str:
    """Return the directory holding the `train.jsonl` and `test.jsonl` files of a test dataset, building it if needed.

    Args:
        name (`str`):
            Dataset config name, e.g. `"standard_preference"` or `"conversational_language_modeling"` (the config
            names of the hub's `trl-internal-testing/zen`, plus `"conversational_language_modeling_tools"` and
            `"length_skewed_language_modeling"`).

    Returns:
        `str`: The dataset directory.
    """
    _check_name(name, DATASET_NAMES, "dataset")
    return _ensure_built("datasets", name, lambda out: _build_dataset(name, out))


def load_test_dataset(config_name: str, split: str | None = None) -> Dataset | DatasetDict:
    """Load a test dataset offline from its local files.

    Args:
        config_name (`str`):
            Dataset config name (see [`get_dataset_path`]).
        split (`str` or `None`, *optional*, defaults to `None`):
            `"train"` or `"test"`; `None` returns a `DatasetDict` with both splits.

    Returns:
        [`~datasets.Dataset`] or [`~datasets.DatasetDict`]: The requested split(s).
    """
    from datasets import load_dataset

    if split is not None and split not in ("train", "test"):
        raise ValueError(
            f"Unknown split {split!r} for test dataset {config_name!r}; expected 'train', 'test' or None."
        )
    path = Path(get_dataset_path(config_name))
    if config_name.startswith("vision_"):  # images do not fit in JSON lines: an Arrow `save_to_disk` directory
        from datasets import load_from_disk

        data = load_from_disk(str(path / "data"))
        return data if split is None else data[split]
    data_files = {"train": str(path / "train.jsonl"), "test": str(path / "test.jsonl")}
    return load_dataset("json", data_files=data_files, split=split, cache_dir=str(_cache_root() / "hf_datasets_cache"))


def build_all() -> dict[str, str]:
    """Build (or find in the cache) every tokenizer, model and dataset.

    Returns:
        `dict[str, str]`: Mapping from `"<kind>/<name>"` to the asset's directory.
    """
    paths = {}
    for name in TOKENIZER_NAMES:
        paths[f"tokenizers/{name}"] = get_tokenizer_path(name)
    for name in MODEL_NAMES:
        paths[f"models/{name}"] = get_model_path(name)
    for name in DATASET_NAMES:
        paths[f"datasets/{name}"] = get_dataset_path(name)
    return paths


if __name__ == "__main__":
    for key, value in build_all().items():
        print(f"{key}: {value}")
