"""Language models with a scalar value head, for PPO-style training.

[`PreTrainedModelWrapper`] wraps a transformers (or PEFT) model and handles loading and saving the extra modules
next to it; [`AutoModelForCausalLMWithValueHead`] and [`AutoModelForSeq2SeqLMWithValueHead`] add a [`ValueHead`]
reading the last hidden state, so that one forward pass returns the LM logits and one value per token.

Saved format: without PEFT, the value head's weights are written into the model's own weight file under the
`v_head.` prefix; with PEFT, the adapter is saved as usual and the head goes to `pytorch_model.bin` beside it.
"""

import json
import os
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, PreTrainedModel

from ..._compat import cache_kwargs, output_cache


# Files that may hold the value head, in the order they are looked for.
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _load_weight_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _head_state_dict(directory: str, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of a saved checkpoint whose names start with one of `prefixes` (only the shards holding them are
    read); empty when the directory has no such tensors."""
    for index_name in _INDEX_FILES:
        index_path = os.path.join(directory, index_name)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted({shard for name, shard in weight_map.items() if name.startswith(prefixes)})
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(_load_weight_file(os.path.join(directory, shard)))
            return {k: v for k, v in state.items() if k.startswith(prefixes)}
    for file_name in _WEIGHT_FILES:
        path = os.path.join(directory, file_name)
        if os.path.isfile(path):
            state = _load_weight_file(path)
            heads = {k: v for k, v in state.items() if k.startswith(prefixes)}
            if heads:
                return heads
    return {}


class ValueHead(nn.Module):
    """A linear layer mapping each hidden state to one scalar value, after an optional dropout.

    Args:
        config: The wrapped model's config; the hidden size is read from `word_embed_proj_dim`, `hidden_size`,
            `text_config.hidden_size` or `decoder.hidden_size`, and `summary_dropout_prob` from it when present.
        summary_dropout_prob: Dropout before the linear layer (default: the config's value, else 0.1; 0 disables).
    """

    def __init__(self, config: Any, **kwargs: Any):
        super().__init__()
        if "summary_dropout_prob" in kwargs:
            dropout = kwargs.pop("summary_dropout_prob")
        else:
            dropout = getattr(config, "summary_dropout_prob", 0.1)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.summary = nn.Linear(self._hidden_size(config), 1)
        self.flatten = nn.Flatten()

    @staticmethod
    def _hidden_size(config: Any) -> int:
        if getattr(config, "word_embed_proj_dim", None) is not None:
            return config.word_embed_proj_dim
        if getattr(config, "hidden_size", None) is not None:
            return config.hidden_size
        for sub in ("text_config", "decoder"):
            sub_config = getattr(config, sub, None)
            if getattr(sub_config, "hidden_size", None) is not None:
                return sub_config.hidden_size
        if getattr(config, "d_model", None) is not None:
            return config.d_model
        raise ValueError(
            f"Cannot find the hidden size of {type(config).__name__} (looked for word_embed_proj_dim, hidden_size, "
            "text_config.hidden_size, decoder.hidden_size and d_model)."
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = self.dropout(hidden_states)
        # The head may be kept in float32 while the model runs in half precision.
        if output.dtype != self.summary.weight.dtype:
            output = output.to(self.summary.weight.dtype)
        return self.summary(output)


class PreTrainedModelWrapper(nn.Module):
    """Wraps a transformers model (optionally a PEFT model) with extra modules saved and loaded alongside it.

    Subclasses set `transformers_parent_class` (the `AutoModel*` class loading the base) and `supported_args`
    (keyword arguments of `from_pretrained` meant for the wrapper rather than the base model).

    Args:
        pretrained_model: The wrapped model.
        score_module: Reward head used by [`compute_reward_score`] with a reward-modelling adapter.
        supports_rm_adapter: Whether a reward-modelling PEFT adapter is loaded (`reward_adapter` of
            `from_pretrained`).
        rm_adapter_name: Name of that adapter.
    """

    transformers_parent_class: Any = None
    supported_args: tuple[str, ...] = ()
    supported_modules: tuple[str, ...] = ("v_head",)
    supported_rm_modules: tuple[str, ...] = ("score",)
    supported_pretrained_model_architectures: tuple[type, ...] = (PreTrainedModel,)

    def __init__(
        self,
        pretrained_model: nn.Module | None = None,
        score_module: nn.Module | None = None,
        supports_rm_adapter: bool = False,
        rm_adapter_name: str | None = None,
        **kwargs: Any,
    ):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.config = pretrained_model.config
        self.prepare_inputs_for_generation = getattr(pretrained_model, "prepare_inputs_for_generation", None)
        self.is_loaded_in_8bit = getattr(pretrained_model, "is_loaded_in_8bit", False)
        self.is_loaded_in_4bit = getattr(pretrained_model, "is_loaded_in_4bit", False)
        self.is_sequential_parallel = False
        if hasattr(pretrained_model, "gradient_checkpointing_disable"):
            self.gradient_checkpointing_disable = pretrained_model.gradient_checkpointing_disable
        if hasattr(pretrained_model, "gradient_checkpointing_enable"):
            self.gradient_checkpointing_enable = pretrained_model.gradient_checkpointing_enable
        self.supports_rm_adapter = supports_rm_adapter
        self.rm_adapter_name = rm_adapter_name
        self.policy_adapter_name = "default"
        if score_module is not None:
            self.score = score_module

    @property
    def is_peft_model(self) -> bool:
        return _is_peft_model(self.pretrained_model)

    # ------------------------------------------------------------------------------------------------------------
    # Loading
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def _split_kwargs(cls, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """`(wrapper_kwargs, base_model_kwargs, peft_kwargs)`: the wrapper's `supported_args`, the rest for the base
        model's `from_pretrained`, and the PEFT loading options (`is_trainable`, `token`, `revision`...)."""
        wrapper_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in cls.supported_args}
        peft_keys = ("is_trainable", "adapter_name")
        peft_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in peft_keys}
        for shared in ("token", "revision", "cache_dir"):
            if shared in kwargs:
                peft_kwargs[shared] = kwargs[shared]
        return wrapper_kwargs, kwargs, peft_kwargs

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any):
        """Load the base model (or take a given one), wrap it and restore the wrapper's saved modules.

        Args:
            pretrained_model_name_or_path: A path or hub id (a saved full model, or a saved PEFT adapter whose base
                is loaded from its `base_model_name_or_path`), or an already instantiated model.
            *model_args: Passed to the base model's `from_pretrained`.
            **kwargs: `supported_args` go to the wrapper (e.g. `summary_dropout_prob`); `peft_config` wraps the base
                in a new adapter; `reward_adapter` (+ `reward_adapter_name`) loads a reward-modelling adapter for
                [`compute_reward_score`]; `is_trainable` applies to a loaded adapter; the rest goes to the base
                model's `from_pretrained`.

        Returns:
            The wrapper, with its value head restored from the checkpoint when one was saved there.
        """
        peft_config = kwargs.pop("peft_config", None)
        reward_adapter = kwargs.pop("reward_adapter", None)
        reward_adapter_name = kwargs.pop("reward_adapter_name", "reward_adapter")
        wrapper_kwargs, model_kwargs, peft_kwargs = cls._split_kwargs(dict(kwargs))
        peft_kwargs.setdefault("is_trainable", True)

        checkpoint_dir = None
        if isinstance(pretrained_model_name_or_path, str):
            checkpoint_dir = cls._local_directory(pretrained_model_name_or_path, model_kwargs)
            adapter_config = os.path.join(checkpoint_dir or "", "adapter_config.json")
            if checkpoint_dir is not None and os.path.isfile(adapter_config):
                from peft import PeftModel

                with open(adapter_config) as f:
                    base_path = json.load(f)["base_model_name_or_path"]
                base = cls.transformers_parent_class.from_pretrained(base_path, *model_args, **model_kwargs)
                if peft_config is not None:
                    raise ValueError(
                        f"{pretrained_model_name_or_path!r} already holds a PEFT adapter, and peft_config was given "
                        "too. Pass one of them."
                    )
                pretrained_model = PeftModel.from_pretrained(
                    base, checkpoint_dir, is_trainable=peft_kwargs["is_trainable"]
                )
            else:
                pretrained_model = cls.transformers_parent_class.from_pretrained(
                    pretrained_model_name_or_path, *model_args, **model_kwargs
                )
        elif isinstance(pretrained_model_name_or_path, nn.Module):
            pretrained_model = pretrained_model_name_or_path
        else:
            raise TypeError(
                "pretrained_model_name_or_path must be a path, a hub id or a model instance; got "
                f"{type(pretrained_model_name_or_path).__name__}."
            )

        if peft_config is not None and not _is_peft_model(pretrained_model):
            from peft import get_peft_model

            pretrained_model = get_peft_model(pretrained_model, peft_config)

        score_module = None
        if reward_adapter is not None:
            if not _is_peft_model(pretrained_model):
                raise ValueError(
                    "reward_adapter needs a PEFT policy (the reward adapter is loaded next to the policy's adapter): "
                    "pass peft_config, or load a saved adapter."
                )
            score_module = cls.add_and_load_reward_modeling_adapter(
                pretrained_model, reward_adapter, reward_adapter_name, token=model_kwargs.get("token")
            )
        model = cls(
            pretrained_model,
            score_module=score_module,
            supports_rm_adapter=reward_adapter is not None,
            rm_adapter_name=reward_adapter_name if reward_adapter is not None else None,
            **wrapper_kwargs,
        )
        state = (
            _head_state_dict(checkpoint_dir, tuple(f"{m}." for m in cls.supported_modules)) if checkpoint_dir else {}
        )
        model.post_init(state)
        return model

    @staticmethod
    def _local_directory(name_or_path: str, model_kwargs: dict[str, Any]) -> str | None:
        """The local directory of a checkpoint: the path itself, or a hub snapshot (None if neither is found)."""
        if os.path.isdir(name_or_path):
            return name_or_path
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(
                name_or_path,
                revision=model_kwargs.get("revision"),
                token=model_kwargs.get("token"),
                cache_dir=model_kwargs.get("cache_dir"),
                allow_patterns=["*.json", "*.safetensors", "*.bin"],
            )
        except Exception:  # noqa: BLE001 - no local copy: the base model's loader reports the real error
            return None

    @classmethod
    def add_and_load_reward_modeling_adapter(
        cls,
        pretrained_model: nn.Module,
        adapter_model_id: str,
        adapter_name: str = "reward_model_adapter",
        token: str | None = None,
    ) -> nn.Module:
        """Load a reward-modelling PEFT adapter next to the policy's and return its score head as a frozen module.

        The adapter checkpoint must hold the reward head's weights (`score.weight`, optionally `score.bias`), as a
        [`RewardTrainer`] run with PEFT saves them.
        """
        directory = cls._local_directory(adapter_model_id, {"token": token})
        if directory is None:
            raise ValueError(f"Could not find the reward adapter {adapter_model_id!r} locally or on the hub.")
        pretrained_model.load_adapter(directory, adapter_name, is_trainable=False)
        pretrained_model.set_adapter("default")
        state: dict[str, torch.Tensor] = {}
        for file_name in ("adapter_model.safetensors", "adapter_model.bin"):
            path = os.path.join(directory, file_name)
            if os.path.isfile(path):
                state = _load_weight_file(path)
                break
        score = {}
        for name, tensor in state.items():
            for module in cls.supported_rm_modules:
                if f"{module}." in name:
                    score[name.split(f"{module}.")[-1].replace("modules_to_save.default.", "")] = tensor
        if "weight" not in score:
            raise ValueError(
                f"The reward adapter {adapter_model_id!r} holds no score head weights (expected a 'score.weight' "
                f"tensor; found {sorted(state)[:8]}...). Save the reward model with its head in modules_to_save."
            )
        num_labels, hidden_size = score["weight"].shape
        head = nn.Linear(hidden_size, num_labels, bias="bias" in score)
        head.load_state_dict(score)
        device = next(pretrained_model.parameters()).device
        head = head.to(device=device, dtype=next(pretrained_model.parameters()).dtype)
        for param in head.parameters():
            param.requires_grad = False
        return head

    def post_init(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore the wrapper's own modules from `state_dict` (names with or without their module prefix)."""

    def compute_reward_score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """Score sequences with the reward-modelling adapter loaded by `from_pretrained(reward_adapter=...)`.

        Switches to the reward adapter, returns the score head's output at every position (`(B, L, num_labels)`)
        and switches back to `ppo_adapter_name` (default: the policy's adapter).
        """
        if not self.supports_rm_adapter:
            raise ValueError(
                "This model has no reward adapter: load it with from_pretrained(..., reward_adapter=<adapter path>)."
            )
        ppo_adapter_name = kwargs.pop("ppo_adapter_name", None) or self.policy_adapter_name
        self.pretrained_model.set_adapter(self.rm_adapter_name)
        try:
            with torch.no_grad():
                output = self.pretrained_model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    output_hidden_states=True,
                    return_dict=True,
                    **kwargs,
                )
                hidden = output.hidden_states[-1]
                return self.score(hidden.to(self.score.weight.dtype))
        finally:
            self.pretrained_model.set_adapter(ppo_adapter_name)

    # ------------------------------------------------------------------------------------------------------------
    # Saving
    # ------------------------------------------------------------------------------------------------------------
    def _wrapper_state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """The base model's weights (none for a PEFT model, whose adapter is saved by PEFT) plus the wrapper's own
        modules under their prefix (`v_head.summary.weight`, ...)."""
        state = {} if self.is_peft_model else dict(self.pretrained_model.state_dict(*args, **kwargs))
        state.update(self._wrapper_state_dict())
        return state

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        """Save the base model and the wrapper's modules (see the module docstring for the layout)."""
        state_dict = kwargs.pop("state_dict", None)
        if state_dict is None:
            state_dict = self.state_dict()
        if self.is_peft_model:
            directory = args[0] if args else kwargs["save_directory"]
            os.makedirs(directory, exist_ok=True)
            torch.save(state_dict, os.path.join(directory, "pytorch_model.bin"))
            return self.pretrained_model.save_pretrained(*args, **kwargs)
        return self.pretrained_model.save_pretrained(*args, state_dict=state_dict, **kwargs)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
    ) -> Any:
        """Upload what `save_pretrained` writes (base model or adapter, and the value head) to the hub repo."""
        import tempfile

        from huggingface_hub import create_repo, upload_folder

        repo_id = create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as directory:
            self.save_pretrained(directory)
            return upload_folder(
                repo_id=repo_id,
                folder_path=directory,
                commit_message=commit_message or "Upload model with value head",
                token=token,
                revision=revision,
                create_pr=create_pr,
            )

    def _get_current_device(self) -> torch.device:
        return next(self.pretrained_model.parameters()).device


class _ValueHeadModel(PreTrainedModelWrapper):
    """What the causal and the seq2seq value-head models share: the head, its init and its saving."""

    supported_args = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")
    lm_head_namings = ["lm_head", "embed_out", "output_projection"]

    def __init__(self, pretrained_model: nn.Module, **kwargs: Any):
        head_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in self.supported_args}
        unknown = set(kwargs) - {"score_module", "supports_rm_adapter", "rm_adapter_name"}
        if unknown:
            raise TypeError(f"Unexpected arguments {sorted(unknown)}; supported: {list(self.supported_args)}.")
        super().__init__(pretrained_model, **kwargs)
        if not self._has_lm_head():
            raise ValueError(
                f"{type(pretrained_model).__name__} has no language-model head (none of {self.lm_head_namings}); "
                f"{type(self).__name__} needs one (load it with {self.transformers_parent_class.__name__})."
            )
        dropout = (
            {"summary_dropout_prob": head_kwargs["summary_dropout_prob"]}
            if "summary_dropout_prob" in head_kwargs
            else {}
        )
        self.v_head = ValueHead(self.pretrained_model.config, **dropout)
        self._init_weights(**head_kwargs)

    def _has_lm_head(self) -> bool:
        model = self.pretrained_model
        candidates = [
            model,
            getattr(model, "base_model", None),
            getattr(getattr(model, "base_model", None), "model", None),
        ]
        return any(hasattr(m, name) for m in candidates if m is not None for name in self.lm_head_namings)

    def _init_weights(self, **kwargs: Any) -> None:
        """`v_head_init_strategy=None` keeps PyTorch's default init; `"normal"` draws the weights from
        N(0, `v_head_initializer_range`) (default 0.2) and zeroes the bias."""
        strategy = kwargs.get("v_head_init_strategy")
        if strategy is None:
            return
        if strategy != "normal":
            raise ValueError(f"v_head_init_strategy must be None or 'normal'; got {strategy!r}.")
        self.v_head.summary.weight.data.normal_(mean=0.0, std=kwargs.get("v_head_initializer_range", 0.2))
        self.v_head.summary.bias.data.zero_()

    def post_init(self, state_dict: dict[str, torch.Tensor]) -> None:
        head = {k.split("v_head.", 1)[-1]: v for k, v in state_dict.items() if k.startswith("v_head.")}
        if head:
            self.v_head.load_state_dict(head)
        self.v_head.to(self._get_current_device())

    def _wrapper_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"v_head.{k}": v for k, v in self.v_head.state_dict().items()}

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Generate with the wrapped model (the value head is not involved)."""
        return self.pretrained_model.generate(*args, **kwargs)

    # Output attribute holding the hidden states the value head reads (the decoder's for encoder-decoders).
    _hidden_states_attr = "hidden_states"

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        attention_mask: torch.Tensor | None = None,
        return_past_key_values: bool = False,
        **kwargs: Any,
    ) -> tuple:
        """`(lm_logits, loss, values)`, plus the cache with `return_past_key_values=True`; extra keyword arguments
        (`labels`, `decoder_input_ids`, `position_ids`...) go to the wrapped model."""
        kwargs["output_hidden_states"] = True
        if past_key_values is not None:
            kwargs.update(cache_kwargs(self.pretrained_model, past_key_values))
        outputs = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = getattr(outputs, self._hidden_states_attr)[-1]
        if hidden_states.device != self.v_head.summary.weight.device:
            hidden_states = hidden_states.to(self.v_head.summary.weight.device)
        value = self.v_head(hidden_states).squeeze(-1)
        lm_logits = outputs.logits
        if lm_logits.dtype != torch.float32:
            lm_logits = lm_logits.float()
        if return_past_key_values:
            return lm_logits, outputs.loss, value, output_cache(outputs)
        return lm_logits, outputs.loss, value


class AutoModelForCausalLMWithValueHead(_ValueHeadModel):
    """A causal LM with a [`ValueHead`] on its last hidden state.

    `forward` returns `(lm_logits, loss, values)`: float32 logits `(B, L, V)`, the LM loss when `labels` are given
    (else None) and one value per token `(B, L)`; plus the cache with `return_past_key_values=True`.

    Args:
        pretrained_model: The causal LM (or a PEFT model around one).
        summary_dropout_prob: Dropout before the value head (default 0.1, or the config's value).
        v_head_init_strategy: `None` (default init) or `"normal"`.
        v_head_initializer_range: Standard deviation of the `"normal"` init (default 0.2).
    """

    transformers_parent_class = AutoModelForCausalLM


class AutoModelForSeq2SeqLMWithValueHead(_ValueHeadModel):
    """An encoder-decoder LM with a [`ValueHead`] on the decoder's last hidden state.

    `forward` returns `(lm_logits, loss, values)` like [`AutoModelForCausalLMWithValueHead`], values being per
    decoder position.
    """

    transformers_parent_class = AutoModelForSeq2SeqLM
    _hidden_states_attr = "decoder_hidden_states"
