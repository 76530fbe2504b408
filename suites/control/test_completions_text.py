"""Text in, text out on /v1/completions, as vLLM 0.32's OpenAI route serves it: text prompts (a string,
or a list of one) tokenized by the engine's tokenizer, `text` in every chunk and answer, vLLM's logprobs
object, and usage.prompt_tokens_details.cached_tokens (the prefix cache seen over HTTP, dropping to 0
after a weight update).

The reference engine's tokenizer is byte-level (token id = byte value), so what a text prompt must
become and what the output text must be are computed here independently from UTF-8 itself.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from harness.control.text import TextOut
from harness.engines.byte_tokenizer import ByteTokenizer
from harness.engines.reference import PREFIX_BLOCK
from suites.control.helpers import require_text_prompts, weights_for

TEXT = "héllo wörld ✓ 😀, grüße"
LOGPROB_TOLERANCE = 1e-3  # two float32 forwards of the tiny model differ by ~1e-6 in a log-prob


def utf8_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(autouse=True)
def _needs_text_prompts(request):
    """Every test here sends text: against a server without a tokenizer, NOT_SUPPORTED."""
    if "served" in request.fixturenames:
        require_text_prompts(request.getfixturevalue("served"))


def utf8_text(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def post(served, body: dict) -> httpx.Response:
    return httpx.post(served.url + "/v1/completions", json=body, headers=served.auth(), timeout=60)


def assert_400(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, f"{resp.status_code} {resp.text[:300]}"
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("Bad Request", 400), f"not vLLM's 400 shape: {error}"
    assert error["param"] == param or str(error["param"]).startswith(param + "."), (
        f"param {error['param']!r}, expected {param!r}: {error}"
    )
    assert error["message"], f"400 without a message: {error}"


# --------------------------------------------------------------------------------------------- tokenizer
def test_the_byte_tokenizer_covers_the_reference_vocabulary(served):
    tok = served.engine.tokenizer
    assert isinstance(tok, ByteTokenizer), f"the reference engine's tokenizer is {tok!r}"
    vocab = served.engine.config.vocab_size
    assert tok.encode(TEXT) == utf8_ids(TEXT), f"{tok.encode(TEXT)} != the UTF-8 bytes of {TEXT!r}"
    assert tok.decode(utf8_ids(TEXT)) == TEXT, f"{tok.decode(utf8_ids(TEXT))!r} != {TEXT!r}"
    undecodable = []
    for i in range(vocab):
        try:
            tok.decode([i])
        except ValueError:
            undecodable.append(i)
    assert not undecodable, f"ids of the {vocab}-id vocabulary that do not decode: {undecodable[:10]}"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd", f"a cut character decodes to {tok.decode([0xE2, 0x9C])!r}"


def test_held_back_bytes_make_pieces_of_whole_characters():
    """Token by token, a multi-byte character's text comes with its last byte, never before."""
    out = TextOut(ByteTokenizer())
    pieces = [out.piece([b], final=False) for b in "é✓😀".encode()]
    assert pieces == ["", "é", "", "", "✓", "", "", "", "😀"], f"pieces {pieces}"
    cut = TextOut(ByteTokenizer())
    pieces = [cut.piece([b], final=False) for b in "a✓".encode()[:3]] + [cut.piece([], final=True)]
    assert pieces == ["a", "", "", "\ufffd"], f"a character cut by the end: pieces {pieces}"


# --------------------------------------------------------------------------------------------- prompts
def test_a_text_prompt_is_its_utf8_bytes_and_generates_what_the_id_prompt_does(served):
    client = served.client
    answers = {}
    for form, prompt in (("ids", utf8_ids(TEXT)), ("text", TEXT), ("[text]", [TEXT])):
        client.reset_prefix_cache()  # each computed from scratch: identical logits, identical tokens
        answers[form] = client.text_completion(prompt, 12)
    ids = answers["ids"]
    for form, got in answers.items():
        assert got.usage["prompt_tokens"] == len(utf8_ids(TEXT)), (
            f"{form}: {got.usage['prompt_tokens']} prompt tokens, the text has {len(utf8_ids(TEXT))} bytes"
        )
        assert got.token_ids == ids.token_ids, (
            f"{form}: tokens {got.token_ids} != id prompt's {ids.token_ids}"
        )
        assert len(got.token_ids) == 12 and got.finish_reason == "length", (
            f"{form}: {len(got.token_ids)} tokens, finish {got.finish_reason}"
        )
        assert got.text == utf8_text(got.token_ids), (
            f"{form}: text {got.text!r} is not its tokens' bytes decoded: {utf8_text(got.token_ids)!r}"
        )
        assert got.token_versions == [0] * 12, f"{form}: versions {got.token_versions}"


def test_refused_prompts_and_fields(served):
    for body, param in (
        ({"prompt": ["one", "two"]}, "body.prompt"),  # vLLM batches; we serve one prompt per request
        ({"prompt": ""}, "body.prompt"),
        ({"prompt": [""]}, "body.prompt"),
        ({"prompt": [1, "a"]}, "body.prompt"),
        ({"prompt": "é" * 5000}, "prompt"),  # 10000 tokens, over the 8192 limit
        ({"prompt": TEXT, "echo": True}, "body.echo"),  # unknown fields stay refused
        ({"prompt": TEXT, "logprobs": "2"}, "body.logprobs"),
    ):
        resp = post(served, {**body, "max_tokens": 1})
        assert_400(resp, param)
    assert served.server.counters["submitted"] == 0, (
        f"a refused request reached the engine: {served.server.counters}"
    )


def test_a_model_name_mismatch_is_404_and_the_served_name_is_taken(served):
    resp = post(served, {"prompt": TEXT, "model": "gpt-4", "max_tokens": 1})
    assert resp.status_code == 404, f"{resp.status_code} {resp.text[:300]}"
    assert resp.json()["error"]["type"] == "NotFoundError", resp.text[:300]
    resp = post(served, {"prompt": TEXT, "model": served.server.config.model_name, "max_tokens": 2})
    assert resp.status_code == 200, f"{resp.status_code} {resp.text[:300]}"
    answer = resp.json()
    assert answer["model"] == served.server.config.model_name, f"model {answer['model']!r}"
    choice = answer["choices"][0]
    assert choice["text"] == utf8_text(choice["token_ids"]), (
        f"text {choice['text']!r} for {choice['token_ids']}"
    )


def test_an_engine_without_a_tokenizer_refuses_text_prompts(served):
    served.engine.tokenizer = None  # an engine serving token ids only (vLLM with --skip-tokenizer-init)
    for prompt in (TEXT, [TEXT]):
        assert_400(post(served, {"prompt": prompt, "max_tokens": 2}), "prompt")
    assert served.server.counters["submitted"] == 0, (
        f"a refused prompt reached the engine: {served.server.counters}"
    )
    resp = post(served, {"prompt": utf8_ids(TEXT), "max_tokens": 3})  # token ids still work, no text
    assert resp.status_code == 200, f"{resp.status_code} {resp.text[:300]}"
    choice = resp.json()["choices"][0]
    assert (len(choice["token_ids"]), choice["text"]) == (3, ""), f"choice {choice}"


# --------------------------------------------------------------------------------------------- text out
def test_streamed_pieces_concatenate_to_the_whole_text(served):
    client = served.client
    for prompt in (TEXT, "a", "Ünïcödé ✓✓✓ 🚀🚀"):
        whole = client.text_completion(prompt, 40)
        streamed = client.text_completion(prompt, 40, stream=True)
        assert streamed.token_ids == whole.token_ids, (
            f"{prompt!r}: streamed tokens {streamed.token_ids} != {whole.token_ids}"
        )
        assert whole.text == utf8_text(whole.token_ids), f"{prompt!r}: text {whole.text!r}"
        assert "".join(streamed.pieces) == whole.text, (
            f"{prompt!r}: streamed pieces {streamed.pieces} join to {''.join(streamed.pieces)!r}, "
            f"the answer is {whole.text!r}"
        )
        assert streamed.finish_reason == whole.finish_reason == "length", (
            f"finish {streamed.finish_reason} / {whole.finish_reason}"
        )


CYCLE = "é✓😀"  # 9 bytes, all distinct: 2 + 3 + 4 byte characters
CHAIN = list(CYCLE.encode())


def chain_weights(served) -> dict[str, torch.Tensor]:
    """Weights whose greedy output after any byte of CYCLE is the next byte of CYCLE, forever: layers
    that add nothing (o_proj, down_proj zero), an embedding putting each byte of the cycle on its own
    axis, and an LM head mapping that axis to the next byte."""
    w = weights_for(served.engine, seed=3)
    for name, t in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(t)
        elif name.endswith("norm.weight"):
            w[name] = torch.ones_like(t)
    embed = torch.zeros_like(w["model.embed_tokens.weight"])
    head = torch.zeros_like(w["lm_head.weight"])
    for axis, byte in enumerate(CHAIN):
        embed[byte, axis] = 1.0
        head[CHAIN[(axis + 1) % len(CHAIN)], axis] = 1.0
    w["model.embed_tokens.weight"], w["lm_head.weight"] = embed, head
    return w


def test_multibyte_characters_split_across_tokens_reach_the_client_whole(served):
    served.push(1, chain_weights(served))
    client = served.client
    for n, expected in ((27, CYCLE * 3), (21, CYCLE * 2 + "é\ufffd")):  # 21: ends inside "✓"
        whole = client.text_completion("x😀", n)
        assert whole.token_ids == (CHAIN * 3)[:n], f"the chain model generated {whole.token_ids}"
        assert whole.text == expected, f"text {whole.text!r}, expected {expected!r}"
        streamed = client.text_completion("x😀", n, stream=True)
        assert streamed.token_ids == whole.token_ids, f"streamed {streamed.token_ids} != {whole.token_ids}"
        assert "".join(streamed.pieces) == expected, f"pieces {streamed.pieces}, expected {expected!r}"
        cut = [p for p in streamed.pieces[:-1] if "\ufffd" in p]
        assert not cut, f"pieces before the last carry a cut character: {cut} of {streamed.pieces}"
        assert sum(1 for p in streamed.pieces if p) >= 2, (
            f"one piece only, nothing was streamed: {streamed.pieces}"
        )


# --------------------------------------------------------------------------------------------- logprobs
def expected_top(logprobs: torch.Tensor, n: int) -> dict[str, float]:
    """vLLM's top_logprobs entry from an independent log-softmax: the n most likely tokens, each decoded
    alone (bytes >= 0x80 alone are U+FFFD: the most likely of those keeps the key)."""
    values, ids = torch.topk(logprobs, n)
    out: dict[str, float] = {}
    for token_id, lp in zip(ids.tolist(), values.tolist(), strict=True):
        out.setdefault(utf8_text([token_id]), lp)
    return out


def test_logprobs_agree_with_an_independent_forward(served):
    pytest.importorskip("transformers")
    from harness.independent_forward import IndependentForward

    oracle = IndependentForward(served.engine.model_config()).load(served.engine.read_weights())
    client = served.client
    prompt = utf8_ids(TEXT)
    whole = client.text_completion(TEXT, 10, logprobs=5)
    streamed = client.text_completion(TEXT, 10, logprobs=5, stream=True)
    assert streamed.token_ids == whole.token_ids, f"streamed {streamed.token_ids} != {whole.token_ids}"
    logits, _ = oracle.logits([*prompt, *whole.token_ids[:-1]])
    independent = torch.log_softmax(logits[len(prompt) - 1 :].float(), dim=-1)
    for name, got in (("answer", whole), ("stream", streamed)):
        lp = got.logprobs
        assert lp is not None and set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, (
            f"{name}: logprobs object {lp}"
        )
        assert lp["tokens"] == [utf8_text([t]) for t in got.token_ids], f"{name}: tokens {lp['tokens']}"
        offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        assert lp["text_offset"] == offsets, f"{name}: text_offset {lp['text_offset']}, expected {offsets}"
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(got.token_ids) == 10, (
            f"{name}: {len(lp['token_logprobs'])} logprobs for {len(got.token_ids)} tokens"
        )
        for i, token in enumerate(got.token_ids):
            row = independent[i]
            assert token == int(row.argmax()), (
                f"{name} token {i}: {token} is not the independent forward's argmax {int(row.argmax())}"
            )
            assert abs(lp["token_logprobs"][i] - float(row[token])) <= LOGPROB_TOLERANCE, (
                f"{name} token {i}: logprob {lp['token_logprobs'][i]}, independent {float(row[token])}"
            )
            want, top = expected_top(row, 5), lp["top_logprobs"][i]
            assert set(top) == set(want), (
                f"{name} token {i}: top_logprobs keys {sorted(top)}, expected {sorted(want)}"
            )
            worst = max(abs(top[k] - want[k]) for k in want)
            assert worst <= LOGPROB_TOLERANCE, f"{name} token {i}: top_logprobs {top}, independent {want}"
            assert top[lp["tokens"][i]] == lp["token_logprobs"][i], (
                f"{name} token {i}: top_logprobs {top} disagrees with token_logprobs {lp['token_logprobs'][i]}"
            )


def test_logprobs_zero_gives_the_chosen_token_alone(served):
    got = served.client.text_completion(TEXT, 6, logprobs=0, stream=True)
    lp = got.logprobs
    assert lp is not None, "logprobs=0 gave no logprobs object"
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)], (
        f"top_logprobs {lp['top_logprobs']} for tokens {lp['tokens']} / {lp['token_logprobs']}"
    )
    assert all(v is not None and math.isfinite(v) and v <= 0 for v in lp["token_logprobs"]), (
        f"token_logprobs {lp['token_logprobs']}"
    )
    plain = served.client.text_completion(TEXT, 6)
    assert plain.logprobs is None, f"no logprobs asked, got {plain.logprobs}"


def test_logprobs_refusals(served):
    for n in (21, -2, -1):  # vLLM caps at --max-logprobs (20); -1, the whole vocabulary, exceeds it
        assert_400(post(served, {"prompt": TEXT, "max_tokens": 1, "logprobs": n}), "logprobs")
    served.engine.reports_logprobs = False  # an engine that cannot report them
    assert_400(post(served, {"prompt": TEXT, "max_tokens": 1, "logprobs": 1}), "logprobs")
    assert served.server.counters["submitted"] == 0, (
        f"a refused request reached the engine: {served.server.counters}"
    )


# --------------------------------------------------------------------------------------------- prefix cache
def test_cached_tokens_show_the_prefix_cache_and_its_invalidation_by_an_update(served):
    client = served.client
    prompt = "The quick brown fox jumps over the lazy dog, twice: the quick brown fox. "
    n = len(utf8_ids(prompt))
    cacheable = (n - 1) // PREFIX_BLOCK * PREFIX_BLOCK  # whole blocks, one token left to compute
    first = client.text_completion(prompt, 4)
    second = client.text_completion(prompt, 4, stream=True)
    assert (first.cached_tokens, second.cached_tokens) == (0, cacheable), (
        f"cached_tokens {first.cached_tokens} then {second.cached_tokens} for a {n}-token prompt sent twice "
        f"(expected 0 then {cacheable}); usage {first.usage} / {second.usage}"
    )
    assert second.token_ids == first.token_ids, (
        f"a cached prefix changed the output: {first.token_ids} -> {second.token_ids}"
    )
    served.push(1, weights_for(served.engine, seed=11))
    third = client.text_completion(prompt, 4)
    assert third.cached_tokens == 0, (
        f"after a weight update {third.cached_tokens} prompt tokens came from the prefix cache the old "
        f"weights filled; usage {third.usage}"
    )
    assert third.token_versions == [1] * 4, f"versions after the update: {third.token_versions}"
    fourth = client.text_completion(prompt, 4, stream=True)
    assert fourth.cached_tokens == cacheable, f"the new version's prefix was not cached: {fourth.usage}"
    assert fourth.token_ids == third.token_ids, f"{third.token_ids} -> {fourth.token_ids} on the same version"
