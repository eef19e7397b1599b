"""The connector's settings, read from ``kv_connector_extra_config``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from prefixvault.keys import MAX_NAMESPACE, TAG_CHARS, check_namespace
from prefixvault.layout import CacheLayout
from prefixvault.stores import StoreError, check_uri
from prefixvault.tenancy import NamespaceKey, SecretError, namespace_key


class CapturePolicy(StrEnum):
    """Which exact states a producer stores.

    ``checkpoints``: only the states the engine offers (its prompt checkpoints).
    ``steps``: also the state every prefill step leaves when it ends on a block boundary.
    ``interval``: checkpoints, plus step-end states at most once per ``capture_interval`` tokens.
    ``marconi``: junctions (where a prompt leaves a prefix shared with an earlier request) and
    sequence ends, as Marconi admits. ``reuse``: junctions, and sequence ends while they are
    being restored (``prefixvault.admission``).
    """

    CHECKPOINTS = "checkpoints"
    STEPS = "steps"
    INTERVAL = "interval"
    MARCONI = "marconi"
    REUSE = "reuse"


class RestoreWhen(StrEnum):
    """Which hits are restored (``prefixvault.costs``).

    ``faster``: only a hit whose load is expected to end sooner than computing its tokens (the
    store's round trips and transfer against the engine's prefill, both measured as it runs);
    a request that could not restore enough to pay for a round trip is not looked up.
    ``always``: every hit, whatever it costs (the costs are still measured and exported).
    """

    FASTER = "faster"
    ALWAYS = "always"


class OutputBoundaries(StrEnum):
    """Which boundaries over generated tokens ``capture_outputs`` publishes.

    ``last``: only the last one before the request finishes (its sequence end): the state is
    copied at each output boundary and kept in host memory (``save_hold_mib``), replacing the
    previous one, and stored once the request finishes (stopped, length, or aborted, as a stop
    string ends it); a failed request stores none, a preempted one drops its hold.
    ``every``: every output boundary, as its decode step ends.
    """

    LAST = "last"
    EVERY = "every"


@dataclass(frozen=True)
class ConnectorSettings:
    store: str = "local://"
    namespace: str = "default"
    capture: CapturePolicy = CapturePolicy.STEPS
    capture_interval: int = 0
    model_id: str = ""  # overrides the model name in the layout fingerprint
    verify_sample: float = 0.0  # fraction of restored greedy requests written as verification samples
    # Publish boundaries over generated tokens too (a conversation's next turn restores its
    # previous answer); capture policies thin them as they thin prompt boundaries. Off by
    # default: a decode step's KV and states round differently from a prefill's, so restoring
    # them is equivalent to a cold run, not bit-identical (tests/test_vllm_conversation.py).
    capture_outputs: bool = False
    output_boundaries: OutputBoundaries = OutputBoundaries.LAST
    # Host memory (MiB per worker) for the states ``output_boundaries: last`` keeps until their
    # requests finish; a request finding every slot taken holds nothing until one is free.
    save_hold_mib: int = 256
    lookup_timeout: float = 1.0  # seconds a lookup may take before its request is computed without it
    # Seconds a load may take, plus its bytes at 64 MiB/s, before its request is computed
    # without it (a late load counts as a store failure for the breaker).
    load_timeout: float = 5.0
    # Host memory (MiB per worker) for saves copied out of the engine and not yet stored; a
    # save that does not fit is dropped. 0: saves are stored inside the engine's step. None
    # ("auto", the default): sized from the model's geometry (``staging_bytes``).
    save_staging_mib: int | None = None
    save_drain_timeout: float = 30.0  # seconds a stopping engine waits for queued saves
    # Host memory (MiB per worker) for objects recently loaded, served again without the store
    # (``HotSet``). None ("auto", the default): ``HOT_SET_MIB`` for a network store, 0 for a
    # local or in-process one (a load there is a memcpy: a copy would only double memory).
    load_cache_mib: int | None = None
    # Whether a step waits (up to 50 ms) for the lookups and loads it starts, so that a restore
    # takes no step of its own (one rank: the lookup reads the objects too and the load is
    # written before the forward that runs the first chunk; several: the first chunk runs in the
    # next step), or lets them finish beside later steps. None ("auto", the default): waits on
    # a CPU engine over a local or in-process store, where a read is a copy; not over a network
    # store, whose round trips must never hold the step, nor on a GPU engine, which would lose
    # the overlap of its steps.
    restore_in_step: bool | None = None
    restore_when: RestoreWhen = RestoreWhen.FASTER
    # Where the namespace's secret is (a file path, or an environment variable's name); the
    # secret itself is never part of the config, so it never reaches vLLM's logs.
    namespace_secret_file: str = ""
    namespace_secret_env: str = ""
    # Each tenant's (request's ``cache_salt``'s) keys under a namespace of its own,
    # ``{namespace}.{tag}``, for the store to bound each tenant's share (the local store's
    # ``namespace_share``): one tenant filling the store evicts its own objects first. Needs the
    # secret (a tenant is a key) and a namespace of at most 47 characters.
    tenant_namespaces: bool = False

    def namespace_key(self) -> NamespaceKey | None:
        """The namespace's derived keys; None if it has no secret."""
        return namespace_key(self.namespace, self.namespace_secret_file, self.namespace_secret_env)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {"store", "namespace", "capture", "capture_interval", "model_id", "verify_sample",
                 "namespace_secret_file", "namespace_secret_env", "capture_outputs", "lookup_timeout",
                 "load_timeout", "save_staging_mib", "save_drain_timeout", "output_boundaries",
                 "save_hold_mib", "load_cache_mib", "restore_in_step",
                 "restore_when", "tenant_namespaces"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"prefixvault: unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(known)}"
            )
        for key in ("store", "namespace", "capture", "model_id", "output_boundaries", "restore_when"):
            _text(extra, key)
        for key in ("namespace_secret_file", "namespace_secret_env"):
            if extra.get(key) is not None:
                _text(extra, key)
        capture = str(extra.get("capture", CapturePolicy.STEPS.value))
        m = re.fullmatch(r"interval:(\d{1,12})", capture)
        interval = _whole(extra.get("capture_interval", 0), "capture_interval")
        if m:
            capture, interval = CapturePolicy.INTERVAL.value, int(m.group(1))
        try:
            policy = CapturePolicy(capture)
        except ValueError:
            raise ValueError(
                f"prefixvault: capture must be one of steps, checkpoints, interval:N, marconi, reuse; "
                f"got {capture[:100]!r}"
            ) from None
        if policy is CapturePolicy.INTERVAL and interval <= 0:
            raise ValueError("prefixvault: capture 'interval' needs a positive capture_interval")
        boundaries = str(extra.get("output_boundaries", OutputBoundaries.LAST.value))
        if boundaries not in {b.value for b in OutputBoundaries}:
            raise ValueError(f"prefixvault: output_boundaries must be last or every, "
                             f"got {boundaries[:100]!r}")
        when = str(extra.get("restore_when", RestoreWhen.FASTER.value))
        if when not in {w.value for w in RestoreWhen}:
            raise ValueError(f"prefixvault: restore_when must be faster or always, got {when[:100]!r}")
        namespace = check_namespace(str(extra.get("namespace", "default")))
        try:
            check_uri(str(extra.get("store", "local://")))
        except StoreError as e:
            raise ValueError(f"prefixvault: {e}") from None
        try:
            raw = extra.get("verify_sample", 0.0)
            verify_sample = -1.0 if isinstance(raw, bool) else float(raw)
        except (TypeError, ValueError):
            verify_sample = -1.0
        if not 0.0 <= verify_sample <= 1.0:
            raise ValueError(f"prefixvault: verify_sample must be a number in [0, 1], got "
                             f"{str(extra.get('verify_sample'))[:100]!r}")
        out = cls(
            store=str(extra.get("store", "local://")),
            namespace=namespace,
            capture=policy,
            capture_interval=interval,
            model_id=str(extra.get("model_id", "")),
            verify_sample=verify_sample,
            namespace_secret_file=str(extra.get("namespace_secret_file") or ""),
            namespace_secret_env=str(extra.get("namespace_secret_env") or ""),
            capture_outputs=_flag(extra.get("capture_outputs", False), "capture_outputs"),
            output_boundaries=OutputBoundaries(boundaries),
            save_hold_mib=_mib(extra.get("save_hold_mib", 256), "save_hold_mib"),
            lookup_timeout=_seconds(extra.get("lookup_timeout", 1.0), "lookup_timeout"),
            load_timeout=_seconds(extra.get("load_timeout", 5.0), "load_timeout"),
            save_staging_mib=None if str(extra.get("save_staging_mib", "auto")) == "auto"
            else _mib(extra.get("save_staging_mib"), "save_staging_mib"),
            save_drain_timeout=_seconds(extra.get("save_drain_timeout", 30.0), "save_drain_timeout"),
            load_cache_mib=None if str(extra.get("load_cache_mib", "auto")) == "auto"
            else _mib(extra.get("load_cache_mib"), "load_cache_mib"),
            restore_in_step=_auto_flag(extra.get("restore_in_step", "auto"), "restore_in_step"),
            restore_when=RestoreWhen(when),
            tenant_namespaces=_flag(extra.get("tenant_namespaces", False), "tenant_namespaces"),
        )
        try:
            out.namespace_key()  # a secret that cannot be read fails at start, not at the first request
        except SecretError as e:
            raise ValueError(f"prefixvault: {e}") from None
        if out.tenant_namespaces:
            if not (out.namespace_secret_file or out.namespace_secret_env):
                raise ValueError("prefixvault: tenant_namespaces needs namespace_secret_file or "
                                 "namespace_secret_env (a tenant is a key derived from the secret)")
            if out.verify_sample > 0:
                raise ValueError("prefixvault: verify_sample does not work with tenant_namespaces yet (a "
                                 "watcher reads samples from the namespace's own keys): set one of them")
            if len(namespace) > MAX_NAMESPACE - 1 - TAG_CHARS:
                raise ValueError(f"prefixvault: with tenant_namespaces the namespace may have at most "
                                 f"{MAX_NAMESPACE - 1 - TAG_CHARS} characters ({{namespace}}.{{tenant tag}} "
                                 f"is a namespace too), got {len(namespace)}")
        return out


#: The hot set ``load_cache_mib: auto`` keeps per worker over a network store.
HOT_SET_MIB = 512


def hot_set_bytes(settings: ConnectorSettings, remote: bool) -> int:
    """The hot set of one worker: ``load_cache_mib``, or, on ``auto``, ``HOT_SET_MIB`` over a
    network store and none over a local one."""
    if settings.load_cache_mib is not None:
        return settings.load_cache_mib << 20
    return HOT_SET_MIB << 20 if remote else 0


#: How long a step waits, with ``restore_in_step``, for the lookups it starts (in all) and for the
#: loads it started: what answers or lands by then is in that step.
IN_STEP_WAIT_S = 0.05


def restores_in_step(settings: ConnectorSettings, remote: bool, device: str) -> bool:
    """Whether a step waits for its lookups and loads: ``restore_in_step``, or, on ``auto``, on
    a CPU engine (``device``: vLLM's platform device type) over a store that is not a network
    one. Never on another device (``in_step_refused``)."""
    if device != "cpu":
        return False
    if settings.restore_in_step is not None:
        return settings.restore_in_step
    return not remote


def hands_over_loads(settings: ConnectorSettings, device: str) -> bool:
    """Whether a lookup reads its hit's objects ahead and hands them to the engine's worker, so
    that the load is synchronous (the first chunk runs in the step that takes the answer): on a
    CPU engine unless ``restore_in_step`` is ``false``, over any store. Over a network store no
    step waits for it (``restores_in_step``): the lookup and its read run on the lookup lane
    beside the steps, and the step that takes the answer runs the first chunk, one step sooner
    than after a load beside the steps, which also pays its own round trip after the answer."""
    return device == "cpu" and settings.restore_in_step is not False


def in_step_refused(settings: ConnectorSettings, device: str) -> str | None:
    """Why ``restore_in_step: true`` is not followed on this device, or None. A synchronous
    load that a worker cannot write is reported as block errors, which vLLM 0.32-0.34 answer by
    stopping an engine of several cache groups (every hybrid); on a CPU engine its bytes are
    read, verified and handed over before it is promised, but a GPU engine's steps overlap
    (a wait after the forward gives that up) and its loads are staged through the device, so
    its restores load beside the steps, where a failed load costs a recompute."""
    if settings.restore_in_step and device != "cpu":
        return (f"restore_in_step: true is refused on a {device} engine (a synchronous load that failed "
                "would stop a hybrid engine, and the wait gives up the overlap of its steps): restores "
                "load beside the steps")
    return None


#: Bounds of the staging budget ``save_staging_mib: auto`` sizes (per worker, pinned on a GPU).
AUTO_STAGING_MIN = 256 << 20
AUTO_STAGING_MAX = 4 << 30
#: The save device buffer at most (``save_device_bytes``), outside vLLM's KV cache budget.
SAVE_DEVICE_MAX = 1 << 30


def staging_bytes(settings: ConnectorSettings, layout: CacheLayout, vllm_config: Any) -> int:
    """The save staging budget of one worker: ``save_staging_mib``, or, on ``auto``, room for
    two of the saves a prefill step makes (every block its token budget touches, and one
    boundary's states at the chunk's end and one at a checkpoint), so that one step stages
    while the previous one is being stored; within [256 MiB, 4 GiB]. A larger save is dropped
    and counted (``save_dropped:too_large``)."""
    if settings.save_staging_mib is not None:
        return settings.save_staging_mib << 20
    return min(max(2 * step_save_bytes(layout, vllm_config), AUTO_STAGING_MIN), AUTO_STAGING_MAX)


def step_save_bytes(layout: CacheLayout, vllm_config: Any) -> int:
    """Bytes of the save a prefill step makes on the largest rank: every block its token budget
    (``max_num_batched_tokens``) touches, and one boundary's states at the chunk's end and one
    at a checkpoint."""
    tokens = int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", 0) or 0)
    blocks = max(tokens, layout.block_size) // layout.block_size + 1
    step = 0
    for rank in range(layout.world_size):
        attention = sum(g.nbytes(rank) for g in layout.groups if not g.is_state)
        states = sum(g.nbytes(rank) for g in layout.groups if g.is_state)
        step = max(step, blocks * attention + 2 * states)
    return step


def save_device_bytes(layout: CacheLayout, vllm_config: Any) -> int:
    """The device buffer one worker's saves go through on CUDA: one prefill step's save
    (``step_save_bytes``; a step's gathers all land in it before the engine goes on), at most
    ``SAVE_DEVICE_MAX``. A step saving more goes in rounds (the engine then waits for the
    earlier rounds' transfers to the host)."""
    return min(step_save_bytes(layout, vllm_config), SAVE_DEVICE_MAX)


def _text(extra: dict[str, Any], key: str) -> None:
    """A setting that must be a string when given (JSON null, numbers and lists are refused with
    the key's name rather than turned into text such as "None")."""
    if key in extra and not isinstance(extra[key], str):
        raise ValueError(f"prefixvault: {key} must be a string, got {type(extra[key]).__name__} "
                         f"{str(extra[key])[:100]!r}")


def _whole_number(value: Any) -> int:
    """``value`` as a whole number, or -1 (JSON null, booleans, inf, fractions, lists)."""
    try:
        return int(value) if not isinstance(value, bool) and float(value) == int(value) else -1
    except (TypeError, ValueError, OverflowError):
        return -1


def _whole(value: Any, name: str) -> int:
    """A whole number of tokens (huge values refused too)."""
    n = _whole_number(value)
    if not 0 <= n <= 1 << 40:
        raise ValueError(f"prefixvault: {name} must be a whole number of tokens >= 0, "
                         f"got {str(value)[:100]!r}")
    return n


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"prefixvault: {name} must be true or false, got {str(value)[:100]!r}")


def _auto_flag(value: Any, name: str) -> bool | None:
    """``auto`` (None: the connector decides), or a flag."""
    if str(value).lower() == "auto":
        return None
    try:
        return _flag(value, name)
    except ValueError:
        raise ValueError(f"prefixvault: {name} must be auto, true or false, "
                         f"got {str(value)[:100]!r}") from None


def _seconds(value: Any, name: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 < seconds <= 600:
        raise ValueError(f"prefixvault: {name} must be a number of seconds in (0, 600], "
                         f"got {str(value)[:100]!r}")
    return seconds


def _mib(value: Any, name: str) -> int:
    mib = _whole_number(value)
    if not 0 <= mib <= 1 << 20:
        raise ValueError(f"prefixvault: {name} must be a whole number of MiB in [0, 1048576], "
                         f"got {str(value)[:100]!r}")
    return mib
