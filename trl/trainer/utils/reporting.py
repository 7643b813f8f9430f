"""What a run shows and publishes: sample tables printed to the console, experiment-tracker URLs and tables (Comet,
trackio), and the model card written next to the trained model."""

import importlib.metadata
import os
import random
from pathlib import Path
from typing import Any

import torch

from ...import_utils import is_comet_available, is_rich_available, is_trackio_available


def _render_messages(value: Any):
    """Turn a prompt/completion (string or list of chat messages) into rich text."""
    from rich.text import Text

    if isinstance(value, str):
        return Text(value)
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        text = Text()
        for i, message in enumerate(value):
            if i > 0:
                text.append("\n")
            text.append(f"{message.get('role', '?')}: ", style="bold")
            content = message.get("content", "")
            if isinstance(content, list):  # multimodal content blocks
                parts = []
                for block in content:
                    if isinstance(block, dict) and block.get("type") == "text":
                        parts.append(block.get("text", ""))
                    elif isinstance(block, dict):
                        parts.append(f"<{block.get('type', 'block')}>")
                content = " ".join(parts)
            text.append(str(content) if content is not None else "")
            if message.get("tool_calls"):
                text.append(f"\n[tool calls] {message['tool_calls']}", style="italic")
        return text
    return Text(str(value))


def print_prompt_completions_sample(
    prompts: list,
    completions: list,
    rewards: dict[str, list[float]],
    advantages: list[float] | None,
    step: int,
    num_samples: int | None = None,
    extra: dict[str, list] | None = None,
) -> None:
    """Print a table of prompts, completions, per-function rewards and advantages to the console with rich.

    Args:
        prompts: Prompts (strings or lists of chat messages).
        completions: Completions, aligned with `prompts`.
        rewards: Mapping of reward-function name to one reward per completion.
        advantages: One advantage per completion, or None for no advantage column (distillation).
        step: Training step shown in the title.
        num_samples: If set (and smaller than the number of rows), print this many randomly chosen rows.
        extra: Optional extra columns, name -> one value per completion.
    """
    if not is_rich_available():
        raise ImportError("`print_prompt_completions_sample` needs `rich`; install it with `pip install rich`.")
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    console = Console()
    table = Table(show_header=True, header_style="bold white", expand=True, show_lines=True)
    table.add_column("Prompt", style="bright_yellow")
    table.add_column("Completion", style="bright_green")
    for name in rewards:
        table.add_column(name, style="bold cyan", justify="right")
    if advantages is not None:
        table.add_column("Advantage", style="bold magenta", justify="right")
    extra = extra or {}
    for name in extra:
        table.add_column(name, justify="right")

    rows = list(range(len(prompts)))
    if num_samples is not None and num_samples < len(rows):
        rows = sorted(random.sample(rows, max(num_samples, 0)))

    def fmt(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            value = value.item()
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    for i in rows:
        cells = [_render_messages(prompts[i]), _render_messages(completions[i])]
        cells += [fmt(values[i]) for values in rewards.values()]
        if advantages is not None:
            cells.append(fmt(advantages[i]))
        cells += [fmt(values[i]) for values in extra.values()]
        table.add_row(*cells)
    console.print(Panel(table, expand=False, title=f"Step {step}", border_style="bold white"))


def get_comet_experiment_url() -> str | None:
    """URL of the running Comet experiment, or None when Comet is not installed or no experiment is running."""
    if not is_comet_available():
        return None
    import comet_ml

    experiment = comet_ml.get_running_experiment()
    return experiment.url if experiment is not None else None


def get_trackio_space_url() -> str | None:
    """URL of the trackio dashboard (Space) of the current run, or None when unavailable."""
    if not is_trackio_available():
        return None
    try:
        import trackio

        context_vars = getattr(trackio, "context_vars", None)
        run = context_vars.current_run.get() if context_vars is not None else None
    except Exception:
        return None
    if run is None:
        return None
    space_id = getattr(run, "space_id", None) or os.environ.get("TRACKIO_SPACE_ID")
    if not space_id:
        return None
    return f"https://huggingface.co/spaces/{space_id}"


def log_table_to_comet_experiment(name: str, table: Any) -> None:
    """Log a table (e.g. a pandas DataFrame) to the running Comet experiment under the file name `name`."""
    if not is_comet_available():
        raise ModuleNotFoundError("`comet_ml` is not installed. Install it with `pip install comet_ml`.")
    import comet_ml

    experiment = comet_ml.get_running_experiment()
    if experiment is not None:
        experiment.log_table(tabular_data=table, filename=name)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def generate_model_card(
    base_model: str | None,
    model_name: str,
    hub_model_id: str,
    dataset_name: str | None,
    tags: str | list[str] | None,
    wandb_url: str | None,
    trackio_url: str | None,
    trainer_name: str,
    trainer_citation: str | None = None,
    template_file: str | None = None,
    paper_title: str | None = None,
    paper_id: str | None = None,
    comet_url: str | None = None,
):
    """Render a `huggingface_hub.ModelCard` for a trained model from a Jinja template.

    Template variables: `base_model`, `model_name`, `hub_model_id`, `dataset_name`, `wandb_url`, `trackio_url`,
    `comet_url`, `trainer_name`, `trainer_citation`, `paper_title`, `paper_id`, and the versions `trl_version`,
    `transformers_version`, `pytorch_version`, `datasets_version`, `tokenizers_version`.

    Args:
        base_model: Model the training started from.
        model_name: Name of the trained model.
        hub_model_id: Hub repository id of the trained model.
        dataset_name: Training dataset.
        tags: Extra tags (`generated_from_trainer` is always added).
        wandb_url: Weights & Biases run URL.
        trackio_url: trackio dashboard URL.
        trainer_name: Name of the trainer (e.g. `"SFT"`).
        trainer_citation: BibTeX of the method.
        template_file: Template path; defaults to `trl/templates/lm_model_card.md`.
        paper_title: Title of the method's paper.
        paper_id: arXiv id of the paper.
        comet_url: Comet experiment URL.

    Returns:
        `huggingface_hub.ModelCard`.
    """
    from huggingface_hub import ModelCard, ModelCardData

    if tags is None:
        tags = []
    elif isinstance(tags, str):
        tags = [tags]
    card_data = ModelCardData(
        base_model=base_model,
        datasets=dataset_name,
        library_name="transformers",
        model_name=model_name,
        tags=["generated_from_trainer", *tags],
    )
    if template_file is None:
        template_file = str(Path(__file__).resolve().parents[2] / "templates" / "lm_model_card.md")
    return ModelCard.from_template(
        card_data,
        template_path=template_file,
        base_model=base_model,
        model_name=model_name,
        hub_model_id=hub_model_id,
        dataset_name=dataset_name,
        wandb_url=wandb_url,
        trackio_url=trackio_url,
        comet_url=comet_url,
        trainer_name=trainer_name,
        trainer_citation=trainer_citation,
        paper_title=paper_title,
        paper_id=paper_id,
        trl_version=_version("trl"),
        transformers_version=_version("transformers"),
        pytorch_version=_version("torch"),
        datasets_version=_version("datasets"),
        tokenizers_version=_version("tokenizers"),
    )
