"""What fails verification is read once more before it can cost an object (``read_twice``)."""

from __future__ import annotations

from test_vault import TearingStore

from prefixvault.codec import IntegrityError
from prefixvault.read_twice import read_opened


def checked(key: str, blob: bytes) -> bytes:
    if blob != b"whole" * 10:
        raise IntegrityError("payload checksum")
    return blob


def test_a_torn_read_is_read_again_and_only_a_second_failure_stands() -> None:
    store = TearingStore()
    store.put_many([("torn", [b"whole" * 10]), ("bad", [b"broken" * 10])])
    store.tear.add("torn")
    got = read_opened(store, ["torn", "bad", "gone"], checked)
    assert got[0] == b"whole" * 10 and not store.tear
    assert isinstance(got[1], IntegrityError) and got[1].reason == "payload checksum"
    assert got[2] is None
