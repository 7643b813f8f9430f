"""The training data layout of the distillation trainers that regenerate completions per optimizer step (GOLD,
IW-OPD): one dataloader batch is the step's whole generation batch, emitted once per accumulation micro-step."""

from typing import Any

from datasets import IterableDataset

from ..trainer.utils.sampling import RepeatSampler, repeat_iterable_dataset


class _GenerationBatchMixin:
    """`get_train_dataloader` / `_get_train_sampler` for a Trainer whose config has `num_generations` and
    `generation_batch_size` (prompts per process and step).

    A dataloader batch is the generation batch of an optimizer step (`generation_batch_size` prompts, each
    `num_generations` times in a row), emitted `gradient_accumulation_steps` times so that the Trainer fetches one per
    micro-step; the trainer trains each micro-step on its slice. The Trainer's token count (`num_items_in_batch`)
    therefore covers the generation batch once per micro-step, as in TRL.
    """

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}: training requires a train_dataset.")
        args = self.args
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            dataset = repeat_iterable_dataset(
                dataset,
                mini_repeat_count=args.num_generations,
                batch_size=args.generation_batch_size,
                repeat_count=args.gradient_accumulation_steps,
            )
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self._train_batch_size * args.gradient_accumulation_steps,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_train_sampler(self, train_dataset: Any = None):
        return RepeatSampler(
            data_source=train_dataset if train_dataset is not None else self.train_dataset,
            mini_repeat_count=self.args.num_generations,
            batch_size=self.args.generation_batch_size,
            repeat_count=self.args.gradient_accumulation_steps,
            shuffle=True,
            seed=self.args.seed,
        )
