"""Request bodies of the control plane and the validators both ends share.

Every model forbids unknown fields and coerces nothing (strict mode): a trainer that sends a field the
server does not know, or a string where a number belongs, gets a 400 whose `param` names it (vLLM's
error object) rather than a silent guess. Bodies mirror vLLM's dev-mode routes so the same client drives either server.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from harness.engines.vllm_constants import INITIAL_VERSION

MAX_VERSION = 2**63 - 1
# vLLM labels versions with free strings ("step-12", "checkpoint/final"); ours must look like a path-ish
# identifier: no spaces, no control characters, no leading "." or "/".
VERSION_LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+/-]{0,63}$"
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
IDEMPOTENCY_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{7,127}$")
_CANONICAL_INT_RE = re.compile(r"^[1-9][0-9]{0,18}$")

MAX_PROMPT_TOKENS = 8192
MAX_PROMPT_CHARS = 4 * MAX_PROMPT_TOKENS  # a text prompt; its token count is checked once encoded
MAX_NEW_TOKENS = 8192
MAX_JSON_DEPTH = 32
MAX_JSON_NODES = 200_000
MAX_KEY_CHARS = 256
MAX_ABORT_IDS = 4096

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_TAGS = ("weights", "kv_cache", "scheduling")  # what vLLM's /wake_up?tags= may name
INITIAL_VERSION_LABEL = INITIAL_VERSION  # vLLM's /weight_info before any labelled version
INITIAL_WEIGHT_LABEL = ""  # the rfc45585 level's weight_label before any is set


class BadRequest(ValueError):
    """A request the schema admitted but whose content is refused (a path, a host, a version).
    `param` names the refused field as vLLM's error object does ("query.mode", "body.weight_version")."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# --------------------------------------------------------------------------------------------- blobs
def check_json_blob(value: dict[str, Any]) -> dict[str, Any]:
    """Bound the shape of a free-form JSON object (init_info, update_info): depth, size, key length,
    and no non-finite floats, so that no later walk of it can recurse or allocate without limit."""
    nodes = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > MAX_JSON_NODES:
            raise ValueError(f"more than {MAX_JSON_NODES} JSON values")
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            for k, v in item.items():
                if not isinstance(k, str) or len(k) > MAX_KEY_CHARS:
                    raise ValueError(f"object key {str(k)[:40]!r}... longer than {MAX_KEY_CHARS} characters")
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"non-finite number {item!r}")
        elif item is not None and not isinstance(item, (str, int, float, bool)):
            raise ValueError(f"{type(item).__name__} is not a JSON value")
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(check_json_blob)]


# --------------------------------------------------------------------------------------------- versions
_VERSION_PARAM = "body.weight_version"


def parse_version(value: int | str | None) -> tuple[int | None, str | None]:
    """(engine version, label) from a finish body's `weight_version`.

    An int, or a canonical decimal string ("12", never "012"), names the engine version to commit;
    any other label (vLLM style, "step-12") commits the staged version and is reported by /weight_info.
    """
    if value is None:
        return None, None
    if isinstance(value, bool):
        raise BadRequest("weight_version must be an integer or a label, not a boolean", _VERSION_PARAM)
    if isinstance(value, int):
        if not 1 <= value <= MAX_VERSION:
            raise BadRequest(f"weight_version {value} outside 1..{MAX_VERSION}", _VERSION_PARAM)
        return value, None
    if value.isdigit():
        if not _CANONICAL_INT_RE.match(value) or int(value) > MAX_VERSION:
            raise BadRequest(
                f"weight_version {value!r}: a numeric version must be canonical and in 1..{MAX_VERSION}",
                _VERSION_PARAM,
            )
        return int(value), None
    if not re.match(VERSION_LABEL_PATTERN, value):
        raise BadRequest(
            f"weight_version {value[:80]!r} does not match {VERSION_LABEL_PATTERN}", _VERSION_PARAM
        )
    return None, value


def parse_query_bool(name: str, raw: str | None, default: bool) -> bool:
    """Query booleans as FastAPI spells them for vLLM's clients (true/false/1/0, any case); nothing else."""
    if raw is None:
        return default
    low = raw.lower()
    if low in ("true", "1"):
        return True
    if low in ("false", "0"):
        return False
    raise BadRequest(
        f"query parameter {name}={raw[:40]!r} is not a boolean (true|false|1|0)", f"query.{name}"
    )


# --------------------------------------------------------------------------------------------- paths
_PATH_KEY_RE = re.compile(
    r"(^|_)(path|paths|root|dir|dirs|directory|file|files|filename|filenames)$", re.IGNORECASE
)
_HOST_KEY_RE = re.compile(r"(^|_)(addr|address|host|hostname)$", re.IGNORECASE)


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", "~", "\\", "file:")) or ".." in text or "\x00" in text


def _confine_one(where: str, text: Any, allowed: Sequence[Path]) -> None:
    if not isinstance(text, str):
        raise BadRequest(f"{where} must be a string path, got {type(text).__name__}")
    if "\x00" in text or len(text) > 4096:
        raise BadRequest(f"{where} is not a usable path")
    if not os.path.isabs(text):
        raise BadRequest(f"{where}={text[:200]!r} must be an absolute path")
    if not allowed:
        raise BadRequest(
            f"{where}={text[:200]!r}: this server accepts no file paths (no allowed directory set)"
        )
    real = Path(os.path.realpath(text))  # symlinks resolved: a link out of the directory is outside it
    if not any(real == a or real.is_relative_to(a) for a in allowed):
        raise BadRequest(
            f"{where}={text[:200]!r} resolves to {str(real)[:200]!r}, outside the allowed "
            f"director{'y' if len(allowed) == 1 else 'ies'} {[str(a) for a in allowed]}"
        )


def confine_paths(
    info: Mapping[str, Any],
    allowed_dirs: Iterable[Path],
    allowed_hosts: Iterable[str],
    what: str,
    skip: Iterable[str] = ("manifest",),
) -> None:
    """Refuse any file path in `info` outside `allowed_dirs` and any peer address not in `allowed_hosts`.

    A value is a path when its key says so (path, root, *_dir, ...) or when it looks like one
    (absolute, '~', '..'); every such value must resolve, symlinks followed, inside an allowed directory.
    The manifest is skipped: its strings are tensor names, which the receiver checks against the engine.
    """
    allowed = [Path(os.path.realpath(d)) for d in allowed_dirs]
    hosts = set(allowed_hosts)
    skip = set(skip)
    stack: list[tuple[str, Any, str | None]] = [(what, info, None)]
    while stack:
        where, item, key = stack.pop()
        if isinstance(item, Mapping):
            for k, v in item.items():
                if where == what and k in skip:
                    continue
                stack.append((f"{where}.{k}", v, k))
            continue
        if isinstance(item, list):
            stack.extend((f"{where}[{i}]", v, key) for i, v in enumerate(item))
            continue
        if key is not None and _PATH_KEY_RE.search(key):
            _confine_one(where, item, allowed)
        elif key is not None and _HOST_KEY_RE.search(key):
            if not isinstance(item, str) or item not in hosts:
                raise BadRequest(
                    f"{where}={str(item)[:100]!r} is not an allowed peer address {sorted(hosts)}"
                )
        elif isinstance(item, str) and _looks_like_path(item):
            _confine_one(where, item, allowed)


# --------------------------------------------------------------------------------------------- bodies
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


VersionLabel = Annotated[str, Field(pattern=VERSION_LABEL_PATTERN, max_length=64)]
RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN, max_length=128)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class InitWeightTransferBody(_Strict):
    init_info: JsonObject


class StartWeightUpdateBody(_Strict):
    # newer vLLM sends it; the harness's receivers always take checkpoint-format tensors
    is_checkpoint_format: bool = True


class UpdateWeightsBody(_Strict):
    # vLLM 0.32 takes one object, or a list with one object per inference worker (its global rank)
    update_info: JsonObject | Annotated[list[JsonObject], Field(min_length=1, max_length=4096)]


class FinishWeightUpdateBody(_Strict):
    weight_version: Annotated[int, Field(ge=1, le=MAX_VERSION)] | VersionLabel | None = None


class UpdateWeightVersionBody(_Strict):
    new_version: VersionLabel


# vLLM API level "rfc45585" (harness.control.routes.table): the prototype's free-form `weight_label`
# ("step-1500", "" before any) is held to the version-label pattern here, as every label is.
class FinishWeightUpdateLabelBody(FinishWeightUpdateBody):
    weight_label: VersionLabel | None = None


class UpdateWeightLabelBody(_Strict):
    weight_label: VersionLabel


class AbortRequestsBody(_Strict):
    request_ids: list[RequestId] | None = Field(default=None, max_length=MAX_ABORT_IDS)


class EmptyBody(_Strict):
    pass


WEIGHT_CHECKER_ACTIONS = ("checksum", "reset", "compare")
Sha256Hex = Annotated[str, Field(max_length=64)]


class WeightCheckerBody(_Strict):
    """vLLM 0.32's POST /weight_checker: checksum, reset (zero) or compare against a baseline."""

    action: Literal["checksum", "reset", "compare"]
    baseline: (
        Annotated[dict[Annotated[str, Field(max_length=1024)], Sha256Hex], Field(max_length=100_000)] | None
    ) = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


PromptText = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]


class CompletionBody(_Strict):
    """OpenAI /v1/completions, greedy only (what the harness compares). `prompt` as vLLM 0.32 takes one
    prompt: token ids, a string, or a list holding one string (vLLM batches longer lists; we serve one
    prompt per request). `logprobs` is range-checked by the route (400 naming `logprobs`, as vLLM)."""

    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    prompt: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
        | PromptText
        | Annotated[list[PromptText], Field(min_length=1, max_length=1)]
    )
    logprobs: int | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = 16
    temperature: Annotated[float, Field(ge=0.0, le=0.0)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    request_id: RequestId | None = None
