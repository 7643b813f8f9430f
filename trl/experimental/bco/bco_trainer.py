"""Binary Classifier Optimization (BCO) trainer, with optional Underlying Distribution Matching (UDM).

BCO treats alignment as binary classification: the implied reward `r = beta * log(pi / pi_ref)` is the logit of a
classifier that maps (prompt, desirable completion) to 1 and (prompt, undesirable completion) to 0, shifted by the
running mean `delta` of all rewards seen so far. UDM reweights undesirable examples by the density ratio
`p(prompt | desirable) / p(prompt | undesirable)`, estimated with a logistic-regression classifier on prompt
embeddings, so that differing prompt distributions of the two classes do not bias training.

The data preparation, collator, policy and reference passes and metrics are shared with the KTO trainer
(`trl/trainer/unpaired_preference_base.py`).
"""

import contextlib
import importlib.util
import json
import logging
import os
import random
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset, IterableDataset
from transformers import (
    BaseImageProcessor,
    FeatureExtractionMixin,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
    TrainerCallback,
)
from transformers.trainer_utils import EvalLoopOutput

from ...data_utils import get_dataset_column_names
from ...import_utils import is_comet_available, is_sklearn_available, is_wandb_available
from ...trainer.unpaired_preference_base import DataCollatorForUnpairedPreference, _UnpairedPreferenceTrainer
from ...trainer.utils import (
    log_table_to_comet_experiment,
    selective_log_softmax,
    use_adapter,
)
from ...trainer.utils.ignored_options import BCO_IGNORED_OPTIONS
from ...trainer.utils.logprobs import summed_logits_from_hidden
from ..utils import load_causal_lm
from .bco_columns import _BCO_TOKEN_COLUMNS, _UDM_COLUMN, _FromBCOColumns, _ToBCOColumns, _WithUDMWeights
from .bco_config import BCOConfig


logger = logging.getLogger(__name__)

RUNNING_NAME = "running.json"
CLF_NAME = "clf.pkl"
CLF_STATE_NAME = "clf.json"


# ----------------------------------------------------------------------------------------------------------------
# Running reward moments (the delta of BCO)
# ----------------------------------------------------------------------------------------------------------------
class RunningMoments:
    """Running mean and variance of every value passed to `update`, pooled across processes.

    Args:
        accelerator: Optional `accelerate.Accelerator`; values of all processes are combined at each update.
    """

    def __init__(self, accelerator: Any = None):
        self.accelerator = accelerator
        self.mean = 0.0
        self.var = 1.0
        self.std = 1.0
        self.count = 1e-24

    @torch.no_grad()
    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Fold the values `xs` (of every process) into the moments; return the batch's mean and std."""
        xs = xs.detach().double().reshape(-1)
        stats = torch.stack([xs.sum(), (xs**2).sum(), xs.new_tensor(float(xs.numel()))])
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            stats = self.accelerator.reduce(stats.to(self.accelerator.device), reduction="sum")
        total, total_sq, count = (float(v) for v in stats.tolist())
        if count == 0:
            return self.mean, self.std
        batch_mean = total / count
        batch_var = max(total_sq / count - batch_mean**2, 0.0)
        # Parallel (Chan et al.) combination of the two sets of moments.
        delta = batch_mean - self.mean
        tot_count = self.count + count
        m2 = self.var * self.count + batch_var * count + delta**2 * self.count * count / tot_count
        self.mean += delta * count / tot_count
        self.var = m2 / tot_count
        self.std = (self.var * tot_count / max(tot_count - 1, 1)) ** 0.5
        self.count = tot_count
        return batch_mean, (batch_var * count / max(count - 1, 1)) ** 0.5

    def save_to_json(self, json_path: str) -> None:
        """Write the moments to `json_path` (main process only when an accelerator is set)."""
        if self.accelerator is None or self.accelerator.is_main_process:
            with open(json_path, "w", encoding="utf-8") as f:
                json.dump({"mean": self.mean, "var": self.var, "std": self.std, "count": self.count}, f, indent=2)

    @classmethod
    def load_from_json(cls, accelerator: Any, json_path: str) -> "RunningMoments":
        """Moments saved by [`save_to_json`]."""
        with open(json_path, encoding="utf-8") as f:
            values = json.load(f)
        moments = cls(accelerator)
        for key in ("mean", "var", "std", "count"):
            setattr(moments, key, float(values[key]))
        return moments


# Token columns of a prepared BCO dataset, in TRL 1.12's order (after its raw `prompt`, `completion`, `label`).
# ----------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------
class BCOTrainer(_UnpairedPreferenceTrainer):
    """Trainer for Binary Classifier Optimization (BCO), with optional Underlying Distribution Matching (UDM).

    Each example is a prompt, a completion and a boolean label. Desirable completions lose
    `-log sigmoid(r - delta)` and undesirable ones `-log sigmoid(-(r - delta))`, with `r = beta * log(pi / pi_ref)`
    and `delta` the running mean of every reward seen in training (pooled across processes; it includes the current
    batch and is frozen during evaluation). With UDM, undesirable losses are weighted by the density ratio of their
    prompt, clamped to `[min_density_ratio, max_density_ratio]`.

    Example:

    ```python
    from trl.experimental.bco import BCOConfig, BCOTrainer
    from trl.assets import get_model_path, load_test_dataset

    trainer = BCOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=BCOConfig(output_dir="bco-out", max_steps=5),
        train_dataset=load_test_dataset("standard_unpaired_preference", split="train"),
    )
    trainer.train()
    ```

    Args:
        model (`PreTrainedModel`, `torch.nn.Module` or `str`):
            Causal language model to train, or a path / hub id loaded with `AutoModelForCausalLM.from_pretrained` and
            `args.model_init_kwargs`.
        ref_model (`PreTrainedModel`, `torch.nn.Module`, `str` or `None`, defaults to `None`):
            Reference model. `None` uses a frozen copy of `model`, or, with a PEFT model, the model with its adapters
            disabled (or `ref_adapter_name`), and none at all with `precompute_ref_log_probs=True`.
        args (`BCOConfig` or `None`, defaults to `None`):
            Training configuration. `None` builds `BCOConfig(f"{model_name}-BCO")`.
        train_dataset (`Dataset`):
            Unpaired preference data (`prompt`, `completion`, boolean `label`), standard or conversational (paired
            `chosen` / `rejected` data is unpaired automatically), or pre-tokenized `prompt_ids`, `completion_ids`,
            `label`.
        eval_dataset (`Dataset`, dict of them or `None`, defaults to `None`):
            Evaluation data in the same formats.
        processing_class (`PreTrainedTokenizerBase` or `ProcessorMixin` or `None`, defaults to `None`):
            Tokenizer; loaded from the model's path when omitted.
        data_collator (`DataCollator` or `None`, defaults to `None`):
            Batch collator; defaults to `trl.trainer.kto_trainer.DataCollatorForUnpairedPreference`.
        model_init (`Callable[[], PreTrainedModel]` or `None`, defaults to `None`):
            Builds the model when `model` is None (called once, when the trainer is created).
        callbacks (`list[TrainerCallback]` or `None`, defaults to `None`):
            Extra callbacks.
        optimizers (`tuple`, defaults to `(None, None)`):
            Optimizer and scheduler to use instead of the defaults.
        preprocess_logits_for_metrics (`Callable` or `None`, defaults to `None`):
            Passed to [`~transformers.Trainer`].
        peft_config (`PeftConfig` or `None`, defaults to `None`):
            Adapter configuration; the model is wrapped with `peft.get_peft_model`.
        compute_metrics (`Callable` or `None`, defaults to `None`):
            Metric function for evaluation; receives the implied rewards and the labels (1 = desirable).
        model_adapter_name (`str` or `None`, defaults to `None`):
            With a PEFT model holding several adapters: the adapter to train.
        ref_adapter_name (`str` or `None`, defaults to `None`):
            With a PEFT model holding several adapters: the adapter that acts as the reference.
        embedding_func (`Callable` or `None`, defaults to `None`):
            UDM: `embedding_func(input_ids=..., attention_mask=...)` returning a `(batch, dim)` tensor of prompt
            embeddings. Enables UDM (needs `embedding_tokenizer` and scikit-learn, the `bco` extra).
        embedding_tokenizer (`PreTrainedTokenizerBase` or `None`, defaults to `None`):
            UDM: tokenizer of the embedding model (prompts are tokenized without special tokens).
    """

    _tag_names = ["trl", "bco"]
    _ignored_options = BCO_IGNORED_OPTIONS
    # TRL 1.12's prepared datasets: the raw columns kept, paired data unpaired as all chosen rows then all rejected
    # ones (per batch of 1000 pairs), read in that order.
    _keep_raw_columns = True
    _interleave_unpaired = False
    _name = "BCO"
    _template_file = "lm_model_card.md"
    _paper = {
        "title": "Binary Classifier Optimization for Large Language Model Alignment",
        "id": "2404.04656",
        "citation": (
            "@article{jung2024binary,\n"
            "    title        = {{Binary Classifier Optimization for Large Language Model Alignment}},\n"
            "    author       = {Seungjae Jung and Gunsoo Han and Daniel Wontae Nam and Kyoung-Woon On},\n"
            "    year         = 2024,\n"
            "    eprint       = {arXiv:2404.04656},\n"
            "}"
        ),
    }

    def __init__(
        self,
        model: "PreTrainedModel | nn.Module | str | None" = None,
        ref_model: "PreTrainedModel | nn.Module | str | None" = None,
        args: BCOConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: PreTrainedTokenizerBase
        | BaseImageProcessor
        | FeatureExtractionMixin
        | ProcessorMixin
        | None = None,
        data_collator: Callable[[list[Any]], dict[str, Any]] | None = None,
        model_init: Callable[[], PreTrainedModel] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        peft_config: Any = None,
        compute_metrics: Callable[[EvalLoopOutput], dict] | None = None,
        model_adapter_name: str | None = None,
        ref_adapter_name: str | None = None,
        embedding_func: Callable | None = None,
        embedding_tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        # ---- Config and inputs that cannot work ------------------------------------------------------------------
        if model is None:
            if model_init is None:
                raise ValueError("BCOTrainer needs a `model` (a model or a path / hub id) or a `model_init` callable.")
            model = model_init()
        if args is None:
            args = self._default_args(BCOConfig, model)
        self._check_train_dataset(train_dataset, "BCOTrainer")
        self._check_udm_inputs(embedding_func, embedding_tokenizer)
        if args.generate_during_eval and not (is_wandb_available() or is_comet_available()):
            raise ValueError(
                "generate_during_eval=True logs sampled completions to Weights & Biases or Comet, but neither wandb "
                "nor comet_ml is installed. Install one (`pip install wandb`) or set generate_during_eval=False."
            )

        # ---- Model ---------------------------------------------------------------------------------------------
        model_id = self._model_id(model)
        model = load_causal_lm(model, args, type(self).__name__)
        self._check_peft_arguments(model, peft_config, ref_model, args)
        is_encoder_decoder = args.is_encoder_decoder
        if is_encoder_decoder is None:
            is_encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        if is_encoder_decoder:
            raise ValueError(
                f"BCOTrainer trains decoder-only causal language models, but {type(model).__name__} is an "
                "encoder-decoder model. Use a causal LM (AutoModelForCausalLM)."
            )

        # ---- Processing class ----------------------------------------------------------------------------------
        if processing_class is None:
            processing_class = self._load_processing_class(model_id, args)
        tokenizer = self._ensure_pad_token(processing_class)

        # ---- MoE router loss, PEFT and adapters ----------------------------------------------------------------
        self._aux_loss_enabled, self._aux_loss_coef = self._resolve_aux_loss(model, args)
        if getattr(getattr(model, "config", None), "output_router_logits", False) and not self._aux_loss_enabled:
            warnings.warn(
                "The model config sets output_router_logits=True but router_aux_loss_coef=0.0, so the router's "
                "load-balancing loss is not added. Set model.config.router_aux_loss_coef to a positive value to use "
                "it.",
                UserWarning,
                stacklevel=2,
            )
        model = self._wrap_peft(model, peft_config, args)
        self._select_adapters(model, model_adapter_name, ref_adapter_name)
        self.model_adapter_name = model_adapter_name
        self.ref_adapter_name = ref_adapter_name
        self._ref_adapter_name = ref_adapter_name

        # ---- Reference model -----------------------------------------------------------------------------------
        if isinstance(ref_model, str):
            ref_model = load_causal_lm(ref_model, args, type(self).__name__)
        # An instance (not the path) is passed so that the default reference is a frozen copy of the model.
        ref_model = self._build_preference_ref_model(model, model, ref_model, args)

        # ---- Collator, layout ----------------------------------------------------------------------------------
        self.pad_token_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
        # TRL's right-padded batches, not packed rows: the `logits/*` metrics sum over every position of the padded
        # batch (padding included, whose hidden states depend on the model), and the reference must score in the
        # same layout as the policy so that the rewards are exactly 0 while both are equal.
        self._layout = "padded"
        self._ref_layout = "padded" if ref_model is not None else None
        self._needs_kl = False
        if data_collator is None:
            data_collator = _FromBCOColumns(
                DataCollatorForUnpairedPreference(pad_token_id=self.pad_token_id, max_length=args.max_length)
            )
        self.embedding_func = embedding_func
        self.embedding_tokenizer = embedding_tokenizer
        if self.match_underlying_distribution:
            data_collator = _WithUDMWeights(data_collator)

        # ---- Datasets ------------------------------------------------------------------------------------------
        train_dataset = self._prepare_bco_dataset(train_dataset, processing_class, args, "train")
        eval_dataset = self._prepare_eval_datasets(
            eval_dataset, lambda dataset, name: self._prepare_bco_dataset(dataset, processing_class, args, name)
        )

        # ---- Trainer -------------------------------------------------------------------------------------------
        self._init_trainer(
            ref_model,
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self.running = RunningMoments(accelerator=self.accelerator)

        if args.precompute_ref_log_probs:
            self._precompute_reference_columns(self.compute_ref_log_probs, self._precompute_columns())
        self.clf = None
        if self.match_underlying_distribution:
            self.clf = self._fit_density_ratio_classifier()
            self._attach_udm_weights()
        self._add_model_tags(self.model)

    # ------------------------------------------------------------------------------------------------------------
    # Setup helpers
    # ------------------------------------------------------------------------------------------------------------
    def _ignored_option_facts(self) -> dict[str, Any]:
        return {**super()._ignored_option_facts(), "udm": self.match_underlying_distribution}

    @staticmethod
    def _check_udm_inputs(embedding_func: Callable | None, embedding_tokenizer: Any) -> None:
        if embedding_func is None and embedding_tokenizer is None:
            return
        if embedding_func is None:
            raise ValueError(
                "An embedding_tokenizer was given, which requests Underlying Distribution Matching (UDM), but no "
                "embedding_func: pass embedding_func(input_ids=..., attention_mask=...) -> (batch, dim) tensor that "
                "embeds prompts, or drop embedding_tokenizer to train without UDM."
            )
        if not callable(embedding_func):
            raise ValueError(f"embedding_func must be callable; got {type(embedding_func).__name__}.")
        if embedding_tokenizer is None:
            raise ValueError(
                "An embedding_func was given, which requests Underlying Distribution Matching (UDM), but no "
                "embedding_tokenizer to turn prompts into its input_ids. Pass the embedding model's tokenizer as "
                "embedding_tokenizer."
            )
        if not (is_sklearn_available() and importlib.util.find_spec("joblib") is not None):
            raise ImportError(
                "Underlying Distribution Matching (embedding_func) fits a scikit-learn logistic regression and saves "
                "it with joblib, which are not installed. Run `pip install trl[bco]` (or `pip install scikit-learn "
                "joblib`)."
            )

    @staticmethod
    def _is_prepared(dataset: Any) -> bool:
        """Whether a dataset already holds TRL's BCO token columns (prepared by this trainer or by TRL 1.12)."""
        columns = get_dataset_column_names(dataset) or []
        return all(c in columns for c in ("label", *_BCO_TOKEN_COLUMNS))

    def _record_unpaired_metrics(
        self,
        mode: str,
        label: torch.Tensor,
        logps: torch.Tensor,
        rewards: torch.Tensor,
        example_logits: torch.Tensor,
        means: dict[str, torch.Tensor] | None = None,
        num_tokens: torch.Tensor | None = None,
    ) -> None:
        """Store per-class sums and counts (averaged per class at log time) and the other batch metrics;
        `example_logits` is the `(n,)` value each example contributes to `logits/<class>`."""
        chosen, rejected = label.float(), (~label).float()
        example_logits = example_logits.float()
        sums = {
            "rewards/chosen_sum": (rewards * chosen).sum(),
            "rewards/rejected_sum": (rewards * rejected).sum(),
            "logps/chosen_sum": (logps * chosen).sum(),
            "logps/rejected_sum": (logps * rejected).sum(),
            "logits/chosen_sum": (example_logits * chosen).sum(),
            "logits/rejected_sum": (example_logits * rejected).sum(),
            "count/chosen": chosen.sum(),
            "count/rejected": rejected.sum(),
        }
        self._record_batch_metrics(mode, means=means, sums=sums, num_tokens=num_tokens)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Turn the per-class sums and counts of the logging interval into means, then log as usual.

        Only for metrics stored by `_record_unpaired_metrics` (BCO): `rewards/chosen` is the sum of the chosen
        rewards over the interval divided by the number of chosen examples (likewise for `logps/*` and `logits/*`),
        so batches with few or no examples of a class weigh in proportionally; a class absent from the whole interval
        is not logged. `rewards/margins` is `rewards/chosen - rewards/rejected`. The `*_sum` and `count/*` entries
        only serve this and are not logged (TRL 1.12's BCO logs the means alone).
        """
        mode = self._mode
        if not hasattr(self, "_metrics"):
            self._init_metrics()
        metrics = self._metrics[mode]
        if not any(f"count/{split}" in metrics for split in ("chosen", "rejected")):
            # Metrics recorded per batch (`_record_class_metrics`): averaged over the batches as they are.
            return super().log(logs, start_time)
        for split in ("chosen", "rejected"):
            total = sum(metrics.pop(f"count/{split}", []))
            for name in ("rewards", "logps", "logits"):
                values = metrics.pop(f"{name}/{split}_sum", None)
                if values and total > 0:
                    metrics[f"{name}/{split}"] = [sum(values) / total]
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = [metrics["rewards/chosen"][0] - metrics["rewards/rejected"][0]]
        super().log(logs, start_time)

    @staticmethod
    def _kl_chunk_size(args: Any, dataset_name: str) -> int:
        # BCO (TRL 1.12) pairs each completion with its neighbour's: chunks of one row rotate nothing.
        return 1

    def _prepare_bco_dataset(self, dataset: Any, processing_class: Any, args: BCOConfig, name: str) -> Any:
        """Tokenize (see `_prepare_dataset`), then write TRL 1.12's BCO columns: the raw `prompt`, `completion`,
        `label` (and any other column of the input) followed by `_BCO_TOKEN_COLUMNS`."""
        if self._is_prepared(dataset):
            return dataset
        dataset = self._prepare_dataset(dataset, processing_class, args, name)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        kwargs = {} if isinstance(dataset, IterableDataset) else {"desc": f"Writing the BCO columns of {name}"}
        return dataset.map(
            _ToBCOColumns(processing_class, tokenizer.eos_token_id, args.max_completion_length),
            remove_columns=["prompt_ids", "completion_ids"],
            **kwargs,
        )

    def _extra_signature_columns(self) -> list[str]:
        return ["prompt_input_ids", "completion_input_ids", _UDM_COLUMN]

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        # TRL's BCO batches carry no `input_ids` key, so transformers counts no FLOPs there (`total_flos` is 0).
        return 0

    def _get_train_sampler(self, train_dataset: Any = None):
        # TRL's BCO reads the training rows in dataset order (no shuffling); its batches, and so the running reward
        # mean `delta`, follow that order.
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if dataset is None or isinstance(dataset, IterableDataset):
            return super()._get_train_sampler(train_dataset)
        return torch.utils.data.SequentialSampler(dataset)

    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """A dataset given to `evaluate()`: prepared like the constructor's `eval_dataset` (tokenized, completions
        truncated, UDM weights attached); an already prepared one is returned unchanged."""
        columns = get_dataset_column_names(dataset) or []
        prepared = self._is_prepared(dataset)
        if prepared and (not self.match_underlying_distribution or _UDM_COLUMN in columns):
            return dataset
        dataset = self._prepare_bco_dataset(dataset, self.processing_class, self.args, name)
        if self.match_underlying_distribution:
            dataset = self._with_udm_weights(dataset)
        return dataset

    # ------------------------------------------------------------------------------------------------------------
    # Underlying distribution matching
    # ------------------------------------------------------------------------------------------------------------
    @property
    def match_underlying_distribution(self) -> bool:
        """Whether UDM is on (an `embedding_func` and an `embedding_tokenizer` were given)."""
        return self.embedding_func is not None and self.embedding_tokenizer is not None

    @torch.no_grad()
    def _vectorize_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embeddings `(batch, dim)` of tokenized prompts (embedding-tokenizer ids), as float32 on the CPU."""
        embeddings = self.embedding_func(
            input_ids=input_ids.to(self.accelerator.device), attention_mask=attention_mask.to(self.accelerator.device)
        )
        if not torch.is_tensor(embeddings) or embeddings.dim() != 2 or embeddings.shape[0] != input_ids.shape[0]:
            shape = tuple(embeddings.shape) if torch.is_tensor(embeddings) else type(embeddings).__name__
            raise ValueError(
                f"embedding_func must return a (batch, dim) tensor with one row per prompt; got {shape} for "
                f"{input_ids.shape[0]} prompts."
            )
        return embeddings.detach().float().cpu()

    def _embed_prompt_ids(self, prompt_ids: list[list[int]], batch_size: int | None = None) -> torch.Tensor:
        """Embed prompts given as token ids of the trained model's tokenizer (decoded, then re-tokenized)."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        texts = [tokenizer.decode(list(ids), skip_special_tokens=True) for ids in prompt_ids]
        embedding_tokenizer = self.embedding_tokenizer
        pad_id = embedding_tokenizer.pad_token_id
        if pad_id is None:
            pad_id = embedding_tokenizer.eos_token_id if embedding_tokenizer.eos_token_id is not None else 0
        batch_size = batch_size or self.args.per_device_eval_batch_size
        chunks = []
        for start in range(0, len(texts), batch_size):
            encoded = [
                list(embedding_tokenizer(text, add_special_tokens=False)["input_ids"])
                for text in texts[start : start + batch_size]
            ]
            width = max(1, max(len(ids) for ids in encoded))
            input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
            for row, ids in enumerate(encoded):
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, : len(ids)] = 1
            chunks.append(self._vectorize_prompt(input_ids, attention_mask))
        return torch.cat(chunks) if chunks else torch.zeros(0, 0)

    def _fit_density_ratio_classifier(self) -> Any:
        """Fit a logistic regression separating desirable from undesirable prompts on `prompt_sample_size` each."""
        from sklearn.linear_model import LogisticRegression

        dataset = self.train_dataset
        if not isinstance(dataset, Dataset):
            raise ValueError(
                "Underlying Distribution Matching samples prompts from the training dataset, which must be a "
                f"map-style datasets.Dataset; got {type(dataset).__name__}."
            )
        labels = dataset["label"]
        desirable = [i for i, label in enumerate(labels) if label]
        undesirable = [i for i, label in enumerate(labels) if not label]
        if not desirable or not undesirable:
            raise ValueError(
                "Underlying Distribution Matching compares the prompts of desirable and undesirable examples, but the "
                f"training data has {len(desirable)} desirable and {len(undesirable)} undesirable examples. Train "
                "without embedding_func, or add examples of the missing class."
            )
        rng = random.Random(self.args.seed)
        size = self.args.prompt_sample_size
        desirable = sorted(rng.sample(desirable, min(size, len(desirable))))
        undesirable = sorted(rng.sample(undesirable, min(size, len(undesirable))))
        desirable_embeddings = self._embed_prompt_ids(dataset.select(desirable)["prompt_input_ids"])
        undesirable_embeddings = self._embed_prompt_ids(dataset.select(undesirable)["prompt_input_ids"])
        features = torch.cat([desirable_embeddings, undesirable_embeddings]).numpy()
        targets = [1] * len(desirable) + [0] * len(undesirable)
        # Balanced classes: the classifier's odds then estimate p(x | desirable) / p(x | undesirable).
        clf = LogisticRegression(class_weight="balanced").fit(features, targets)
        logger.info(
            "UDM classifier accuracy on its training prompts: desirable %.3f, undesirable %.3f",
            clf.score(desirable_embeddings.numpy(), [1] * len(desirable)),
            clf.score(undesirable_embeddings.numpy(), [0] * len(undesirable)),
        )
        return clf

    def _get_chosen_prob(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Classifier probability that each prompt comes from the desirable examples."""
        if embeddings.shape[0] == 0:
            return torch.zeros(0)
        prob = self.clf.predict_proba(embeddings.float().cpu().numpy())[:, 1]
        return torch.as_tensor(prob, dtype=torch.float64)

    def _get_udm_weight(self, rejected_embeddings: torch.Tensor) -> torch.Tensor:
        """Clamped density ratio `p / (1 - p)` of undesirable examples' prompt embeddings."""
        prob = self._get_chosen_prob(rejected_embeddings).clamp(1e-12, 1 - 1e-12)
        ratio = prob / (1 - prob)
        return ratio.clamp(min=self.args.min_density_ratio, max=self.args.max_density_ratio).float()

    def _udm_weights_of(self, dataset: Any) -> list[float]:
        """Weight of every example: 1.0 when desirable, the clamped density ratio of its prompt otherwise."""
        labels = dataset["label"]
        undesirable = [i for i, label in enumerate(labels) if not label]
        weights = [1.0] * len(labels)
        if undesirable:
            embeddings = self._embed_prompt_ids(dataset.select(undesirable)["prompt_input_ids"])
            for index, weight in zip(undesirable, self._get_udm_weight(embeddings).tolist()):
                weights[index] = weight
        return weights

    def _with_udm_weights(self, dataset: Any) -> Any:
        """`dataset` with the UDM weight of every example as a column (the classifier is fixed after fitting)."""
        if not isinstance(dataset, Dataset):
            raise ValueError(
                "Underlying Distribution Matching stores a weight per example, so it needs map-style "
                f"datasets.Dataset inputs; got {type(dataset).__name__}."
            )
        weights = self._udm_weights_of(dataset)
        if _UDM_COLUMN in dataset.column_names:
            dataset = dataset.remove_columns(_UDM_COLUMN)
        return dataset.add_column(_UDM_COLUMN, weights)

    def _attach_udm_weights(self) -> None:
        """Store the UDM weight of every example of the train and eval datasets as a dataset column."""
        attach = self._with_udm_weights
        self.train_dataset = attach(self.train_dataset)
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {key: attach(ds) for key, ds in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = attach(self.eval_dataset)

    # ------------------------------------------------------------------------------------------------------------
    # Reference model and log-probabilities
    # ------------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def null_ref_context(self):
        """With a PEFT model and no reference model: the model with its adapters disabled (or `ref_adapter_name`)."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        if self.ref_model is None and self._is_peft_model(unwrapped):
            with use_adapter(unwrapped, self.ref_adapter_name):
                yield
        else:
            yield

    def compute_reference_log_probs(self, padded_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """`(n,)` summed reference log-probs of the completions of a collated batch."""
        return self.compute_ref_log_probs(self.model, padded_batch)["ref_logps"]

    @staticmethod
    def get_batch_logps(
        logits: torch.Tensor,
        labels: torch.Tensor,
        average_log_prob: bool = False,
        label_pad_token_id: int = -100,
        is_encoder_decoder: bool = False,
    ) -> torch.Tensor:
        """Summed (or averaged) log-probability of the labels under the logits, ignoring `label_pad_token_id`.

        Args:
            logits: `(batch, seq_len, vocab)` logits.
            labels: `(batch, seq_len)` target ids; positions equal to `label_pad_token_id` are not scored.
            average_log_prob: Average over the scored tokens instead of summing.
            label_pad_token_id: Label value of unscored positions.
            is_encoder_decoder: Labels are aligned with the logits (no next-token shift).

        Returns:
            `(batch,)` log-probabilities.
        """
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"logits {tuple(logits.shape[:-1])} and labels {tuple(labels.shape)} must have the same batch and "
                "sequence dimensions."
            )
        if not is_encoder_decoder:
            labels, logits = labels[:, 1:], logits[:, :-1]
        mask = labels != label_pad_token_id
        per_token = selective_log_softmax(logits, labels.masked_fill(~mask, 0)) * mask
        if average_log_prob:
            return per_token.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_token.sum(-1)

    def _policy_logps_and_logit_sums(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Policy pass over a collated batch.

        Returns:
            `(logps, logit_sums, outputs)`: the `(n,)` summed completion log-probs (with gradient); per example, the
            sum of its logits over the vocabulary and over every position of the right-padded batch, prompt and
            padding included (TRL 1.12's `logits/*` value), computed from the final hidden states without
            full-vocabulary logits; and the model outputs.
        """
        result = self._token_logps(model, batch, self._layout, with_stats=False, output_hidden_states=True)
        logps = self._sums(result.logps, self._target_mask(batch))
        logit_sums = summed_logits_from_hidden(model, result.outputs.hidden_states[-1]).sum(dim=1)
        return logps, logit_sums, result.outputs

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Policy pass over a collated batch.

        Returns:
            `(chosen_logps, rejected_logps, chosen_logits, rejected_logits)`: summed completion log-probs and the
            summed logits (over the vocabulary and every position of the padded batch) of the desirable and of the
            undesirable examples, plus the router `aux_loss` as a fifth element when the MoE loss is on.
        """
        logps, logit_sums, outputs = self._policy_logps_and_logit_sums(model, batch)
        label = batch["label"].bool()
        out = (logps[label], logps[~label], logit_sums[label], logit_sums[~label])
        if self._aux_loss_enabled:
            out = (*out, getattr(outputs, "aux_loss", None))
        return out

    @property
    def _reference_pass_after_policy_forward(self) -> bool:
        """Whether the reference scores the batch after the policy's forward, as TRL does (see
        `_reference_may_run_first`); before it otherwise."""
        hooks = ("get_batch_loss_metrics", "forward", "compute_reference_log_probs", "compute_ref_log_probs")
        return not self._reference_may_run_first(BCOTrainer, hooks)

    @staticmethod
    def _in_batch_order(label: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        values = chosen.new_empty(label.shape[0], *chosen.shape[1:])
        values[label], values[~label] = chosen, rejected
        return values

    def _scores_from_forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor], label: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The policy's `(logps, logit_sums, aux_loss)` in batch order, from `self.forward`."""
        out = self.forward(model, batch)
        aux_loss = out[4] if self._aux_loss_enabled and len(out) > 4 else None
        logps = self._in_batch_order(label, out[0], out[1])
        return logps, self._in_batch_order(label, out[2], out[3]).detach(), aux_loss

    @torch.no_grad()
    def _reference_scores_from_forward(self, batch: dict[str, torch.Tensor], label: torch.Tensor) -> torch.Tensor:
        """The reference's summed log-probs in batch order: precomputed, or from `self.forward` on the reference
        model (on the model with its adapters off when there is none)."""
        if "ref_logps" in batch:
            return batch["ref_logps"].float()
        if self.ref_model is None:
            with self.null_ref_context():
                out = self.forward(self.model, batch)
        else:
            out = self.forward(self.ref_model, batch)
        return self._in_batch_order(label, out[0], out[1])

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    def bco_loss(
        self,
        chosen_logps: torch.Tensor,
        rejected_logps: torch.Tensor,
        reference_chosen_logps: torch.Tensor,
        reference_rejected_logps: torch.Tensor,
        chosen_embeddings: torch.Tensor | None = None,
        rejected_embeddings: torch.Tensor | None = None,
        do_train: bool = True,
        rejected_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """BCO losses of the desirable and undesirable examples of a batch.

        Args:
            chosen_logps: `(c,)` summed log-probs of the desirable completions under the policy.
            rejected_logps: `(r,)` same for the undesirable completions.
            reference_chosen_logps: `(c,)` desirable completions under the reference.
            reference_rejected_logps: `(r,)` undesirable completions under the reference.
            chosen_embeddings: Unused (kept for signature compatibility); desirable examples have weight 1.
            rejected_embeddings: `(r, dim)` prompt embeddings of the undesirable examples; with UDM their clamped
                density ratio weights the undesirable losses.
            do_train: Fold this batch's rewards into the running mean `delta` first (training); False keeps it.
            rejected_weights: `(r,)` precomputed weights of the undesirable losses (used when no embeddings are
                given).

        Returns:
            `(losses, chosen_rewards, rejected_rewards, delta)`: `(c + r,)` losses (desirable first), the rewards
            (detached) and the scalar `delta` used.
        """
        chosen_rewards = self.args.beta * (chosen_logps - reference_chosen_logps)
        rejected_rewards = self.args.beta * (rejected_logps - reference_rejected_logps)
        if do_train:
            self.running.update(torch.cat([chosen_rewards, rejected_rewards]).detach())
        delta = torch.tensor(self.running.mean, dtype=chosen_rewards.dtype, device=chosen_rewards.device)
        chosen_losses = -F.logsigmoid(chosen_rewards - delta)
        rejected_losses = -F.logsigmoid(-(rejected_rewards - delta))
        if rejected_embeddings is not None and self.match_underlying_distribution:
            rejected_weights = self._get_udm_weight(rejected_embeddings)
        if rejected_weights is not None:
            rejected_losses = rejected_weights.to(rejected_losses) * rejected_losses
        losses = torch.cat([chosen_losses, rejected_losses])
        return losses, chosen_rewards.detach(), rejected_rewards.detach(), delta

    def get_batch_loss_metrics(
        self, model: nn.Module, batch: dict[str, torch.Tensor], train_eval: str = "train"
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of a collated batch; its metrics are stored for logging (gathered across processes).

        Returns:
            `(loss, outputs)` with `outputs = {"rewards": (n,), "label": (n,)}` in batch order.
        """
        label = batch["label"].bool()
        if type(self).forward is not BCOTrainer.forward:
            # A subclass's `forward` scores the policy and then the reference, where TRL calls it.
            logps, logit_sums, aux_loss = self._scores_from_forward(model, batch, label)
            ref_logps = self._reference_scores_from_forward(batch, label).to(logps)
        else:
            reference_first = not self._reference_pass_after_policy_forward
            if reference_first:
                ref_logps = self._reference_logps(model, batch)["ref_logps"]
            logps, logit_sums, outputs = self._policy_logps_and_logit_sums(model, batch)
            if not reference_first:
                ref_logps = self._reference_logps(model, batch)["ref_logps"]
            ref_logps = ref_logps.to(logps)
            aux_loss = getattr(outputs, "aux_loss", None) if self._aux_loss_enabled else None
        weights = batch.get(_UDM_COLUMN)
        losses, chosen_rewards, rejected_rewards, delta = self.bco_loss(
            logps[label],
            logps[~label],
            ref_logps[label],
            ref_logps[~label],
            do_train=train_eval == "train",
            rejected_weights=weights[~label] if weights is not None else None,
        )
        loss = losses.mean()
        if aux_loss is not None:
            loss = loss + self._aux_loss_coef * aux_loss
        rewards = torch.empty_like(logps)
        rewards[label], rewards[~label] = chosen_rewards, rejected_rewards
        with torch.no_grad():
            means = {"delta": delta}
            if aux_loss is not None:
                means["aux_loss"] = aux_loss.detach().float()
            self._record_unpaired_metrics(train_eval, label, logps.detach(), rewards.detach(), logit_sums, means=means)
        return loss, {"rewards": rewards.detach(), "label": label}

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        mode = self._mode
        loss, outputs = self.get_batch_loss_metrics(model, inputs, train_eval=mode)
        if return_outputs:
            return loss, outputs
        return loss

    def _prediction_logits_and_labels(
        self, model: nn.Module, inputs: dict[str, Any], outputs: dict[str, torch.Tensor], ignore_keys: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Predictions: the implied reward of every example; labels: 1 for desirable, 0 for undesirable. (TRL 1.12's
        # own `predict()` fails on its integer labels, so there is no oracle to follow here.)
        return outputs["rewards"], outputs["label"].long()

    def store_metrics(self, metrics: dict[str, float], train_eval: str = "train") -> None:
        """Store already-reduced metric values for the next log."""
        for key, value in metrics.items():
            self._metrics[train_eval][key].append(float(value))

    # ------------------------------------------------------------------------------------------------------------
    # Generation during evaluation
    # ------------------------------------------------------------------------------------------------------------
    def generate_from_model_and_ref(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[list[str], list[str]]:
        """Sample one completion per prompt of a collated batch from the model and from the reference model.

        Returns:
            `(policy_texts, reference_texts)`: decoded prompt + completion strings.
        """
        from ...models.utils import unwrap_model_for_generation

        n = batch["label"].shape[0]
        prompt_mask = (batch["attention_mask"][:n] * (1 - batch["completion_mask"][:n])).bool()
        prompts = [row[mask] for row, mask in zip(batch["input_ids"][:n], prompt_mask)]
        width = max(1, max(len(p) for p in prompts))
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long, device=batch["input_ids"].device)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):  # left padding for generation
            if len(prompt):
                input_ids[row, width - len(prompt) :] = prompt
                attention_mask[row, width - len(prompt) :] = 1
        max_new_tokens = self.args.max_completion_length or max(1, (self.args.max_length or 1024) - width)
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            pad_token_id=self.pad_token_id,
        )
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        with torch.no_grad():
            with unwrap_model_for_generation(model, self.accelerator) as unwrapped:
                policy_output = unwrapped.generate(**kwargs)
            if self.ref_model is None:
                with self.null_ref_context(), unwrap_model_for_generation(model, self.accelerator) as unwrapped:
                    ref_output = unwrapped.generate(**kwargs)
            else:
                with unwrap_model_for_generation(self.ref_model, self.accelerator) as unwrapped:
                    ref_output = unwrapped.generate(**kwargs)
        return (
            [tokenizer.decode(ids.tolist(), skip_special_tokens=True) for ids in policy_output],
            [tokenizer.decode(ids.tolist(), skip_special_tokens=True) for ids in ref_output],
        )

    def evaluation_loop(
        self,
        dataloader: torch.utils.data.DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """Evaluation as usual; with `generate_during_eval`, also log a table of sampled completions first."""
        if self.args.generate_during_eval:
            dataset = dataloader.dataset
            size = min(len(dataset), self.args.eval_batch_size)
            indices = random.Random(self.state.global_step).sample(range(len(dataset)), k=size)
            batch = self._prepare_inputs(self.data_collator([dataset[i] for i in indices]))
            policy_texts, ref_texts = self.generate_from_model_and_ref(self.model, batch)
            rows = [[p, r] for p, r in zip(policy_texts, ref_texts)]
            if "wandb" in self.args.report_to and is_wandb_available():
                import wandb

                if wandb.run is not None:
                    wandb.log({"game_log": wandb.Table(columns=["Policy", "Ref Model"], data=rows)})
            if "comet_ml" in self.args.report_to and is_comet_available():
                import pandas as pd

                log_table_to_comet_experiment(
                    name="game_log.csv", table=pd.DataFrame(rows, columns=["Policy", "Ref Model"])
                )
        return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints: running moments and the UDM classifier
    # ------------------------------------------------------------------------------------------------------------
    def _save_checkpoint_extras(self, output_dir):
        super()._save_checkpoint_extras(output_dir)
        if self.accelerator.is_main_process and os.path.isdir(output_dir):
            self.running.save_to_json(os.path.join(output_dir, RUNNING_NAME))
            if self.clf is not None:
                import joblib

                joblib.dump(self.clf, os.path.join(output_dir, CLF_NAME), compress=True)  # TRL's file, for its tools
                # What resuming reads: the fitted numbers only, so that loading a checkpoint never unpickles.
                fitted = {key: getattr(self.clf, key).tolist() for key in ("coef_", "intercept_", "classes_")}
                with open(os.path.join(output_dir, CLF_STATE_NAME), "w") as f:
                    json.dump(fitted, f)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        running_file = os.path.join(resume_from_checkpoint, RUNNING_NAME)
        if os.path.isfile(running_file):
            self.running = RunningMoments.load_from_json(self.accelerator, running_file)
        clf_file = os.path.join(resume_from_checkpoint, CLF_STATE_NAME)
        if self.match_underlying_distribution and os.path.isfile(clf_file):
            import numpy as np
            from sklearn.linear_model import LogisticRegression

            with open(clf_file) as f:
                fitted = json.load(f)
            loaded = LogisticRegression(class_weight="balanced")
            for key, value in fitted.items():
                setattr(loaded, key, np.asarray(value))
            same = (
                self.clf is not None
                and np.array_equal(loaded.coef_, getattr(self.clf, "coef_", None))
                and np.array_equal(loaded.intercept_, getattr(self.clf, "intercept_", None))
            )
            self.clf = loaded
            if not same:  # weights were computed with another classifier: recompute them with the saved one
                self._attach_udm_weights()
