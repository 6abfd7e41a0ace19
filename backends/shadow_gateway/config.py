"""Gateway configuration: a YAML file validated into frozen values.

Every problem is one :class:`~shadowcore.errors.ConfigError` whose message
starts with the field's path (``models.small.instances[0].url``), shows the
value, and ends with the file and line it came from
(``(gateway.yaml:12)``) when the value came from a file.

Invariants: a :class:`GatewayConfig` that constructs is complete: every
model has at least one instance, instance ids are unique across models, the
shadow policy loads (``shadow.policy`` is checked by the core's loader), and
no number is clamped: an out-of-range value is an error.

All models of one gateway share one tokenizer: shadow work sends the token
ids of a session (tokenized by the routed model's instance) to the other
models' instances. Models that name a ``tokenizer`` must name the same one
(checked here); with ``tokenizer_check`` on (the default) the gateway also
tokenizes a probe on one instance of every model at startup and refuses to
start when they disagree (:meth:`shadow_gateway.gateway.Gateway.check_tokenizers`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import attrs
import yaml

from shadow_gateway.recording import RecordConfig
from shadowcore._validators import non_empty_str, non_negative, non_negative_int, positive, positive_int
from shadowcore.config import PluginRef, ShadowConfig
from shadowcore.errors import ConfigError


class SchedulerKind(enum.Enum):
    """What runs inside an instance, and so how shadow work reaches it."""

    SHADOW = "shadow"  # the shadow scheduler (shadow_vllm): tagged shadow requests
    STOCK = "stock"  # stock vLLM: request-level shadows (Appendix D.1), lowest priority


def _url(_instance: Any, attribute: Any, value: Any) -> None:
    parsed = urlparse(value) if isinstance(value, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(attribute.name, value, "must be an http(s) URL such as http://127.0.0.1:8001")


@attrs.frozen
class InstanceConfig:
    url: str = attrs.field(validator=_url, converter=lambda u: u.rstrip("/") if isinstance(u, str) else u)
    id: str = ""  # default: "<model>/<index>"
    scheduler: SchedulerKind = attrs.field(default=SchedulerKind.SHADOW, converter=lambda v: _enum(SchedulerKind, v))


@attrs.frozen
class PriceConfig:
    """US dollars per million tokens (cached input billed separately)."""

    input_per_mtok: float = attrs.field(default=0.0, validator=non_negative)
    cached_input_per_mtok: float = attrs.field(default=0.0, validator=non_negative)
    output_per_mtok: float = attrs.field(default=0.0, validator=non_negative)


@attrs.frozen
class ModelConfig:
    name: str = attrs.field(validator=non_empty_str)
    instances: tuple[InstanceConfig, ...] = attrs.field(converter=tuple)
    served_name: str = ""  # the name the upstream servers know; default: ``name``
    price: PriceConfig = attrs.Factory(PriceConfig)
    block_size: int = attrs.field(default=16, validator=positive_int)
    #: Prefill speed used to estimate when an uncached prefill completes (placement).
    prefill_tokens_per_s: float = attrs.field(default=10_000.0, validator=positive)
    #: A dedicated shadow instance (used only by policies with dedicated instances).
    shadow_instance: InstanceConfig | None = None
    #: Name of the tokenizer (e.g. the Hugging Face repo or path the servers
    #: load); models that name one must all name the same.
    tokenizer: str = attrs.field(default="", validator=lambda _i, a, v: _str(a, v))

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name


@attrs.frozen
class SessionConfig:
    header: str = attrs.field(default="X-Session-Id", validator=non_empty_str)
    field: str = attrs.field(default="session_id", validator=non_empty_str)
    task_header: str = attrs.field(default="X-Session-Task", validator=non_empty_str)
    idle_timeout_s: float = attrs.field(default=3600.0, validator=positive)
    #: Most sessions kept; a new session beyond it ends the least recently seen idle one (LRU).
    max_sessions: int = attrs.field(default=100_000, validator=positive_int)
    #: Most tasks (X-Session-Task values) whose counts the switch predictor keeps, LRU.
    max_tasks: int = attrs.field(default=10_000, validator=positive_int)


@attrs.frozen
class HealthConfig:
    interval_s: float = attrs.field(default=2.0, validator=positive)
    timeout_s: float = attrs.field(default=1.0, validator=positive)
    #: Consecutive failed checks (or routed-call connection failures) before an
    #: instance is taken out of rotation; one passing check brings it back.
    unhealthy_after: int = attrs.field(default=2, validator=positive_int)


@attrs.frozen
class UpstreamConfig:
    """Routed (and plain) calls."""

    connect_timeout_s: float = attrs.field(default=2.0, validator=positive)
    #: Longest silence between two bytes of a response (a hung instance).
    read_timeout_s: float = attrs.field(default=600.0, validator=positive)
    #: Further attempts, on other healthy instances of the same model, when an
    #: attempt fails before any byte reached the client (connection error, 5xx, timeout).
    retries: int = attrs.field(default=1, validator=non_negative_int)
    max_connections: int = attrs.field(default=512, validator=positive_int)
    #: Outlier ejection: a routed call with no response after this long (a hung instance whose
    #: /health may still answer), or one that timed out, takes its instance out of placement and
    #: shadow work for ``eject_s`` (the call itself waits on, up to ``read_timeout_s``).
    first_byte_bound_s: float = attrs.field(default=30.0, validator=positive)
    eject_s: float = attrs.field(default=30.0, validator=positive)
    #: Response bodies, stream lines and shadow bodies this large (bytes) are decoded and encoded
    #: in a worker process, off the event loop (shadow_gateway.offload).
    offload_min_bytes: int = attrs.field(default=1 << 20, validator=positive_int)


@attrs.frozen
class ShadowSubmitConfig:
    """Shadow requests: a separate connection pool, short timeouts, dropped first."""

    timeout_s: float = attrs.field(default=60.0, validator=positive)
    connect_timeout_s: float = attrs.field(default=1.0, validator=positive)
    max_inflight_per_instance: int = attrs.field(default=4, validator=positive_int)
    #: After a failed shadow submission the instance gets no shadow work for this long.
    backoff_s: float = attrs.field(default=1.0, validator=non_negative)
    #: vLLM priority of request-level shadows (lower runs earlier; routed calls use 0).
    request_level_priority: int = attrs.field(default=1_000_000, validator=positive_int)
    #: How often a request-level lane re-checks a busy destination's waiting queue.
    poll_interval_s: float = attrs.field(default=0.05, validator=positive)
    #: A lane hands out work at most this often (a streaming call grows its
    #: jobs every token; batching the growth keeps lane CPU off the routed path).
    fill_interval_s: float = attrs.field(default=0.005, validator=non_negative)


@attrs.frozen
class GatewayConfig:
    models: tuple[ModelConfig, ...] = attrs.field(converter=tuple)
    router: PluginRef = attrs.Factory(lambda: PluginRef("client-model"))
    shadow: ShadowConfig = attrs.Factory(ShadowConfig)
    session: SessionConfig = attrs.Factory(SessionConfig)
    health: HealthConfig = attrs.Factory(HealthConfig)
    upstream: UpstreamConfig = attrs.Factory(UpstreamConfig)
    shadow_submit: ShadowSubmitConfig = attrs.Factory(ShadowSubmitConfig)
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=non_negative_int)
    #: At startup, tokenize a probe on one instance of every model and refuse
    #: to start when two models disagree.
    tokenizer_check: bool = attrs.field(default=True, validator=lambda _i, a, v: _bool(a, v))
    #: Record every routed call as a session trace (None: off; shadow_gateway.recording).
    record: RecordConfig | None = None

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.models)


def _bool(attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, value, "must be true or false")


def _str(attribute: Any, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(attribute.name, value, "must be a string")


def _enum(cls: type[enum.Enum], value: Any) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(repr(k.value) for k in cls)  # type: ignore[attr-defined]
        raise ConfigError("scheduler", value, f"must be one of {known}") from None


# -- YAML with line numbers ----------------------------------------------------------------


def _compose(node: yaml.Node, path: str, lines: dict[str, int]) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            child = f"{path}.{key}" if path else str(key)
            if key in out:
                raise ConfigError(child, key, f"is given twice (line {key_node.start_mark.line + 1})")
            out[key] = _compose(value_node, child, lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_compose(v, f"{path}[{i}]", lines) for i, v in enumerate(node.value)]
    return yaml.safe_load(yaml.serialize(node))  # a scalar, typed as safe_load types it


@attrs.define
class _Source:
    """Where fields came from, to add ``(file:line)`` to an error."""

    name: str = ""
    lines: dict[str, int] = attrs.Factory(dict)

    def error(self, field: str, value: Any, problem: str) -> ConfigError:
        probe = field
        while probe and probe not in self.lines:
            probe = probe.rpartition(".")[0] if "." in probe else probe.rpartition("[")[0]
        where = f" ({self.name}:{self.lines[probe]})" if self.name and probe in self.lines else ""
        return ConfigError(field, value, problem + where)


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a gateway YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError("--config", str(path), str(e)) from None
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str = "") -> GatewayConfig:
    src = _Source(source)
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source or '<config>'}:{mark.line + 1}:{mark.column + 1}" if mark else (source or "<config>")
        lines = text.splitlines()
        line = lines[mark.line] if mark and mark.line < len(lines) else ""
        raise ConfigError(where, line, str(getattr(e, "problem", e))) from None
    except ConfigError:
        raise
    if node is None:
        raise ConfigError("models", None, f"is missing ({source or '<config>'} is empty)")
    try:
        data = _compose(node, "", src.lines)
    except ConfigError as e:
        raise src.error(e.field, e.value, e.problem) from None
    return from_dict(data, src)


def from_dict(data: Any, src: _Source | None = None) -> GatewayConfig:
    src = src or _Source()
    if not isinstance(data, Mapping):
        raise src.error("", data, "the configuration must be a mapping")
    known = {"models", "router", "shadow", "session", "health", "upstream", "shadow_submit", "listen",
             "tokenizer_check", "record"}
    for k in data:
        if k not in known:
            raise src.error(str(k), data[k], f"unknown field (known: {', '.join(sorted(known))})")
    if "models" not in data:
        raise src.error("models", None, "is required: a mapping of model name -> {instances: [...]}")
    models = _models(data["models"], src)
    router = _plugin("router", data.get("router", "client-model"), src)
    try:
        shadow = ShadowConfig.from_dict(data.get("shadow", {}), field="shadow")
    except ConfigError as e:
        raise src.error(e.field, e.value, e.problem) from None
    listen = data.get("listen", {})
    if not isinstance(listen, Mapping) or set(listen) - {"host", "port"}:
        raise src.error("listen", listen, "must be a mapping with host and port")
    cfg = _build(GatewayConfig, "", {
        "models": models, "router": router, "shadow": shadow,
        "session": _build(SessionConfig, "session", data.get("session", {}), src),
        "health": _build(HealthConfig, "health", data.get("health", {}), src),
        "upstream": _build(UpstreamConfig, "upstream", data.get("upstream", {}), src),
        "shadow_submit": _build(ShadowSubmitConfig, "shadow_submit", data.get("shadow_submit", {}), src),
        **{k: listen[k] for k in ("host", "port") if k in listen},
        **({"tokenizer_check": data["tokenizer_check"]} if "tokenizer_check" in data else {}),
        **({"record": _build(RecordConfig, "record", data["record"], src)} if "record" in data else {}),
    }, src, prefix_of={"host": "listen.host", "port": "listen.port"})
    _check_policy(cfg, src)
    _check_tokenizer_names(cfg, src)
    return cfg


def _check_tokenizer_names(cfg: GatewayConfig, src: _Source) -> None:
    named = [m for m in cfg.models if m.tokenizer]
    for m in named[1:]:
        if m.tokenizer != named[0].tokenizer:
            raise src.error(f"models.{m.name}.tokenizer", m.tokenizer,
                            f"differs from models.{named[0].name}.tokenizer = {named[0].tokenizer!r}: all models "
                            "of one gateway must share a tokenizer (shadow work sends one model's token ids "
                            "to the others); run one gateway per tokenizer")


def _check_policy(cfg: GatewayConfig, src: _Source) -> None:
    from shadowcore.policy import load_policy

    try:
        spec = load_policy(cfg.shadow.policy, field="shadow.policy")
    except ConfigError as e:
        raise src.error(e.field, e.value, e.problem) from None
    if spec.oracle:
        raise src.error("shadow.policy.name", cfg.shadow.policy.name,
                        "an oracle policy cannot run on real engines (it assumes free cached prefixes)")
    if spec.dedicated_instances:
        for i, m in enumerate(cfg.models):
            if m.shadow_instance is None:
                raise src.error(f"models.{m.name}.shadow_instance", None,
                                f"policy {spec.name!r} needs a dedicated shadow instance for every model")


def _plugin(field: str, value: Any, src: _Source) -> PluginRef:
    try:
        return PluginRef.parse(field, value)
    except ConfigError as e:
        raise src.error(e.field, e.value, e.problem) from None


def _build(cls: type, field: str, data: Any, src: _Source, prefix_of: Mapping[str, str] | None = None) -> Any:
    if not isinstance(data, Mapping):
        raise src.error(field, data, "must be a mapping")
    names = {a.name for a in attrs.fields(cls) if a.init}
    for k in data:
        if k not in names:
            path = f"{field}.{k}" if field else str(k)
            raise src.error(path, data[k], f"unknown field (known: {', '.join(sorted(names))})")
    try:
        return cls(**data)
    except ConfigError as e:
        path = (prefix_of or {}).get(e.field) or (f"{field}.{e.field}" if field else e.field)
        raise src.error(path, e.value, e.problem) from None
    except TypeError as e:
        raise src.error(field, dict(data), str(e)) from None


def _instance(field: str, data: Any, src: _Source, default_id: str) -> InstanceConfig:
    if isinstance(data, str):
        data = {"url": data}
    if isinstance(data, Mapping) and "url" not in data:
        raise src.error(f"{field}.url", None, "is required")
    inst = _build(InstanceConfig, field, data, src)
    return inst if inst.id else attrs.evolve(inst, id=default_id)


def _models(data: Any, src: _Source) -> tuple[ModelConfig, ...]:
    if not isinstance(data, Mapping) or not data:
        raise src.error("models", data, "must be a non-empty mapping of model name -> {instances: [...]}")
    out, seen = [], {}
    for name, m in data.items():
        field = f"models.{name}"
        if not isinstance(m, Mapping):
            raise src.error(field, m, "must be a mapping with instances")
        raw = m.get("instances")
        if not isinstance(raw, list) or not raw:
            raise src.error(f"{field}.instances", raw, "must be a non-empty list of instances (URLs)")
        instances = tuple(_instance(f"{field}.instances[{i}]", d, src, f"{name}/{i}") for i, d in enumerate(raw))
        shadow = m.get("shadow_instance")
        if shadow is not None:
            shadow = _instance(f"{field}.shadow_instance", shadow, src, f"{name}/shadow")
        for i, inst in enumerate(instances + ((shadow,) if shadow else ())):
            if inst.id in seen:
                raise src.error(f"{field}.instances[{i}].id", inst.id, f"duplicates the id of {seen[inst.id]}")
            seen[inst.id] = field
        rest = {k: v for k, v in m.items() if k not in ("instances", "shadow_instance", "price")}
        price = _build(PriceConfig, f"{field}.price", m.get("price", {}), src)
        out.append(_build(ModelConfig, field, {"name": str(name), "instances": instances, "price": price,
                                               "shadow_instance": shadow, **rest}, src))
    return tuple(out)
