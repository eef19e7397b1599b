"""Chain hashes, keys, layout fingerprints and the object codec."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixvault.codec import HEADER_SIZE, IntegrityError, ObjectHeader, ObjectKind, decode, encode
from prefixvault.keys import ExtraKeys, KeySpace, MultimodalItem, chain_hashes
from prefixvault.layout import CacheGroup, CacheLayout, GroupKind, TensorSpec


def test_chain_hashes_cover_the_whole_prefix() -> None:
    a = chain_hashes(list(range(64)), 16)
    b = chain_hashes([*range(20), 999, *range(21, 64)], 16)
    assert len(a) == 4
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))  # a change poisons every later block


def test_chain_hashes_partial_block_is_not_hashed() -> None:
    assert len(chain_hashes(list(range(31)), 16)) == 1
    assert chain_hashes([], 16) == []


def test_extra_keys_change_every_hash() -> None:
    toks = list(range(48))
    base = chain_hashes(toks, 16)
    for extra in (ExtraKeys(lora="adapter-a"), ExtraKeys(cache_salt="tenant-1"), ExtraKeys(epoch="e1")):
        assert all(x != y for x, y in zip(base, chain_hashes(toks, 16, extra), strict=True))
    # an epoch (after a reset of the engine's cache) is a key space of its own, salt or not
    salted = chain_hashes(toks, 16, ExtraKeys(cache_salt="tenant-1"))
    assert chain_hashes(toks, 16, ExtraKeys(cache_salt="tenant-1", epoch="e1"))[0] != salted[0]
    e1, e2 = (chain_hashes(toks, 16, ExtraKeys(epoch=e))[0] for e in ("e1", "e2"))
    assert e1 != e2
    assert chain_hashes(toks, 16, ExtraKeys(epoch=None)) == base  # (keys before any reset unchanged)
    mm = ExtraKeys(multimodal=(MultimodalItem("img-hash", offset=20, length=4),))
    with_mm = chain_hashes(toks, 16, mm)
    assert with_mm[0] == base[0]  # the image starts in block 1
    assert with_mm[1] != base[1] and with_mm[2] != base[2]


def test_resume_chain_from_known_hashes() -> None:
    toks = list(range(100))
    full = chain_hashes(toks, 8)
    assert chain_hashes(toks, 8, start=full[:5]) == full


def test_hashes_stable_across_processes_and_seeds() -> None:
    code = "from prefixvault.keys import chain_hashes; print(chain_hashes(list(range(40)), 8)[-1].hex())"
    outs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True).strip())
    assert outs == {chain_hashes(list(range(40)), 8)[-1].hex()}


def test_keys_hold_no_token_ids() -> None:
    ks = KeySpace("ns", bytes(16))
    h = chain_hashes([123456789] * 16, 16)[0]
    for key in (ks.block(0, 0, h), ks.state(1, 0, h), ks.record(h)):
        assert "123456789" not in key
        assert key.startswith("ns/")
    with pytest.raises(ValueError):
        KeySpace("bad ns!", bytes(16))


def _layout(**kw: object) -> CacheLayout:
    g = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((2, 16, 8), "float16")], 2)
    s = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((4, 4), "float32")], 2)
    base: dict[str, object] = {"model": "m", "block_size": 16, "groups": (g, s), "tp_size": 2}
    base.update(kw)
    return CacheLayout(**base)  # type: ignore[arg-type]


def test_fingerprint_covers_what_makes_bytes_compatible() -> None:
    fp = _layout().fingerprint()
    assert _layout().fingerprint() == fp
    assert CacheLayout.from_json(_layout().to_json()).fingerprint() == fp
    g = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((2, 16, 8), "bfloat16")], 2)
    s = CacheGroup.uniform(GroupKind.STATE, [TensorSpec((4, 4), "float32")], 2)
    others = [
        _layout(model="other"),
        _layout(revision="r2"),
        _layout(block_size=32),
        _layout(engine_layout_version="2"),
        _layout(groups=(g, s)),
        _layout(tp_size=1, pp_size=2),
    ]
    assert len({o.fingerprint() for o in others} | {fp}) == len(others) + 1


def test_layout_rejects_inconsistent_shards() -> None:
    g = CacheGroup.uniform(GroupKind.FULL_ATTENTION, [TensorSpec((1,), "float16")], 1)
    with pytest.raises(ValueError, match="rank shards"):
        CacheLayout(model="m", block_size=16, groups=(g,), tp_size=2)
    with pytest.raises(ValueError):
        CacheGroup.uniform(GroupKind.SLIDING_WINDOW, [TensorSpec((1,), "float16")])
    with pytest.raises(ValueError):
        TensorSpec((1,), "complex64")


def _header(length: int, **kw: object) -> ObjectHeader:
    base: dict[str, object] = dict(
        kind=ObjectKind.STATE,
        fingerprint=b"f" * 16,
        key_hash=b"h" * 16,
        group=1,
        rank=0,
        tokens=256,
        dtype="float32",
        shape=(length // 4,),
        length=length,
    )
    base.update(kw)
    return ObjectHeader(**base)  # type: ignore[arg-type]


def test_codec_round_trip() -> None:
    payload = np.arange(64, dtype=np.float32)
    parts = encode(_header(256), payload)
    blob = b"".join(bytes(p) for p in parts)
    assert len(blob) == HEADER_SIZE + 256
    header, view = decode(blob, _header(256))
    assert header == _header(256)
    assert np.array_equal(np.frombuffer(view, np.float32), payload)


@pytest.mark.parametrize(
    "field,value",
    [
        ("group", 2),
        ("rank", 1),
        ("tokens", 240),
        ("key_hash", b"x" * 16),
        ("fingerprint", b"g" * 16),
        ("kind", ObjectKind.BLOCK),
        ("dtype", "bfloat16"),
    ],
)
def test_codec_rejects_an_object_for_something_else(field: str, value: object) -> None:
    blob = b"".join(bytes(p) for p in encode(_header(64), bytes(64)))
    with pytest.raises(IntegrityError) as e:
        decode(blob, _header(64, **{field: value}))
    assert e.value.reason == "identity"


@given(st.data())
def test_codec_rejects_any_corruption_or_truncation(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 300))
    payload = data.draw(st.binary(min_size=n, max_size=n))
    blob = bytearray(b"".join(bytes(p) for p in encode(_header(n, shape=(n,), dtype="uint8"), payload)))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        del blob[data.draw(st.integers(0, len(blob) - 1)) :]
    else:
        blob += data.draw(st.binary(min_size=1, max_size=8))
    with pytest.raises(IntegrityError):
        decode(bytes(blob), _header(n, shape=(n,), dtype="uint8"))
