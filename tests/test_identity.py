"""Weights and adapters are named by content: replaced in place, they get other keys."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from prefixvault import identity
from prefixvault.identity import content_digest, model_content
from prefixvault.keys import chain_hashes
from prefixvault.vllm.request import extra_keys


def _checkpoint(root: Path, seed: int, big: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"hidden_size": 8}')
    size = identity.FULL_HASH_LIMIT + (5 << 20) if big else 4096
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    header = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    (root / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    (root / "README.md").write_text("not part of the identity")
    return root


def test_a_checkpoint_replaced_in_place_gets_another_digest(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "m", seed=1)
    first = content_digest(ckpt)
    assert content_digest(ckpt) == first == model_content(str(ckpt))
    (ckpt / "README.md").write_text("edited")
    assert content_digest(ckpt) == first  # not a weight or config file
    _checkpoint(tmp_path / "m", seed=2)  # a new fine-tune, same path, same names and shapes
    assert content_digest(ckpt) != first
    (ckpt / "config.json").write_text('{"hidden_size": 9}')
    assert len({first, content_digest(ckpt)}) == 2


def test_large_weights_are_sampled_and_still_told_apart(tmp_path: Path) -> None:
    a = content_digest(_checkpoint(tmp_path / "a", seed=1, big=True))
    b = content_digest(_checkpoint(tmp_path / "b", seed=2, big=True))
    assert a != b
    # Same bytes at another path: same content, same identity.
    assert content_digest(_checkpoint(tmp_path / "c", seed=1, big=True)) == a


def test_unreadable_models_have_no_content_identity(tmp_path: Path) -> None:
    assert model_content(str(tmp_path / "nowhere")) is None
    assert model_content("no-such-org/no-such-model-anywhere") is None


def test_an_adapter_replaced_in_place_changes_the_request_keys(tmp_path: Path) -> None:
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\x01" * 1000)

    def request() -> SimpleNamespace:
        lora = SimpleNamespace(lora_name="sql", lora_path=str(adapter))
        return SimpleNamespace(lora_request=lora, cache_salt=None, mm_features=None)

    tokens = list(range(32))
    before = chain_hashes(tokens, 16, extra_keys(request()))
    assert chain_hashes(tokens, 16, extra_keys(request())) == before
    (adapter / "adapter_model.safetensors").write_bytes(b"\x02" * 1000)
    os.utime(adapter / "adapter_model.safetensors", ns=(1, 1))
    assert chain_hashes(tokens, 16, extra_keys(request())) != before
    # An adapter whose files cannot be read is still keyed, by name and path.
    gone = SimpleNamespace(lora_request=SimpleNamespace(lora_name="x", lora_path=str(tmp_path / "gone")),
                           cache_salt=None, mm_features=None)
    assert extra_keys(gone).lora == f"x:{tmp_path / 'gone'}"


def test_hidden_entries_are_left_out_and_a_huge_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``.git`` or a virtual environment beside the weights changes nothing; a path such as
    "." or "/" given by mistake is refused after ``MAX_ENTRIES``, not walked to its end."""
    ckpt = _checkpoint(tmp_path / "m", seed=1)
    first = content_digest(ckpt)
    (ckpt / ".venv" / "lib").mkdir(parents=True)
    (ckpt / ".venv" / "lib" / "x.json").write_text("{}")
    (ckpt / ".hidden.json").write_text("{}")
    os.utime(ckpt / "config.json")  # a fresh listing, not the per-process cache
    assert content_digest(ckpt) == first
    monkeypatch.setattr(identity, "MAX_ENTRIES", 3)
    (ckpt / "more.json").write_text("{}")
    try:
        content_digest(ckpt)
    except OSError as e:
        assert "not a checkpoint directory" in str(e)
    else:
        raise AssertionError("a directory past MAX_ENTRIES was walked")
