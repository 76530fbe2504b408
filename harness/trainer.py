"""A reference trainer that produces successive policy versions the way an RL loop does.

fp32 master weights take seeded AdamW steps with a small learning rate; the policy the engines
serve is the master cast to the policy dtype (bf16 by default). Because a step moves each master
weight by about `lr`, far below a bf16 ulp at typical magnitudes, most policy entries do not change
from one version to the next: the regime sparse-delta sync is built for.
"""

from __future__ import annotations

import torch

from harness.api import TensorSpec, WeightSpec
from harness.engines import tiny_lm
from harness.engines.tiny_lm import ModelConfig


class ReferenceTrainer:
    """Trains toward nothing in particular, exactly reproducibly, for any weight spec."""

    def __init__(
        self,
        spec: WeightSpec | None = None,
        seed: int = 0,
        lr: float = 3e-6,  # typical of GRPO/PPO fine-tuning; ~99% of bf16 entries stay put per step
    ):
        self.spec: dict[str, TensorSpec] = dict(
            spec or tiny_lm.checkpoint_spec(ModelConfig(dtype=torch.bfloat16))
        )
        gen = torch.Generator().manual_seed(seed)
        self.master = {}
        for name, s in self.spec.items():
            t = 0.2 * torch.randn(s.shape, generator=gen)
            if name.endswith("norm.weight"):
                t = t + 1.0
            self.master[name] = torch.nn.Parameter(t)
        self.optimizer = torch.optim.AdamW(self.master.values(), lr=lr, weight_decay=0.01)
        self._gen = torch.Generator().manual_seed(seed + 1)
        self.version = 0

    def step(self) -> tuple[int, dict[str, torch.Tensor]]:
        """One optimizer step with seeded pseudo-gradients; returns (version, policy tensors)."""
        for p in self.master.values():
            p.grad = torch.randn(p.shape, generator=self._gen)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return self.version, self.policy()

    def policy(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {n: p.detach().to(self.spec[n].dtype) for n, p in self.master.items()}


def changed_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """Fraction of elements whose raw bits differ between two versions (NaN and -0.0 aware)."""
    from harness.manifest import as_bytes

    changed = total = 0
    for name, t in new.items():
        a, b = as_bytes(old[name]), as_bytes(t)
        width = t.element_size()
        diff = (a != b).view(-1, width).any(dim=1) if t.numel() else torch.zeros(0, dtype=torch.bool)
        changed += int(diff.sum())
        total += t.numel()
    return changed / max(total, 1)
