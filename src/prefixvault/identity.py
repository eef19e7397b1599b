"""Content identity of weights: what a key must name so that other weights get other keys.

A path or a Hub name says where weights are, not what they are: a checkpoint replaced in place
(a new fine-tune, another revision of "main") would otherwise serve the old KV and states.
``content_digest`` names a checkpoint or an adapter directory by its files' names, sizes and
content, computed once per process. Files up to ``FULL_HASH_LIMIT`` are hashed whole (configs,
indexes, LoRA adapters); larger weight files by their safetensors header and evenly spread
samples, because reading 100 GB at engine start is not an option. A retrained or fine-tuned
checkpoint changes nearly every tensor, so the samples see it; an edit confined to bytes no
sample covers is not seen — name such weights with ``model_id`` or a revision.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

#: Files at most this large are hashed whole.
FULL_HASH_LIMIT = 64 << 20
#: Larger files: this many samples of ``SAMPLE_BYTES``, spread evenly (first and last included).
SAMPLES = 64
SAMPLE_BYTES = 64 << 10
#: The files that hold what changes a cache: weights and the configs that shape them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")

_cache: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


#: A directory with more entries than this is not a checkpoint (a path such as "." or "/"
#: given by mistake): refused rather than walked, since the walk runs where lookups wait.
MAX_ENTRIES = 100_000


def _unless_denied(e: OSError) -> None:
    """A listing error ends the walk; only a denied directory is skipped (as ``rglob`` did)."""
    if not isinstance(e, PermissionError):
        raise e


def _files(root: Path) -> list[Path]:
    """Weight and config files under ``root``, hidden files and directories left out (and not
    entered: a ``.git`` or a virtual environment beside the weights is not walked)."""
    if root.is_file():
        return [root]
    found: list[Path] = []
    seen = 0
    for top, dirs, names in os.walk(root, onerror=_unless_denied):
        seen += len(dirs) + len(names)
        if seen > MAX_ENTRIES:
            raise OSError(f"{root} holds over {MAX_ENTRIES} entries: not a checkpoint directory")
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(Path(top, n) for n in names if not n.startswith(".")
                     and Path(n).suffix in WEIGHT_SUFFIXES and Path(top, n).is_file())
    return sorted(found)


def _hash_file(h: hashlib.blake2b, path: Path, size: int) -> None:
    with path.open("rb") as f:
        if size <= FULL_HASH_LIMIT:
            while chunk := f.read(1 << 20):
                h.update(chunk)
            return
        if path.suffix == ".safetensors":  # the header names every tensor, dtype, shape, offset
            head = f.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                h.update(head + f.read(min(n, FULL_HASH_LIMIT)))
        for i in range(SAMPLES):
            f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))


def content_digest(path: str | os.PathLike[str]) -> str:
    """A 32-hex-digit digest of a checkpoint or adapter (a directory or one file).

    Cached per process by (path, every file's name, size and mtime), so asking again costs
    a directory listing. Raises OSError if the path cannot be read."""
    root = Path(path)
    files = _files(root)
    if not files:
        raise FileNotFoundError(f"no weight or config files under {root}")
    stats = tuple((str(p.relative_to(root)) if p != root else p.name, st.st_size, st.st_mtime_ns)
                  for p in files for st in [p.stat()])
    key = (str(root.resolve()), stats)
    found = _cache.get(key)
    if found is not None:
        return found
    h = hashlib.blake2b(digest_size=16, person=b"pv-weights")
    for p, (name, size, _) in zip(files, stats, strict=True):
        h.update(f"{len(name)}:{name}:{size};".encode())
        _hash_file(h, p, size)
    digest = h.hexdigest()
    _cache[key] = digest
    return digest


def model_content(model: str, revision: str | None = None) -> str | None:
    """The content digest of a model given as a local path or a Hub name already downloaded;
    None when its files cannot be found here (the caller says so)."""
    local = Path(model)
    if not local.exists():
        try:
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception:
            return None
    try:
        return content_digest(local)
    except OSError:
        return None
