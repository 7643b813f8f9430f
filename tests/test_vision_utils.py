import pytest
import torch

from trl.trainer.utils import split_pixel_values_by_grid, strip_images_from_messages, unsplit_pixel_values_by_grid


GRID = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 2, 2]])  # 4 + 8 + 4 patches


def test_split_by_grid_groups_images_per_sample_and_round_trips():
    pixel_values = torch.arange(32, dtype=torch.float32).reshape(16, 2)
    batch = {
        "pixel_values": pixel_values,
        "image_grid_thw": GRID,
        "num_images": [2, 1],
        "input_ids": torch.zeros(2, 3),
    }
    split = split_pixel_values_by_grid(batch)
    assert [tuple(t.shape) for t in split["pixel_values"]] == [(12, 2), (4, 2)]
    assert torch.equal(split["pixel_values"][1], pixel_values[12:])
    assert [t.tolist() for t in split["image_grid_thw"]] == [GRID[:2].tolist(), GRID[2:].tolist()]
    assert split["input_ids"] is batch["input_ids"]
    merged = unsplit_pixel_values_by_grid(split)
    assert torch.equal(merged["pixel_values"], pixel_values)
    assert torch.equal(merged["image_grid_thw"], GRID)


def test_split_by_grid_sample_without_images_and_position_ids():
    pixel_values = torch.randn(16, 3)
    positions = torch.arange(32).reshape(16, 2)
    shapes = torch.tensor([[2, 2], [2, 4], [2, 2]])
    batch = {
        "pixel_values": pixel_values,
        "image_grid_thw": GRID,
        "num_images": [3, 0],
        "spatial_shapes": shapes,
        "image_position_ids": positions,
    }
    split = split_pixel_values_by_grid(batch)
    assert [tuple(t.shape) for t in split["pixel_values"]] == [(16, 3), (0, 3)]
    assert [tuple(t.shape) for t in split["image_grid_thw"]] == [(3, 3), (0, 3)]
    # With a grid, spatial shapes and position ids stay whole.
    assert split["spatial_shapes"] is shapes and split["image_position_ids"] is positions
    merged = unsplit_pixel_values_by_grid(split)
    assert torch.equal(merged["pixel_values"], pixel_values) and torch.equal(merged["image_grid_thw"], GRID)


def test_split_by_spatial_shapes_splits_tiles_and_position_ids():
    pixel_values = torch.arange(36, dtype=torch.float32).reshape(3, 6, 2)
    positions = torch.arange(36).reshape(3, 6, 2)
    batch = {
        "pixel_values": pixel_values,
        "spatial_shapes": torch.tensor([[1, 5], [2, 3], [1, 4]]),
        "num_tiles": [2, 1],
        "num_images": [2, 1],
        "pixel_attention_mask": torch.ones(3, 6),
        "image_position_ids": positions,
    }
    split = split_pixel_values_by_grid(batch)
    assert [tuple(t.shape) for t in split["pixel_values"]] == [(2, 6, 2), (1, 6, 2)]
    assert [tuple(t.shape) for t in split["image_position_ids"]] == [(2, 6, 2), (1, 6, 2)]
    assert split["spatial_shapes"] is batch["spatial_shapes"]
    merged = unsplit_pixel_values_by_grid(split)
    assert torch.equal(merged["pixel_values"], pixel_values) and torch.equal(merged["image_position_ids"], positions)


def test_split_and_unsplit_leave_other_batches_alone():
    plain = {"pixel_values": torch.zeros(2, 3, 4, 4)}
    assert split_pixel_values_by_grid(plain) is plain
    assert unsplit_pixel_values_by_grid(plain) is plain
    no_counts = {"pixel_values": torch.zeros(16, 2), "image_grid_thw": GRID}
    assert split_pixel_values_by_grid(no_counts) is no_counts


def test_split_errors_name_the_mismatch():
    with pytest.raises(ValueError, match="sum\\(lengths\\) = 16 != pixel_values.size\\(0\\) = 20"):
        split_pixel_values_by_grid({"pixel_values": torch.zeros(20, 2), "image_grid_thw": GRID, "num_images": [3]})
    with pytest.raises(ValueError, match="num_tiles"):
        split_pixel_values_by_grid(
            {
                "pixel_values": torch.zeros(4, 6, 2),
                "spatial_shapes": torch.zeros(3, 2),
                "num_tiles": [2, 1],
                "num_images": [2, 1],
                "pixel_attention_mask": torch.ones(4, 6),
            }
        )


def test_strip_images_from_messages_keeps_placeholders():
    messages = [
        {"role": "user", "content": [{"type": "image", "image": object()}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "yo"},
    ]
    assert strip_images_from_messages(messages) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "yo"},
    ]
    assert "image" in messages[0]["content"][0]  # the input is not modified
