"""Builder of the tiny offline Stable Diffusion pipeline used by the DDPO and AlignProp tests and examples.

Everything is random weights and a locally written tokenizer, so nothing downloads. The tokenizer is a CLIP BPE with
a byte-level alphabet and no merges (one token per character), written as `vocab.json` + `merges.txt` so that every
transformers version loads it as `CLIPTokenizer`. `trl.assets.get_diffusion_pipeline_path` caches the result.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path


# Images are `8 * _LATENT_SIZE` pixels wide: the VAE halves the resolution three times.
_LATENT_SIZE = 4
_TEXT_MAX_LENGTH = 32
_HIDDEN = 32


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of GPT-2/CLIP byte-level BPE (printable bytes map to themselves)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _write_clip_tokenizer(out_dir: Path) -> int:
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    # CLIP marks the last character of a word with `</w>`; both forms of every character are in the vocabulary.
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    # Both files stay next to what `save_pretrained` writes: transformers 4.x's CLIPTokenizer reads only them.
    tokenizer_dir = out_dir / "tokenizer"
    tokenizer_dir.mkdir(parents=True)
    (tokenizer_dir / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False))
    (tokenizer_dir / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer.from_pretrained(str(tokenizer_dir), model_max_length=_TEXT_MAX_LENGTH)
    tokenizer.save_pretrained(str(tokenizer_dir))
    return len(tokens)


def build_tiny_stable_diffusion(out_dir: Path) -> None:
    """Write a tiny random-weight `StableDiffusionPipeline` (32x32 images, 4x4 latents) to `out_dir`.

    Args:
        out_dir (`Path`):
            Empty directory that receives the pipeline in `save_pretrained` layout.
    """
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab_size = _write_clip_tokenizer(out_dir)
    tokenizer = CLIPTokenizer.from_pretrained(str(out_dir / "tokenizer"))
    torch.manual_seed(zlib.crc32(b"tiny-StableDiffusionPipeline"))
    unet = UNet2DConditionModel(
        sample_size=_LATENT_SIZE,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=_HIDDEN,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    # One normalisation group and a louder output layer: a random VAE decoder with per-channel GroupNorm maps every
    # latent to almost the same mean colour, which leaves an image reward (brightness) nothing to learn from.
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 16, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
        sample_size=8 * _LATENT_SIZE,
    )
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(5.0)
        vae.decoder.conv_out.bias.zero_()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=_TEXT_MAX_LENGTH,
            projection_dim=_HIDDEN,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipeline = StableDiffusionPipeline(
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        unet=unet.eval(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(str(out_dir), safe_serialization=True)
    _write_legacy_text_encoder_keys(out_dir / "text_encoder" / "model.safetensors")


def _write_legacy_text_encoder_keys(weights_file: Path) -> None:
    """Prefix the text encoder's weight names with `text_model.`, the layout of the published CLIP checkpoints.

    transformers 5 saves `CLIPTextModel` without the prefix and reads both layouts; transformers 4.x reads only the
    prefixed one, and the parity oracle (TRL 0.22) runs on it.
    """
    from safetensors.torch import load_file, save_file

    state = load_file(str(weights_file))
    if all(key.startswith("text_model.") for key in state):
        return
    save_file(
        {f"text_model.{key}": value for key, value in state.items()}, str(weights_file), metadata={"format": "pt"}
    )
