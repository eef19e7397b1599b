"""Configurations under which prefixvault cannot hit or cannot save, said once at start.

The most common complaint about hybrid prefix caching is a silent 0% hit rate. Each check
here names what is wrong and what to change, in one warning line, so that the first lines
of an engine's log answer it. (A store that is down is said where it is opened.)
"""

from __future__ import annotations

from typing import Any

from prefixvault.layout import CacheLayout, StateFamily
from prefixvault.vllm.compat import prefix_caching_advice
from prefixvault.vllm.config import CapturePolicy, ConnectorSettings, OutputBoundaries
from prefixvault.vllm.layout import CacheShape

#: Block sizes at or above this many tokens make hits coarse for typical chat prompts.
LARGE_BLOCK = 1024


def can_cache(vllm_config: Any, shape: CacheShape) -> bool:
    """False where the engine keeps no exact state at block boundaries: a hybrid model without
    prefix caching or without ``mamba_cache_mode="align"``, or one whose recurrent layers write
    their state back only now and then (ReplaySSM); the connector then stays out of the way
    and every request is computed."""
    return state_refusal(vllm_config, shape) is None


def state_refusal(vllm_config: Any, shape: CacheShape) -> str | None:
    """Why this engine keeps no exact state at block boundaries (one line), or None."""
    if not shape.has_state:
        return None
    cache = vllm_config.cache_config
    if not getattr(cache, "enable_prefix_caching", False):
        return ("prefix caching is off: a hybrid model can neither restore nor save exact states; "
                f"serve with {prefix_caching_advice()}")
    if getattr(cache, "mamba_cache_mode", "align") != "align":
        return (f"mamba_cache_mode is {cache.mamba_cache_mode!r}: the engine keeps no state at block "
                f"boundaries, so nothing can be saved or restored; serve with {prefix_caching_advice()}")
    if getattr(cache, "use_replayssm", False) is True:
        return ("use_replayssm is on: ReplaySSM writes a Mamba2 state back only every few steps, so "
                "the state at a step's end is not in its block; serve without --use-replayssm")
    return None


def preflight(vllm_config: Any, shape: CacheShape, settings: ConnectorSettings, role: str) -> list[str]:
    """One line per configuration problem, each saying what to change; empty when none."""
    out: list[str] = []
    max_len = int(getattr(vllm_config.model_config, "max_model_len", 0) or 0)
    bs = shape.block_size
    if shape.has_state:
        why = state_refusal(vllm_config, shape)
        if why:
            out.append(why)
        if (settings.capture is CapturePolicy.INTERVAL and max_len
                and settings.capture_interval > max_len):
            out.append(f"capture interval:{settings.capture_interval} is longer than max_model_len "
                       f"{max_len}: only the engine's own checkpoints are saved (about one per "
                       "prompt); use a shorter interval or capture 'steps'")
    if settings.capture_outputs and shape.has_state:
        out += outputs_silenced(vllm_config)
    if role == "kv_producer":
        out.append("kv_role is kv_producer: this engine saves but never restores; use kv_both "
                   "(or kv_consumer) on engines that should hit")
    elif role == "kv_consumer":
        out.append("kv_role is kv_consumer: this engine restores but never saves; use kv_both "
                   "(or a kv_producer engine) to fill the store")
    if role in ("kv_producer", "kv_both") and settings.save_staging_mib != 0 and \
            not int(getattr(vllm_config, "shutdown_timeout", 0) or 0):
        out.append("shutdown_timeout is 0: on SIGTERM vLLM kills the engine at once and saves still "
                   "queued for the store are lost; serve with --shutdown-timeout 45 (prefixvault "
                   "serve sets it)")
    if max_len and bs >= max_len:
        out.append(f"block size {bs} is not below max_model_len {max_len}: no prompt can leave a "
                   "token to compute after a whole block, so nothing ever hits; use a smaller "
                   "--block-size")
    elif bs >= LARGE_BLOCK:
        out.append(f"block size {bs}: only prompts longer than {bs} tokens can hit, and every hit "
                   "is rounded down to a multiple of it; a smaller --block-size hits more often")
    return out


def asynchronous(vllm_config: Any) -> bool:
    """Whether the engine schedules a step before the previous one's tokens are sampled."""
    return getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False) is True


def holds_outputs(settings: ConnectorSettings, vllm_config: Any) -> bool:
    """Whether decoding requests hold output boundaries' states (``save_hold_mib``): with
    ``output_boundaries: last`` each request's last one until it finishes; under async
    scheduling with ``every`` each one for the step or two until its token is known."""
    return settings.capture_outputs and (settings.output_boundaries is OutputBoundaries.LAST
                                         or asynchronous(vllm_config))


def outputs_silenced(vllm_config: Any) -> list[str]:
    """The settings under which ``capture_outputs`` publishes no output boundary (prompt
    boundaries, each prompt's exact end included, are published all the same). Async
    scheduling is not one: a decode step's boundary is held as the step ends and keyed once its
    token is known, with ``output_boundaries: last`` or ``every``."""
    out = []
    if getattr(vllm_config, "speculative_config", None) is not None:
        out.append("capture_outputs publishes no output boundary from a step with draft tokens (a "
                   "rejected draft leaves a state past what the request keeps): with speculative "
                   "decoding, only prompt boundaries are published")
    return out


def outputs_refused(layout: CacheLayout, hold_bytes: int | None = None) -> str | None:
    """Why ``capture_outputs`` must stay off for this model, or None. ``hold_bytes``: the
    ``save_hold_mib`` budget where output boundaries are held (``holds_outputs``; else None); one that
    cannot hold one boundary's states would keep blocks and hold lookups for nothing.

    A boundary is published only where its objects are the state at exactly that token count.
    For ShortConv layers that is not known of decode steps: on vLLM CPU their decode-computed
    KV blocks and states differ from the prefill-computed ones of the same tokens by far more
    than rounding (``tests/test_vllm_conversation.py`` measured it; ``bench/decode_vs_prefill.py``
    places it inside vLLM CPU's LFM2 layers), so a consumer could resume from objects no prefill
    would compute."""
    if any(g.family is StateFamily.SHORTCONV for g in layout.groups):
        return ("capture_outputs is off for this model: decode-computed KV blocks and states of "
                "its ShortConv layers differ from prefill-computed ones of the same tokens by far "
                "more than rounding (measured on vLLM CPU), so only prompt boundaries are published")
    if hold_bytes is not None:
        need = max(sum(g.nbytes(r) for g in layout.groups if g.is_state) for r in range(layout.world_size))
        if need and hold_bytes < need:
            return (f"capture_outputs is off: a decoding request holds one boundary's states "
                    f"({need} bytes per worker) in save_hold_mib ({hold_bytes >> 20} MiB; with "
                    "output_boundaries 'last', and under async scheduling with 'every'), which "
                    "cannot hold one; raise save_hold_mib (or, without async scheduling, set "
                    "output_boundaries to 'every')")
    return None
