"""Checks shared by suites and reports; a failure says what was expected, what came, and where."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from harness.manifest import as_bytes, dtype_name


def first_difference(expected: torch.Tensor, got: torch.Tensor) -> str:
    """Describe the first element whose raw bits differ, with both values and bit patterns."""
    width = expected.element_size()
    a = as_bytes(expected).view(-1, width) if expected.numel() else as_bytes(expected)
    b = as_bytes(got).view(-1, width) if got.numel() else as_bytes(got)
    diff = (a != b).reshape(a.shape[0], -1).any(dim=1).nonzero()
    if not len(diff):
        return "no element differs"
    i = int(diff[0])
    n_diff = len(diff)
    flat_e, flat_g = expected.reshape(-1), got.reshape(-1)
    bits_e, bits_g = bytes(a[i].tolist())[::-1].hex(), bytes(b[i].tolist())[::-1].hex()
    return (
        f"{n_diff}/{expected.numel()} elements differ; first at flat index {i}: "
        f"expected {flat_e[i].float().item()!r} (0x{bits_e}), got {flat_g[i].float().item()!r} (0x{bits_g})"
    )


def bitwise_mismatches(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> list[str]:
    """One line per tensor of `expected` that `got` lacks or does not hold bit for bit."""
    problems = []
    for name, e in expected.items():
        if name not in got:
            problems.append(f"{name}: missing from the engine")
            continue
        g = got[name]
        if g.dtype != e.dtype or tuple(g.shape) != tuple(e.shape):
            problems.append(
                f"{name}: expected {tuple(e.shape)} {dtype_name(e.dtype)}, got {tuple(g.shape)} {dtype_name(g.dtype)}"
            )
            continue
        if not torch.equal(as_bytes(e), as_bytes(g.cpu())):
            problems.append(f"{name} ({dtype_name(e.dtype)} {tuple(e.shape)}): {first_difference(e, g.cpu())}")
    return problems


def assert_bitwise_equal(
    expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], context: str, rerun: str = ""
) -> None:
    problems = bitwise_mismatches(expected, got)
    if problems:
        lines = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        hint = f"\nrerun: {rerun}" if rerun else ""
        raise AssertionError(f"{context}: {len(problems)} tensor(s) not bitwise equal:\n  {lines}{more}{hint}")
