"""Rank bodies for the Hugging Face tests: a tiny GPT-2 sharded with FSDP2 and initialised
from a ``save_pretrained`` folder by ckpt."""

from __future__ import annotations

from typing import Any

import torch


def config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                      tie_word_embeddings=True)


def tokens() -> torch.Tensor:
    return torch.arange(24).reshape(2, 12) * 7 % 512


def save_folder(path: str, max_shard_size: str) -> torch.Tensor:
    """``save_pretrained`` of a seeded tiny GPT-2 in shards; the logits ``from_pretrained``
    of that folder gives."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(config()).save_pretrained(path, max_shard_size=max_shard_size)
    reference = GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        return reference(tokens()).logits


def sharded_init(rank: int, world: int, path: str) -> dict[str, Any]:
    """A GPT-2 of other values, FSDP2-sharded over ``world`` ranks, initialised from the
    folder by ckpt: the bytes this rank read and the logits (numpy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2LMHeadModel

    import ckpt.interop

    torch.manual_seed(1)
    model = GPT2LMHeadModel(config()).eval()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    result = ckpt.interop.load_hf(model, path)
    with torch.no_grad():
        logits = model(tokens()).logits
    return {"bytes_read": result.bytes_read, "folder_bytes": result.folder_bytes,
            "logits": logits.numpy().copy()}
