"""Client requests checked before the gateway reads them, forwards them or
touches any session: the OpenAI Chat Completions / Completions fields the
gateway reads or forwards (types and ranges as in OpenAI's API reference),
checked with pydantic, and session ids.

Invariants:

* A body that passes :func:`check_body` parses into finite numbers only
  (``NaN``, ``Infinity`` and numbers that overflow to infinity are rejected
  when the JSON is read), every checked field has its documented type and
  range, and it carries nothing only the gateway may set: ``priority``
  (the gateway's shadows rank by it), ``cache_salt`` (the gateway salts
  caches per tenant; shadows must carry the routed calls' salt), a
  ``shadowprefill_*`` field, or a ``shadowprefill_*`` key in ``vllm_xargs``
  (the engine's shadow tags).
* Every failure is one :class:`BadRequest` naming the field (``param``, a
  dotted path such as ``messages[0].content``), the value and the rule.
* Fields outside the checked set pass through unchanged (vLLM's own sampling
  extensions); vLLM validates them, and a call it rejects changes no session
  (the gateway registers a call only once the upstream accepted it).
* A session id (and a task name, ``X-Session-Task``) is 1 to
  :data:`MAX_SESSION_ID_CHARS` printable characters (``str.isprintable``: no
  control, format or separator characters other than the space), UTF-8 by
  header and by body alike.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

MAX_SESSION_ID_CHARS = 256
#: Fields only the gateway sets on the requests it forwards.
RESERVED_FIELDS = ("priority", "cache_salt")
RESERVED_PREFIX = "shadowprefill_"


class BadRequest(ValueError):
    """A client request the gateway refuses (HTTP 400 unless ``status`` says otherwise)."""

    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range (numbers must be finite)")
    return value


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; :class:`BadRequest` otherwise."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise BadRequest(None, "invalid JSON body: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a non-finite number
        raise BadRequest(None, f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(None, "invalid JSON body: the body must be a JSON object")
    return body


# -- the OpenAI fields --------------------------------------------------------------------------

def Seq(item: Any, **constraints: Any) -> Any:
    """A list that stops at its first bad item (a long bad list costs one error, not one per item)."""
    return Annotated[list[item], Field(fail_fast=True, **constraints)]


Number = StrictInt | StrictFloat
TokenId = Annotated[StrictInt, Field(ge=0)]
#: Token ids first, tried in order: a long prompt of ids is checked once, not once per branch.
Prompt = Annotated[StrictStr | Seq(TokenId) | Seq(StrictStr) | Seq(Seq(TokenId)), Field(union_mode="left_to_right")]
Stop = StrictStr | Seq(StrictStr)
Scalar = StrictStr | StrictInt | StrictFloat | StrictBool
XArg = Scalar | Seq(Scalar)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: StrictStr | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    seed: StrictInt | None = None
    stop: Stop | None = None
    user: StrictStr | None = None
    logit_bias: dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    return_token_ids: StrictBool | None = None
    vllm_xargs: dict[StrictStr, XArg] | None = None


class CompletionRequest(_Sampling):
    prompt: Prompt
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    echo: StrictBool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    suffix: StrictStr | None = None


class ContentPart(_Strict):
    type: StrictStr
    text: StrictStr | None = None


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | Seq(ContentPart) | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: Seq(dict[StrictStr, Any]) | None = None


class ChatRequest(_Sampling):
    messages: Seq(Message, min_length=1)
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: Seq(dict[StrictStr, Any]) | None = None
    tool_choice: StrictStr | dict[StrictStr, Any] | None = None
    response_format: dict[StrictStr, Any] | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None


class WarmthRequest(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    session_id: StrictStr
    model: StrictStr
    prompt: Prompt | None = None
    messages: Seq(Message, min_length=1) | None = None
    add_generation_prompt: StrictBool | None = None


SCHEMAS: dict[str, type[BaseModel]] = {"completions": CompletionRequest, "chat": ChatRequest,
                                       "warmth": WarmthRequest}


SCALAR_BRANCHES = frozenset({"str", "int", "float", "bool", "none", "StreamOptions", "ContentPart", "Message"})
#: What a union-typed field takes, for the error message.
UNION_TEXT = {
    "prompt": "must be a string, a list of strings, a list of token ids (integers >= 0) or a list of such lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string, a list of content parts ({type, text}) or null",
    "tool_choice": "must be a string or a JSON object",
    "vllm_xargs": "must be a string, a number, true, false or a list of them",
}


def _is_branch(part: Any) -> bool:
    """pydantic names the branch of a union in an error's location."""
    return isinstance(part, str) and (part in SCALAR_BRANCHES or "[" in part)


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_branch(part):
            out += f".{part}" if out else str(part)
    return out


def _describe(e: ValidationError) -> tuple[tuple[Any, ...], Any, str]:
    """(location, value, problem) of the first bad field. In a union, the
    branch that got furthest speaks; when none did, the union's own rule."""
    errors = e.errors(include_url=False)
    top = errors[0]["loc"][:1]
    errs = [x for x in errors if x["loc"][:1] == top]
    first = errs[0]
    cut = next((i for i, p in enumerate(first["loc"]) if _is_branch(p)), None)
    if cut is None or len(errs) == 1:
        return first["loc"], first.get("input"), _message(first)
    depth = max(len(x["loc"]) for x in errs)
    deepest = [x for x in errs if len(x["loc"]) == depth]
    if depth > cut + 1 and len({x["loc"][cut] for x in deepest}) == 1:
        return deepest[0]["loc"], deepest[0].get("input"), _message(deepest[0])
    loc = first["loc"][:cut]
    names = [p for p in loc if isinstance(p, str)]
    if {x["type"] for x in errs} <= {"int_type", "float_type"}:
        problem = "must be a number"
    else:
        key = "vllm_xargs" if names[:1] == ["vllm_xargs"] else (names[-1] if names else "")
        problem = UNION_TEXT.get(key, "has the wrong type")
    return loc, first.get("input"), problem


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_body(endpoint: str, body: dict[str, Any]) -> None:
    """Raise :class:`BadRequest` naming the first bad field of a request body."""
    for key in body:
        if key in RESERVED_FIELDS or key.startswith(RESERVED_PREFIX):
            raise BadRequest(key, f"{key}: set by the gateway only; remove it from the request")
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        for key in xargs:
            if isinstance(key, str) and key.startswith(RESERVED_PREFIX):
                raise BadRequest(f"vllm_xargs.{key}", f"vllm_xargs.{key}: shadow tags are set by the gateway only; "
                                 "remove it from the request")
    try:
        SCHEMAS[endpoint].model_validate(body)
    except ValidationError as e:
        loc, value, problem = _describe(e)
        path = _path(loc)
        if problem == "is required":
            raise BadRequest(path, f"{path}: is required") from None
        raise BadRequest(path, f"{path} = {_short(value)}: {problem}") from None


def _message(err: dict[str, Any]) -> str:
    kind = err["type"]
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind in ("int_type", "int_from_float"):
        return "must be an integer"
    if kind in ("string_type", "str_type"):
        return "must be a string"
    if kind == "bool_type":
        return "must be true or false"
    if kind in ("float_type", "finite_number"):
        return "must be a finite number"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a JSON object"
    if kind == "list_type":
        return "must be a list"
    ctx = err.get("ctx") or {}
    for rule, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if rule in ctx:
            return f"must be {op} {ctx[rule]}"
    if kind == "too_short" and ctx.get("min_length") == 1:
        return "must not be empty"
    return str(err["msg"])


def check_session_id(source: str, value: Any) -> str:
    """A session id (or task name) as the gateway accepts it (see the module invariants)."""
    if not isinstance(value, str) or not value:
        raise BadRequest(source, f"{source} = {_short(value)}: a session id must be a non-empty string")
    if len(value) > MAX_SESSION_ID_CHARS:
        raise BadRequest(source, f"{source}: a session id has at most {MAX_SESSION_ID_CHARS} characters "
                         f"(got {len(value)})")
    if not value.isprintable():
        raise BadRequest(source, f"{source} = {_short(value)}: a session id has printable characters only "
                         "(no control or format characters)")
    return value


def header_text(name: str, latin1: str) -> str:
    """An HTTP header value as UTF-8 text (ASGI servers hand over the bytes as latin-1)."""
    try:
        return latin1.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise BadRequest(name, f"{name}: the header value is not valid UTF-8") from None
