"""The `vllm` engine factory (`harness.engines.vllm:make_engine`) recycles its LLM: a suite resets its engines
before every test (shutdown, then make_engine), and the engine made after a shutdown serves from the vLLM of
the one shut down, restored. It must be as fresh as a new one: version 0, the checkpoint's weights bit for bit,
not paused, nothing in flight, no update open, no KV block of the old weights reused, no transport root of the
old engine accepted.

    python -m pytest suites/vllm/test_vllm_engine_factory.py -m vllm
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from harness.api import LifecycleError, ManifestMismatch
from harness.checks import assert_bitwise_equal
from harness.engines.tiny_hf_models import hf_greedy, load_checkpoint
from harness.paths.disk import DiskSender

from .helpers import LONG_TOKENS, rerun, token_request

pytestmark = pytest.mark.vllm

PROMPT = [1] + [(13 * i) % 500 + 3 for i in range(299)]  # 300 tokens: two whole 128-token KV blocks


def test_an_engine_made_after_a_shutdown_is_a_fresh_one(vllm_pool, tmp_path, request):
    from harness.engines import vllm as factory

    first = factory.make_engine()
    try:
        base = load_checkpoint(first.model_dir)
        used = {n: t + 0.05 for n, t in base.items()}
        first.commit_weights(used, 5)
        first.generate([token_request(PROMPT, 2, "warm")], timeout=120)  # KV blocks of version 5's weights
        stream = first.submit(token_request(PROMPT[:4], LONG_TOKENS, "in-flight"))
        assert stream.wait_for_tokens(1, timeout=120), "the request left in flight produced no token"
        first.pause("keep")
        old_root = DiskSender(tmp_path / "old-root")
        first.init_weight_transfer_engine(old_root.init())
        first.start_weight_update()  # left open
        recycled = first.llm
    finally:
        first.shutdown()
    ended = stream.result(timeout=60)
    assert ended.finish_reason == "abort", f"a request in flight at shutdown ended {ended.finish_reason!r}"

    second = factory.make_engine()
    try:
        assert second.llm is recycled, "make_engine started a new LLM: the restore of the last one failed"
        hint = rerun(request)
        assert (second.weight_version, second.is_paused) == (0, False), (
            f"recycled engine: version {second.weight_version}, paused {second.is_paused}; expected 0, False\n"
            f"rerun: {hint}"
        )
        assert_bitwise_equal(base, second.read_weights(), "the recycled engine's weights", hint)
        got = second.generate([token_request(PROMPT, 4, "after")], timeout=120)[0].token_ids
        expected = hf_greedy(second.model_dir, base, [PROMPT], 4)[0]
        assert got == expected, (
            f"the recycled engine answered the warmed prompt {got}; transformers on the checkpoint gives "
            f"{expected}: KV blocks of the old weights were reused\nrerun: {hint}"
        )
        with pytest.raises(LifecycleError, match="before init_weight_transfer_engine"):
            second.start_weight_update()  # as a new engine's transport: no root given yet
        second.init_weight_transfer_engine(DiskSender(tmp_path / "new-root").init())
        second.start_weight_update()  # vLLM refuses a start while the old engine's update is still open
        with pytest.raises(ManifestMismatch, match="outside the roots"):
            second.update_weights(old_root.prepare(1, base))
    finally:
        second.shutdown()
        factory.release_spare()
