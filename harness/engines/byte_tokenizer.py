"""The reference engine's tokenizer: one token per UTF-8 byte (token id = byte value).

The tiny decoder's vocabulary is 256 ids, exactly the byte values, so every string encodes and every
id decodes. A model with a larger vocabulary keeps ids 0..255 as bytes; the ids above are special
tokens that decode to nothing (as vLLM's detokenizer skips special tokens by default) and that no text
encodes to. Bytes that are not valid UTF-8 (a character cut by max_tokens, a lone continuation byte)
decode to U+FFFD, as `bytes.decode(errors="replace")` does.
"""

from __future__ import annotations

from collections.abc import Sequence

N_BYTES = 256


class ByteTokenizer:
    """encode(text) -> token ids, decode(ids) -> text (the `harness.api.Tokenizer` protocol)."""

    def __init__(self, vocab_size: int = N_BYTES):
        if vocab_size < N_BYTES:
            raise ValueError(
                f"a byte-level tokenizer needs a vocabulary of at least {N_BYTES} ids, got {vocab_size}"
            )
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogatepass"))

    def decode(self, token_ids: Sequence[int]) -> str:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary of {self.vocab_size}")
        return bytes(t for t in token_ids if t < N_BYTES).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"
