"""The errors every layer sorts by: the store's (unavailable, refused) against our own.

They live below the stores so that anything shared by every layer (the lane, the guard) can
tell a store's failure from a bug of ours without importing a store. ``stores.base`` and
``stores.breaker`` export them under their usual names.
"""

from __future__ import annotations


class StoreError(Exception):
    """A store could not do what was asked (bad URI, unreachable, full, corrupt index)."""


class StoreUnavailable(StoreError):
    """The store is configured right but cannot be reached now (server down, timed out)."""


class BreakerOpen(StoreUnavailable):
    """The store is not called: it failed too often and its next probe is not due yet."""
