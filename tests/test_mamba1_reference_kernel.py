"""The tests' reference Mamba1 kernels (vllm_support/mamba1_ops.py) against transformers' own
PyTorch Mamba scan, and the varlen / cache-line semantics of vLLM's ``selective_scan_fwd``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
modeling_mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")

from vllm_support import mamba1_ops  # noqa: E402

DIM, DSTATE = 8, 4


def _inputs(length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "u": torch.randn(DIM, length, generator=g),
        "delta": torch.randn(DIM, length, generator=g),
        "A": -torch.rand(DIM, DSTATE, generator=g) - 0.1,
        "B": torch.randn(1, DSTATE, length, generator=g),
        "C": torch.randn(1, DSTATE, length, generator=g),
        "D": torch.randn(DIM, generator=g),
        "z": torch.randn(DIM, length, generator=g),
        "delta_bias": torch.randn(DIM, generator=g),
    }


def _hf(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' torch path: (batch, dim, L) layout, zero initial state."""
    out, state = modeling_mamba.mamba_selective_scan(
        x["u"][None], x["delta"][None], x["A"], x["B"], x["C"], x["D"], x["z"][None],
        delta_bias=x["delta_bias"], delta_softplus=True, return_last_state=True)
    return out[0], state[0]


def _vllm(x: dict[str, torch.Tensor], qsl: list[int], lines: list[int], initial: list[bool],
          states: torch.Tensor, null: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's calling convention: varlen tokens, output written into z (and delta)."""
    z, delta = x["z"].clone(), x["delta"].clone()
    mamba1_ops.selective_scan_fwd(
        x["u"], delta, x["A"], x["B"], x["C"], x["D"], z, x["delta_bias"], True,
        torch.tensor(qsl, dtype=torch.int32), torch.tensor(lines, dtype=torch.int32),
        torch.tensor(initial), states, null, 1024, None, None, None, None, None)
    return z, delta


def test_scan_equals_transformers_mamba_scan() -> None:
    x = _inputs(37)
    want, want_state = _hf(x)
    states = torch.full((3, DIM, DSTATE), 7.0)  # line 2 holds garbage: it must not be read
    z, delta = _vllm(x, [0, 37], [2], [False], states)
    torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[2], want_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(delta * torch.nn.functional.silu(x["z"]), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[:2], torch.full((2, DIM, DSTATE), 7.0))  # other lines untouched


def test_a_scan_resumed_from_its_cache_line_continues_exactly() -> None:
    x = _inputs(40, seed=1)
    full, full_state = _hf(x)
    first = {k: (v[..., :16] if v.shape[-1] == 40 else v) for k, v in x.items()}
    rest = {k: (v[..., 16:] if v.shape[-1] == 40 else v) for k, v in x.items()}
    states = torch.zeros(4, DIM, DSTATE)
    head, _ = _vllm(first, [0, 16], [3], [False], states)
    tail, _ = _vllm(rest, [0, 24], [3], [True], states)
    torch.testing.assert_close(torch.cat([head, tail], -1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[3], full_state, rtol=1e-5, atol=1e-5)
    # without has_initial_state the same line's state is ignored: the tail starts from zeros
    alone, _ = _vllm(rest, [0, 24], [3], [False], states.clone())
    torch.testing.assert_close(alone, _hf(rest)[0], rtol=1e-5, atol=1e-5)


def test_varlen_batch_and_null_block_padding() -> None:
    a, b = _inputs(9, seed=2), _inputs(5, seed=3)
    both = {k: torch.cat([a[k], b[k]], -1) if a[k].shape[-1] == 9 else a[k] for k in a}
    both["B"], both["C"] = torch.cat([a["B"], b["B"]], -1), torch.cat([a["C"], b["C"]], -1)
    b_same = {**b, **{k: a[k] for k in ("A", "D", "delta_bias")}}
    states = torch.zeros(3, DIM, DSTATE)
    z, _ = _vllm(both, [0, 9, 14], [1, 0], [False, False], states)  # sequence 2 is padding (null 0)
    torch.testing.assert_close(z[:, :9], _hf(a)[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(z[:, 9:], both["z"][:, 9:]), "a padded sequence was written"
    assert torch.equal(states[0], torch.zeros(DIM, DSTATE)) and torch.equal(states[2], states[0])
    z2, _ = _vllm(both, [0, 9, 14], [1, 2], [False, False], torch.zeros(3, DIM, DSTATE))
    torch.testing.assert_close(z2[:, 9:], _hf(b_same)[0], rtol=1e-5, atol=1e-5)


def test_decode_step_equals_one_more_scanned_token() -> None:
    x = _inputs(12, seed=4)
    full, full_state = _hf(x)
    first = {k: (v[..., :11] if v.shape[-1] == 12 else v) for k, v in x.items()}
    states = torch.zeros(2, DIM, DSTATE)
    _vllm(first, [0, 11], [1], [False], states)
    out = torch.empty(1, DIM)
    mamba1_ops.selective_state_update(
        states, x["u"][:, 11][None], x["delta"][:, 11][None], x["A"], x["B"][0, :, 11][None],
        x["C"][0, :, 11][None], x["D"], x["delta_bias"], z=x["z"][:, 11][None], dt_softplus=True,
        state_batch_indices=torch.tensor([[1]], dtype=torch.int32),
        dst_state_batch_indices=torch.tensor([[1]], dtype=torch.int32), null_block_id=0, out=out)
    torch.testing.assert_close(out[0], full[:, 11], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[1], full_state, rtol=1e-5, atol=1e-5)
