"""Text out of /v1/completions: incremental detokenization and vLLM's logprobs object, per request.

`TextOut.piece` turns each batch of new tokens into the text to send with it. A token may end inside a
multi-byte character (one token per byte); its text is held back until the character completes, so
the pieces of a stream concatenate to exactly `tokenizer.decode(all tokens)`: a piece is sent once the
pending tokens decode to text not ending in U+FFFD (a character cut short decodes to it), and the last
piece sends whatever is pending. This is exact for tokenizers whose decode concatenates at character
boundaries (the byte-level one, harness/engines/byte_tokenizer.py).

`TextOut.logprobs` builds vLLM 0.32's `CompletionLogProbs` for the tokens of one chunk
(vllm/entrypoints/openai/completion/serving.py `_create_completion_logprobs`): `tokens` (each token
decoded alone), `token_logprobs` (the chosen token's, clamped at -9999.0), `top_logprobs` (per token the
chosen token and the `logprobs` most likely ones, decoded token text -> log-prob: with greedy sampling
the chosen token is the most likely, so N entries for N >= 1 and the chosen one alone for 0), and
`text_offset` (running offsets over the `tokens` strings, continued across the chunks of a stream).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from harness.api import TokenEvent, Tokenizer

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: a request asking for more is refused
LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf to this JSON-able value
REPLACEMENT = "\ufffd"


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """One token alone, as vLLM names it in logprobs (`token_id:N` without a tokenizer, as vLLM's
    return_tokens_as_token_ids does)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def _clamp(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return max(value, LOGPROB_FLOOR)


@dataclasses.dataclass
class TextOut:
    """The text and logprobs state of one completion."""

    tokenizer: Tokenizer | None
    logprobs: int | None = None  # the request's `logprobs` (None: no logprobs object)
    _ids: list[int] = dataclasses.field(default_factory=list)
    _sent: int = 0  # tokens whose text was sent
    _next_offset: int = 0  # text_offset of the next token

    def piece(self, token_ids: Sequence[int], final: bool) -> str:
        """The text to send with these new tokens (the rest of it when `final`)."""
        self._ids.extend(token_ids)
        if self.tokenizer is None or self._sent == len(self._ids):
            return ""
        text = self.tokenizer.decode(self._ids[self._sent :])
        if not final and text.endswith(REPLACEMENT):
            return ""  # a character still incomplete: held back until its last byte (or the end)
        self._sent = len(self._ids)
        return text

    def object(self, events: Sequence[TokenEvent]) -> dict[str, Any] | None:
        """vLLM's logprobs object for the tokens among `events`, or None when none was asked for."""
        if self.logprobs is None:
            return None
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for e in events:
            if e.token_id is None:
                continue
            text = token_text(self.tokenizer, e.token_id)
            tokens.append(text)
            offsets.append(self._next_offset)
            self._next_offset += len(text)
            if e.logprob is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_clamp(e.logprob))
            # the chosen token first, then the most likely ones: vLLM's dict keeps N + 1 entries at most
            entries = [
                (e.token_id, e.logprob),
                *((t, lp) for t, lp in (e.top_logprobs or ()) if t != e.token_id),
            ]
            top: dict[str, float | None] = {}
            for token_id, lp in entries[: self.logprobs + 1]:
                # ids that decode alike (bytes >= 0x80 alone are U+FFFD) keep the first, most likely one
                top.setdefault(token_text(self.tokenizer, token_id), _clamp(lp))
            top_logprobs.append(top)
        return {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }
