"""A reference CPU implementation of vLLM's Mamba1 prefill scan, for tests only.

vLLM's CPU build has no ``_C::selective_scan_fwd`` (the CUDA kernel behind
``vllm.model_executor.layers.mamba.ops.mamba_ssm.selective_scan_fn``), so a Mamba1 layer
(Mamba, Jamba, Falcon-Mamba) fails at its first prefill on CPU. ``register()`` defines that
op with the CUDA kernel's schema and a plain PyTorch loop over the tokens as its CPU kernel,
so tests can run Mamba1 models end to end. The rest of the Mamba1 layer (causal conv1d,
the decode-step ``selective_state_update``) already has CPU kernels in vLLM.

Two more gaps, found by running: vLLM CPU's decode-step kernel
(``_C::selective_state_update_cpu``) takes only Mamba2's 4-D state (``IndexError: Dimension
out of range``), so ``register()`` routes the Mamba1 layer's 3-D decode step to
``selective_state_update`` below; and vLLM CPU's Mamba1 layer hands ``out_proj`` a transposed
(non-contiguous) tensor, which the CPU oneDNN GEMM refuses (``RuntimeError: Expected
a.stride(-1) == 1``, mamba_mixer.py ``forward_impl``), so that projection gets a contiguous
copy (same values, same output). Both patches touch only ``mamba_mixer`` (Mamba1).

It is never loaded by prefixvault itself: the tests put ``tests/vllm_support/site`` on an
engine's PYTHONPATH, whose ``sitecustomize`` calls ``register()`` at interpreter start.

Semantics (vLLM's ``csrc/mamba/mamba_ssm/selective_scan_fwd.cu``, varlen layout):

- ``u``, ``delta``, ``z``: (dim, total_tokens); ``A``: (dim, dstate), float32;
  ``B``, ``C``: (ngroups, dstate, total_tokens); ``D``, ``delta_bias``: (dim,), float32;
  ``query_start_loc``: (batch + 1,) token offsets of each sequence;
  ``ssm_states``: (cache lines, dim, dstate); ``cache_indices``: (batch,) the line each
  sequence reads its initial state from and writes its final state to;
  ``has_initial_state``: (batch,) whether that line holds a state to continue from (else
  the scan starts from zeros).
- per token: ``dt = delta + delta_bias`` (softplus'd if ``delta_softplus``, identity above 20),
  ``x = exp(dt * A) * x + dt * B * u``, ``y = C . x + D * u``; ``delta`` receives ``y`` and,
  with ``z``, ``z`` receives ``y * silu(z)`` (the caller reads ``z``, else ``delta``).
- a sequence whose cache index is ``null_block_id`` is padding: nothing is read or written.
- the prefix-caching "all" mode arguments (2-D ``cache_indices`` with block indices) are
  refused: vLLM 0.32's Mamba1 layer never passes them (it caches Mamba1 in align mode only).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch

SCHEMA = (
    "selective_scan_fwd(Tensor u, Tensor(a!) delta, Tensor A, Tensor B, Tensor C, Tensor? D_, "
    "Tensor(b!)? z_, Tensor? delta_bias_, bool delta_softplus, Tensor? query_start_loc, "
    "Tensor? cache_indices, Tensor? has_initial_state, Tensor(c!) ssm_states, int null_block_id, "
    "int block_size, Tensor? block_idx_first_scheduled_token, Tensor? block_idx_last_scheduled_token, "
    "Tensor? initial_state_idx, Tensor? cu_chunk_seqlen, Tensor? last_chunk_indices) -> ()"
)

_lib: torch.library.Library | None = None


def scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
         D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
         delta_softplus: bool, x0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence: u, delta, z (dim, L); B, C (groups, dstate, L); x0 (dim, dstate) or None.
    Returns (y + D*u, gated output or that same tensor, final state), all float32."""
    dim, length = u.shape
    groups = B.shape[0]
    per_group = dim // groups
    uf, dt = u.float(), delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[:, None]
    if delta_softplus:
        dt = torch.where(dt <= 20.0, torch.log1p(torch.exp(dt)), dt)
    Af = A.float()
    # (groups, dstate, L) -> (dim, dstate, L): each channel reads its group's B and C
    Bf = B.float().repeat_interleave(per_group, dim=0)
    Cf = C.float().repeat_interleave(per_group, dim=0)
    x = torch.zeros(dim, A.shape[1], dtype=torch.float32) if x0 is None else x0.float().clone()
    ys = torch.empty(dim, length, dtype=torch.float32)
    for t in range(length):
        x = torch.exp(dt[:, t, None] * Af) * x + (dt[:, t] * uf[:, t])[:, None] * Bf[:, :, t]
        ys[:, t] = (x * Cf[:, :, t]).sum(-1)
    if D is not None:
        ys = ys + D.float()[:, None] * uf
    gated = ys if z is None else ys * torch.nn.functional.silu(z.float())
    return ys, gated, x


def selective_scan_fwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, D_: torch.Tensor | None, z_: torch.Tensor | None,
                       delta_bias_: torch.Tensor | None, delta_softplus: bool,
                       query_start_loc: torch.Tensor | None, cache_indices: torch.Tensor | None,
                       has_initial_state: torch.Tensor | None, ssm_states: torch.Tensor,
                       null_block_id: int, block_size: int,
                       block_idx_first_scheduled_token: torch.Tensor | None,
                       block_idx_last_scheduled_token: torch.Tensor | None,
                       initial_state_idx: torch.Tensor | None, cu_chunk_seqlen: torch.Tensor | None,
                       last_chunk_indices: torch.Tensor | None) -> None:
    block_indices = (block_idx_first_scheduled_token, block_idx_last_scheduled_token, initial_state_idx)
    if any(t is not None for t in block_indices) or (cache_indices is not None and cache_indices.dim() != 1):
        raise NotImplementedError("reference selective_scan_fwd: prefix caching's 'all' mode")
    if query_start_loc is None:  # (batch, dim, L) layout: one sequence per batch row
        if u.dim() != 3:
            raise ValueError("selective_scan_fwd: u must be (batch, dim, L) without query_start_loc")
        spans = [(b, None) for b in range(u.shape[0])]
    else:
        starts = query_start_loc.tolist()
        spans = [(b, (starts[b], starts[b + 1])) for b in range(len(starts) - 1)]
    for b, span in spans:
        line = int(cache_indices[b]) if cache_indices is not None else b
        if cache_indices is not None and line == null_block_id:
            continue  # padding
        if span is None:
            sel = (b, slice(None), slice(None))
            bsel = (b, slice(None), slice(None), slice(None))
        else:
            sel = (slice(None), slice(span[0], span[1]))
            bsel = (slice(None), slice(None), slice(span[0], span[1]))
        if span is not None and span[1] <= span[0]:
            continue
        initial = has_initial_state is not None and bool(has_initial_state[b])
        x0 = ssm_states[line] if initial else None
        ys, gated, x = scan(u[sel], delta[sel], A, B[bsel], C[bsel], D_, None if z_ is None else z_[sel],
                            delta_bias_, delta_softplus, x0)
        delta[sel] = ys.to(delta.dtype)
        if z_ is not None:
            z_[sel] = gated.to(z_.dtype)
        ssm_states[line] = x.to(ssm_states.dtype)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hook(module)`` once ``name`` has been imported."""

    def __init__(self, name: str, hook: Callable[[Any], None]) -> None:
        self.name, self.hook = name, hook

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, hook = spec.loader, self.hook

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                hook(module)

        spec.loader = Loader()
        return spec


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                           dt_bias: torch.Tensor | None, z: torch.Tensor | None = None,
                           dt_softplus: bool = False, state_batch_indices: torch.Tensor | None = None,
                           dst_state_batch_indices: torch.Tensor | None = None,
                           null_block_id: int = 0, out: torch.Tensor | None = None,
                           **unsupported: Any) -> None:
    """One decode step of a Mamba1 layer (vLLM's ``selective_state_update`` with a 3-D state
    (cache lines, dim, dstate); x, dt, z, out (batch, dim); B, C (batch, dstate)): per
    sequence, read its line, advance one token, write the line ``dst`` names and ``out``."""
    if any(v is not None and v is not False for v in unsupported.values()):
        raise NotImplementedError(f"reference selective_state_update: {sorted(unsupported)}")
    assert out is not None
    src = state_batch_indices.reshape(x.shape[0], -1)[:, 0] if state_batch_indices is not None else None
    dst = (dst_state_batch_indices.reshape(x.shape[0], -1)[:, 0]
           if dst_state_batch_indices is not None else src)
    for b in range(x.shape[0]):
        line = int(src[b]) if src is not None else b
        if src is not None and line == null_block_id:
            continue
        d = dt[b].float() + (dt_bias.float() if dt_bias is not None else 0.0)
        if dt_softplus:
            d = torch.where(d <= 20.0, torch.log1p(torch.exp(d)), d)
        xb = x[b].float()
        h = (torch.exp(d[:, None] * A.float()) * state[line].float()
             + (d * xb)[:, None] * B[b].float()[None, :])
        y = (h * C[b].float()[None, :]).sum(-1)
        if D is not None:
            y = y + D.float() * xb
        if z is not None:
            y = y * torch.nn.functional.silu(z[b].float())
        out[b] = y.to(out.dtype)
        state[int(dst[b]) if dst is not None else b] = h.to(state.dtype)


def _patch_mixer(module: Any) -> None:
    update = module.selective_state_update

    def dispatch(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        (selective_state_update if state.dim() == 3 else update)(state, *args, **kwargs)

    module.selective_state_update = dispatch
    mixer = module.MambaMixer
    init = mixer.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        forward = self.out_proj.forward
        self.out_proj.forward = lambda x: forward(x.contiguous())

    mixer.__init__ = __init__


def register() -> None:
    """Define ``torch.ops._C.selective_scan_fwd`` with the reference CPU kernel, unless the
    running build already has one (a GPU build's own kernel always wins), and make vLLM's
    CPU Mamba1 layer give its output projection a contiguous input."""
    global _lib
    if _lib is not None:
        return
    if not torch.cuda.is_available():
        sys.meta_path.insert(0, _AfterImport("vllm.model_executor.layers.mamba.mamba_mixer",
                                             _patch_mixer))
    else:  # the build's own ops first. Not on CPU: vLLM CPU has no selective_scan_fwd, and its
        # ``_C`` is the AVX-512 build (it dies of an illegal instruction on a CPU without it;
        # vLLM itself picks the library the CPU can run)
        with contextlib.suppress(ImportError):
            import vllm._C  # noqa: F401
    if hasattr(torch.ops._C, "selective_scan_fwd"):
        return
    _lib = torch.library.Library("_C", "FRAGMENT")
    _lib.define(SCHEMA)
    _lib.impl("selective_scan_fwd", selective_scan_fwd, "CPU")
