"""Prefix-cache snapshots in one safetensors file: a long system prompt's K/V survive a restart.

A snapshot holds, per layer group, the K/V of the cached full blocks, layer by layer; the chain of
their tokens (each block's tokens and the entry before it, so a loader rebuilds the chained keys
with its own hash: Python's differs between processes); and a fingerprint of what the K/V depend
on: the model config, a weights fingerprint, the dtype, the block size and the sharding. Loading
checks the fingerprint (a mismatch is refused with an error naming it) and every tensor's sha256
(a truncated or corrupted file is refused) before anything changes.

The weights fingerprint covers every byte of every parameter and buffer (a change to a few
embedding rows, as when only new tokens' embeddings are fine-tuned, changes it): per tensor its
name, shape and dtype, then its raw bytes hashed with SHA-256 in 32 MiB chunks by a few threads
(hashlib releases the GIL; a GPU tensor is copied to the CPU a chunk at a time), the chunk digests
hashed in order. Tied weights are hashed once. It reads the whole model on every save and load:
about 1.8 GB/s per core with the SHA extensions of current x86 and ARM CPUs (1B bf16 parameters,
2 GB: 1.1 s on a busy 2-core machine).

Format v2 (this one) has that fingerprint; a v1 snapshot (a 64-value strided sample per tensor,
which missed such changes) is refused by name: save it again.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

FORMAT = "hf_paged.prefix_cache.v2"
_OLD_FORMATS = {"hf_paged.prefix_cache.v1"}
_CHUNK = 32 << 20  # bytes hashed at once (and, for a GPU tensor, copied to the CPU at once)
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "_attn_implementation_internal",
                         "_attn_implementation_autoset", "torch_dtype", "dtype", "architectures"}


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded here: another model, dtype or block size, or a damaged file."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_fingerprint(config) -> str:
    values = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return _sha(json.dumps(values, sort_keys=True, default=str).encode())


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's data as a flat uint8 tensor on its own device (a copy only when not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    try:
        return flat.view(torch.uint8)
    except (RuntimeError, TypeError):  # a tensor subclass without a byte view: its float32 values
        return flat.to(torch.float32).view(torch.uint8)


def _chunk_digest(chunk: torch.Tensor) -> bytes:
    with torch.no_grad():
        return hashlib.sha256(chunk.cpu().numpy()).digest()


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """Name, shape, dtype and every byte of every parameter and buffer, hashed (of this rank's
    shard, for a tensor-parallel model)."""
    digest = hashlib.sha256()
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    chunks: list[torch.Tensor] = []
    parts: list[tuple[bytes, int]] = []  # per tensor: its header, then how many chunk digests follow
    seen: dict[tuple, str] = {}
    for name, tensor in sorted(named, key=lambda item: item[0]):  # not state_dict(): it fails on DTensors in inference mode
        if hasattr(tensor, "to_local"):  # a DTensor: this rank's part
            tensor = tensor.to_local()
        header = f"{name}:{tuple(tensor.shape)}:{tensor.dtype}"
        same = (tensor.device, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                tensor.data_ptr() if tensor.numel() else None)
        if tensor.numel() and same in seen:  # tied weights: one tensor under two names, hashed once
            parts.append((f"{header}=>{seen[same]}".encode(), 0))
            continue
        seen[same] = name
        data = _raw_bytes(tensor)
        pieces = [data[i:i + _CHUNK] for i in range(0, data.numel(), _CHUNK)]
        chunks.extend(pieces)
        parts.append((header.encode(), len(pieces)))
    workers = max(1, min(8, os.cpu_count() or 1, len(chunks)))
    with ThreadPoolExecutor(workers) as pool:
        digests = iter(list(pool.map(_chunk_digest, chunks)))
    for header, count in parts:
        digest.update(header)
        for _ in range(count):
            digest.update(next(digests))
    return digest.hexdigest()


def fingerprint(model, dtype: torch.dtype, block_size: int, rank: int = 0, world_size: int = 1) -> dict[str, str]:
    """What cached K/V depend on (all strings: safetensors metadata)."""
    return {"config": config_fingerprint(model.config), "weights": weights_fingerprint(model), "dtype": str(dtype),
            "block_size": str(block_size), "sharding": f"{rank}/{world_size}"}


def _tensor_sha(t: torch.Tensor) -> str:
    return _sha(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else _sha(b"")


def save(path, print_: dict[str, str], chain, groups, layer_groups, storage) -> int:
    """Write a snapshot: ``chain`` and ``groups`` as ``PrefixIndex.export`` gives
    them, the blocks' K/V read from ``storage`` for each group's layers. Returns the blocks saved:
    0 for an empty prefix cache, whose snapshot is valid and loads 0 blocks."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {
        "chain.tokens": torch.tensor([list(t) for t, _ in chain], dtype=torch.int64).reshape(len(chain), -1)
        if chain else torch.zeros((0, 0), dtype=torch.int64),  # nothing cached: a valid empty snapshot
        "chain.parents": torch.tensor([p for _, p in chain], dtype=torch.int64),
    }
    saved = 0
    for g, (group, entries) in enumerate(zip(layer_groups, groups)):
        layers = [layer for layer in group.layers if layer in storage.key_pools]
        if not layers:  # the group's layers never ran: no K/V to save
            entries = []
        tensors[f"group{g}.entries"] = torch.tensor([i for i, _ in entries], dtype=torch.int64)
        blocks = torch.tensor([b for _, b in entries], dtype=torch.long)
        for layer in layers:
            for kind, pools in (("keys", storage.key_pools), ("values", storage.value_pools)):
                pool = pools[layer]
                tensors[f"group{g}.layer{layer}.{kind}"] = pool.index_select(0, blocks.to(pool.device)).cpu()
        saved += len(entries)
    metadata = {"format": FORMAT, **print_, "groups": str(len(groups)),
                "checksums": json.dumps({name: _tensor_sha(t) for name, t in tensors.items()}, sort_keys=True)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return saved


def read(path, expected: dict[str, str], num_groups: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read and check a snapshot (fingerprint, then every tensor's checksum); nothing is applied."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise SnapshotError(f"{path}: not a readable safetensors snapshot ({err})") from err
    if metadata.get("format") in _OLD_FORMATS:
        raise SnapshotError(f"{path}: saved by an older hf_paged (format {metadata['format']!r}, whose weights "
                            f"fingerprint sampled the weights); save it again with this version ({FORMAT!r})")
    if metadata.get("format") != FORMAT:
        raise SnapshotError(f"{path}: not an hf_paged prefix-cache snapshot (format {metadata.get('format')!r})")
    names = {"dtype": "dtype", "block_size": "block size", "sharding": "tensor-parallel rank/size",
             "config": "model config", "weights": "model weights"}  # the most specific mismatch is named
    for key, what in names.items():
        if metadata.get(key) != expected[key]:
            raise SnapshotError(f"{path}: saved for another {what} ({key}: snapshot {metadata.get(key)!r}, "
                                f"here {expected[key]!r})")
    if metadata.get("groups") != str(num_groups):
        raise SnapshotError(f"{path}: {metadata.get('groups')} layer groups in the snapshot, {num_groups} here")
    checksums = json.loads(metadata.get("checksums", "{}"))
    if set(checksums) != set(tensors) or any(_tensor_sha(t) != checksums[n] for n, t in tensors.items()):
        raise SnapshotError(f"{path}: damaged (a tensor's checksum does not match)")
    return tensors, metadata


def chain_of(tensors: dict[str, torch.Tensor]) -> list[tuple[tuple[int, ...], int]]:
    return [(tuple(t), int(p)) for t, p in zip(tensors["chain.tokens"].tolist(), tensors["chain.parents"].tolist())]


def write_blocks(tensors, layer_groups, placed, storage, pool_sizes, device) -> int:
    """Copy loaded K/V into their new blocks (``placed[g]``: (position in the group's entries, block))."""
    loaded = 0
    for g, (group, pairs) in enumerate(zip(layer_groups, placed)):
        if not pairs:
            continue
        rows = torch.tensor([pos for pos, _ in pairs], dtype=torch.long)
        blocks = torch.tensor([b for _, b in pairs], dtype=torch.long)
        for layer in group.layers:
            name = f"group{g}.layer{layer}"
            if f"{name}.keys" not in tensors:
                continue
            keys, values = tensors[f"{name}.keys"], tensors[f"{name}.values"]
            pool = storage.key_pools.get(layer)
            target = pool.device if pool is not None else device
            storage.ensure_layer(layer, keys[0].to(target), pool_sizes[g], values[0].to(target))  # creates or grows the pools
            for pools, data in ((storage.key_pools, keys), (storage.value_pools, values)):
                dst = pools[layer]
                dst.index_copy_(0, blocks.to(dst.device), data.index_select(0, rows).to(dst.device, dst.dtype))
        loaded += len(pairs)
    return loaded


def shard_path(path, rank: int = 0, world_size: int = 1) -> Path:
    """The file of one tensor-parallel rank: ``prefix.safetensors`` -> ``prefix.rank1-of-2.safetensors``
    (``path`` itself without tensor parallelism)."""
    path = Path(path)
    return path if world_size == 1 else path.with_name(f"{path.stem}.rank{rank}-of-{world_size}{path.suffix}")


def save_index(path, model, index, storage, rank: int = 0, world_size: int = 1, exported=None) -> int:
    """Save a prefix index's cached blocks (``PrefixIndex``; or ``exported``, its ``export()`` made
    on rank 0) with their K/V from ``storage``, to this rank's :func:`shard_path`."""
    chain, groups = exported if exported is not None else index.export()
    return save(shard_path(path, rank, world_size), fingerprint(model, model.dtype, index.block_size, rank, world_size),
                chain, groups, index.groups, storage)


def read_for(path, model, index, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
    """Read and check this rank's snapshot file for ``model`` and ``index`` (nothing is applied)."""
    expected = fingerprint(model, model.dtype, index.block_size, rank, world_size)
    return read(shard_path(path, rank, world_size), expected, len(index.groups))[0]


def place(index, tensors: dict[str, torch.Tensor]) -> list[list[tuple[int, int]]]:
    """Register a checked snapshot's blocks in ``index``: where each one's K/V must go (per group)."""
    entries = [tensors[f"group{g}.entries"].tolist() for g in range(len(index.groups))]
    return index.import_(chain_of(tensors), entries)


def load_index(path, model, index, storage) -> int:
    """Read and check a snapshot, then add its blocks to a prefix index and their K/V to ``storage``
    (nothing changes when the checks fail). Returns the blocks loaded."""
    tensors = read_for(path, model, index)
    placed = place(index, tensors)
    pool_sizes = [manager.num_blocks for manager in index.blocks.managers]
    return write_blocks(tensors, index.groups, placed, storage, pool_sizes, model.device)
