"""An independent forward: the checkpoint a trainer pushed, run by a second implementation
(transformers), to score what an engine computes rather than what it stores.

Reading weights back by checkpoint name cannot see a head derived at load time (a tied LM head), a
prefix cache filled with the old weights, or a kept request continuing on the wrong KV. Scoring can:
the engine's greedy tokens are fed to the independent model (teacher forcing) and each must be its
argmax, up to a near-tie tolerance, since two implementations differ in the last bits of a logit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from harness.api import WeightSyncError

#: Near-tie tolerance, relative to the largest |logit|: two float32 implementations of the tiny models
#: differ by ~1e-6 of it (tiny_lm against transformers: 3e-6 on logits of ~7); a half-precision engine
#: rounds every op (~2^-8), so its argmax may differ from a float32 forward's on closer calls.
REL_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
INSTALL_HINT = "pip install 'weightsync[oracle]'  (transformers)"


class OracleUnavailable(WeightSyncError):
    """No independent forward can be built here (transformers missing, or an unknown architecture)."""


class OracleMissing(OracleUnavailable):
    """transformers is not installed: the check cannot run on this install (never a pass)."""

    extra = "oracle"


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """A token the engine produced that the independent forward does not rank first."""

    position: int  # index among the generated tokens
    engine_token: int
    expected_token: int
    gap: float  # logit[expected] - logit[engine_token] in the independent forward
    tolerance: float

    def __str__(self) -> str:
        return (
            f"token {self.position}: engine {self.engine_token}, independent forward {self.expected_token} "
            f"(its logit {self.gap:.4g} higher; tolerance {self.tolerance:.2g})"
        )


class IndependentForward:
    """A transformers model built from an engine's `model_config()`, holding one checkpoint."""

    def __init__(self, model_config: Mapping[str, Any]):
        try:
            import transformers
        except ImportError as exc:
            raise OracleMissing(
                f"no independent forward: transformers is not installed ({INSTALL_HINT})"
            ) from exc
        config = dict(model_config)
        model_type = config.pop("model_type", None)
        if model_type is None:
            raise OracleUnavailable("the engine's model_config() names no model_type")
        self.dtype_name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix(
            "torch."
        )
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **config)
        except ValueError as exc:
            raise OracleUnavailable(f"transformers does not know model_type {model_type!r}: {exc}") from exc
        # float32 whatever the engine serves: the reference is the most exact forward of the checkpoint
        self.model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
        self._parameters = {n for n, _ in self.model.named_parameters(remove_duplicate=True)}

    def load(self, checkpoint: Mapping[str, torch.Tensor]) -> IndependentForward:
        """Take every model tensor of `checkpoint` (by Hugging Face name); tensors the model does not
        have (extra buffers an engine carries) are ignored, a model tensor missing is an error."""
        state = self.model.state_dict()
        missing = sorted(n for n in self._parameters if n not in checkpoint)
        if missing:
            raise ValueError(
                f"the checkpoint lacks model tensor(s) {missing[:5]} (of {len(self._parameters)})"
            )
        for name in self._parameters:
            state[name].copy_(
                checkpoint[name].to(torch.float32)
            )  # a tied head shares the embedding's storage
        return self

    @torch.inference_mode()
    def logits(self, tokens: Sequence[int], past: Any = None) -> tuple[torch.Tensor, Any]:
        """Logits at every position of `tokens` appended after `past` (a transformers cache), and the
        grown cache."""
        out = self.model(torch.tensor([list(tokens)]), past_key_values=past, use_cache=True)
        return out.logits[0].float(), out.past_key_values

    def tolerance(self, logits: torch.Tensor) -> float:
        return REL_TOLERANCE.get(self.dtype_name, 3e-2) * max(1.0, float(logits.abs().max()))


def disagreements(
    logits: torch.Tensor, tokens: Sequence[int], tolerance: float, first_position: int = 0
) -> list[Disagreement]:
    """Where `tokens[i]` is not the argmax of `logits[i]` by more than `tolerance`."""
    out = []
    for i, token in enumerate(tokens):
        row = logits[i]
        best = int(row.argmax())
        gap = float(row[best] - row[token])
        if gap > tolerance:
            out.append(Disagreement(first_position + i, int(token), best, gap, tolerance))
    return out


def score(forward: IndependentForward, prompt: Sequence[int], generated: Sequence[int]) -> list[Disagreement]:
    """Greedy tokens of one request served on one version against that version's independent forward."""
    if not generated:
        return []
    logits, _ = forward.logits([*prompt, *generated[:-1]])
    predicting = logits[len(prompt) - 1 :]
    return disagreements(predicting, generated, forward.tolerance(predicting))


def score_kept(
    old: IndependentForward,
    new: IndependentForward,
    prompt: Sequence[int],
    generated: Sequence[int],
    boundary: int,
) -> tuple[list[Disagreement], str]:
    """A request frozen by pause(keep) after `boundary` tokens and continued on the new version. Its
    first `boundary` tokens come from the old weights. After the boundary the contract allows two
    readings: "kept KV" — the new weights attend to the KV the old weights computed (prompt and tokens
    before the boundary's last one), as a frozen request does; "recompute" — the new weights over the
    whole sequence, as a request preempted and recomputed does (vLLM in this harness, whose prefix-cache
    reset after a commit preempts running requests).

    Returns (disagreements, reading): no disagreements and the reading the continuation matches, or
    the disagreements under the kept-KV reading and what it matches instead ("old": the old weights
    throughout; "" nothing)."""
    if not 1 <= boundary <= len(generated):
        raise ValueError(f"boundary {boundary} outside 1..{len(generated)} generated tokens")
    before = score(old, prompt, generated[:boundary])
    rest = generated[boundary:]
    if before or not rest:
        return before, "kept KV"
    _, past = old.logits([*prompt, *generated[: boundary - 1]])
    logits, _ = new.logits(generated[boundary - 1 : -1], past)
    kept = disagreements(logits, rest, new.tolerance(logits), boundary)
    if not kept:
        return [], "kept KV"
    for reading, fwd in (("recompute", new), ("old", old)):
        logits, _ = fwd.logits([*prompt, *generated[:-1]])
        tail = logits[len(prompt) + boundary - 1 :]
        if not disagreements(tail, rest, fwd.tolerance(tail)):
            return ([], reading) if reading == "recompute" else (kept, reading)
    return kept, ""


def summary(found: Sequence[Disagreement], limit: int = 4) -> str:
    """The first few disagreements, one per line."""
    lines = [f"  {d}" for d in found[:limit]]
    if len(found) > limit:
        lines.append(f"  ... {len(found) - limit} more")
    return "\n".join(lines)
