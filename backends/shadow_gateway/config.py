"""Gateway configuration: a YAML file validated into frozen values.

Every problem is one :class:`~shadowcore.errors.ConfigError` whose message
starts with the field's path (``models.small.instances[0].url``), shows the
value, and ends with the file and line it came from
(``(gateway.yaml:12)``) when the value came from a file.

Invariants: a :class:`GatewayConfig` that constructs is complete: every
model has at least one instance, instance ids are unique across models, a
P/D model (``prefill_instances`` / ``decode_instances``, or ``role`` per
instance) has at least one instance of each role and no colocated one, the
shadow policy loads (``shadow.policy`` is checked by the core's loader), and
no number is clamped: an out-of-range value is an error.

All models of one gateway share one tokenizer: shadow work sends the token
ids of a session (tokenized by the routed model's instance) to the other
models' instances. Models that name a ``tokenizer`` must name the same one
(checked here); with ``tokenizer_check`` on (the default) the gateway also
tokenizes a probe on one instance of every model at startup and refuses to
start when they disagree (:meth:`shadow_gateway.gateway.Gateway.check_tokenizers`).

Secrets: client API keys (``auth.api_keys``, or the environment variable
:data:`API_KEYS_ENV`) and upstream credentials (``api_key_env`` of a model or
instance: the *name* of an environment variable) are read once, here; they
never appear in a repr, an error message or a log line. Without client keys
the gateway listens on a loopback address only.
"""

from __future__ import annotations

import enum
import hashlib
import ipaddress
import os
import re
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

#: Environment variable with client API keys: comma-separated ``KEY`` or ``TENANT:KEY`` entries.
API_KEYS_ENV = "SHADOWPREFILL_GATEWAY_API_KEYS"
#: Tenant names: letters, digits, ``.``, ``_``, ``-`` (never ``:``, which separates
#: a tenant from a session id inside the gateway).
TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
MIN_KEY_LENGTH = 16
LOOPBACK_NAMES = frozenset({"localhost"})


class _Redacted:
    """Stands for a secret in an error message."""

    def __repr__(self) -> str:
        return "<redacted>"


REDACTED = _Redacted()


class SchedulerKind(enum.Enum):
    """What runs inside an instance, and so how shadow work reaches it."""

    SHADOW = "shadow"  # the shadow scheduler (shadow_vllm): tagged shadow requests
    STOCK = "stock"  # stock vLLM: request-level shadows (Appendix D.1), lowest priority


class InstanceRole(enum.Enum):
    """What an instance does for its model (vLLM's P/D disaggregation, paper §3.5).

    ``both``: a colocated instance (prefill and decode). ``prefill``: a P
    instance (``kv_transfer_config`` with a producer role): it prefills a
    routed call's prompt and the session's shadow jobs, and hands the KV to a
    D instance through its KV connector. ``decode``: a D instance (consumer):
    it decodes routed calls from the KV a P instance computed, and receives
    shadow pushes. A model's instances are either all ``both`` or all
    ``prefill`` / ``decode`` (at least one of each)."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


def _url(_instance: Any, attribute: Any, value: Any) -> None:
    parsed = urlparse(value) if isinstance(value, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(attribute.name, value, "must be an http(s) URL such as http://127.0.0.1:8001")


def _env_name(_instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or (value and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value)):
        raise ConfigError(attribute.name, value, "must be the name of an environment variable")


@attrs.frozen
class InstanceConfig:
    url: str = attrs.field(validator=_url, converter=lambda u: u.rstrip("/") if isinstance(u, str) else u)
    id: str = ""  # default: "<model>/<index>"
    scheduler: SchedulerKind = attrs.field(default=SchedulerKind.SHADOW, converter=lambda v: _enum(SchedulerKind, v))
    role: InstanceRole = attrs.field(default=InstanceRole.BOTH,
                                     converter=lambda v: _enum(InstanceRole, v, "role"))
    #: Name of the environment variable holding this instance's API key (vLLM's
    #: ``--api-key``); default: the model's ``api_key_env``.
    api_key_env: str = attrs.field(default="", validator=_env_name)
    #: The key itself, read from ``api_key_env`` when the configuration loads.
    api_key: str = attrs.field(default="", repr=False)

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers every request to this instance carries (routed calls, shadows, probes)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


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
    #: Default ``api_key_env`` of this model's instances.
    api_key_env: str = attrs.field(default="", validator=_env_name)

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name

    @property
    def is_pd(self) -> bool:
        """Disaggregated: prefill and decode instances (vLLM's ``kv_transfer_params`` protocol)."""
        return any(i.role is not InstanceRole.BOTH for i in self.instances)

    @property
    def prefill_instances(self) -> tuple[InstanceConfig, ...]:
        """Where prompts (and shadow jobs) are prefilled: the P instances, or every colocated one."""
        return tuple(i for i in self.instances if i.role is not InstanceRole.DECODE)

    @property
    def decode_instances(self) -> tuple[InstanceConfig, ...]:
        """The D instances of a P/D model (empty for a colocated one)."""
        return tuple(i for i in self.instances if i.role is InstanceRole.DECODE)


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
class PDConfig:
    """P/D deployments (models with prefill and decode instances).

    A routed call goes to the session's sticky P instance with
    ``kv_transfer_params: {do_remote_decode: true}`` and one output token, then to its
    sticky D instance with the ``kv_transfer_params`` P answered (vLLM's
    disaggregated-serving protocol; connectors that move KV by content, such as
    ``ExampleConnector``, ignore them). A shadow job runs on the sticky P of a model the
    router did not choose; each shadow prefix P finished is pushed toward that model's
    sticky D the same way (a request for the prefix with one output token)."""

    #: Push shadow prefixes to the sticky D instance (off: shadows stay on P).
    push: bool = attrs.field(default=True, validator=lambda _i, a, v: _bool(a, v))
    push_timeout_s: float = attrs.field(default=60.0, validator=positive)
    #: vLLM priority of pushes to ``scheduler: stock`` D instances (lower runs earlier; routed calls use 0).
    push_priority: int = attrs.field(default=1_000_000, validator=positive_int)


@attrs.frozen
class ApiKey:
    """One client key; the sessions made with it belong to ``tenant`` (keys
    that name the same tenant share its sessions)."""

    key: str = attrs.field(repr=False)
    tenant: str


@attrs.frozen
class AuthConfig:
    """Client API keys. None: every client is trusted, and the gateway listens
    on a loopback address only."""

    api_keys: tuple[ApiKey, ...] = attrs.field(default=(), converter=tuple)
    #: With keys: each tenant's requests (routed and plain calls, shadows) carry
    #: a ``cache_salt`` of their own, so no tenant hits (or learns from
    #: ``cached_tokens``) another tenant's prefix cache entries.
    isolate_caches: bool = attrs.field(default=True, validator=lambda _i, a, v: _bool(a, v))

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys)


@attrs.frozen
class AccessLogConfig:
    """One structured line per call on the logger ``shadow_gateway.access``."""

    enabled: bool = attrs.field(default=True, validator=lambda _i, a, v: _bool(a, v))
    #: Add the request body to each line (prompts: off by default).
    bodies: bool = attrs.field(default=False, validator=lambda _i, a, v: _bool(a, v))


@attrs.frozen
class GatewayConfig:
    models: tuple[ModelConfig, ...] = attrs.field(converter=tuple)
    router: PluginRef = attrs.Factory(lambda: PluginRef("client-model"))
    shadow: ShadowConfig = attrs.Factory(ShadowConfig)
    session: SessionConfig = attrs.Factory(SessionConfig)
    health: HealthConfig = attrs.Factory(HealthConfig)
    upstream: UpstreamConfig = attrs.Factory(UpstreamConfig)
    shadow_submit: ShadowSubmitConfig = attrs.Factory(ShadowSubmitConfig)
    pd: PDConfig = attrs.Factory(PDConfig)
    auth: AuthConfig = attrs.Factory(AuthConfig)
    access_log: AccessLogConfig = attrs.Factory(AccessLogConfig)
    host: str = attrs.field(default="127.0.0.1", validator=lambda _i, a, v: check_host(a.name, v))
    port: int = attrs.field(default=8000, validator=lambda _i, a, v: check_port(a.name, v))
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


def check_host(field: str, value: Any) -> None:
    """A listen address: an IP address or a host name."""
    if not isinstance(value, str) or not value:
        raise ConfigError(field, value, "must be a string: an IP address or a host name such as 127.0.0.1")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*",
                            value):
            raise ConfigError(field, value, "must be an IP address or a host name such as 127.0.0.1") from None


def check_port(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(field, value, "must be a TCP port, an integer in [1, 65535]")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(field: str, host: str, auth: AuthConfig) -> None:
    """Without client keys the gateway listens on loopback only."""
    if not auth.enabled and not is_loopback(host):
        raise ConfigError(field, host, f"without client API keys (auth.api_keys or ${API_KEYS_ENV}) the gateway "
                          "listens on a loopback address only (127.0.0.1, ::1, localhost); configure keys to "
                          "serve other hosts")


def _bool(attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, value, "must be true or false")


def _str(attribute: Any, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(attribute.name, value, "must be a string")


def _enum(cls: type[enum.Enum], value: Any, field: str = "scheduler") -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(repr(k.value) for k in cls)  # type: ignore[attr-defined]
        raise ConfigError(field, value, f"must be one of {known}") from None


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


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read and validate a gateway YAML file (secrets from ``environ``, default ``os.environ``)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError("--config", str(path), str(e)) from None
    return parse_config(text, source=str(path), environ=environ)


def parse_config(text: str, source: str = "", environ: Mapping[str, str] | None = None) -> GatewayConfig:
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
    return from_dict(data, src, environ)


KNOWN_SECTIONS = ("models", "router", "shadow", "session", "health", "upstream", "shadow_submit", "pd", "listen",
                  "tokenizer_check", "auth", "access_log", "record")


def from_dict(data: Any, src: _Source | None = None, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    src = src or _Source()
    env = os.environ if environ is None else environ
    if not isinstance(data, Mapping):
        raise src.error("", data, "the configuration must be a mapping")
    for k in data:
        if k not in KNOWN_SECTIONS:
            raise src.error(str(k), data[k], f"unknown field (known: {', '.join(sorted(KNOWN_SECTIONS))})")
    if "models" not in data:
        raise src.error("models", None, "is required: a mapping of model name -> {instances: [...]}")
    models = _models(data["models"], src, env)
    router = _plugin("router", data.get("router", "client-model"), src)
    try:
        shadow = ShadowConfig.from_dict(data.get("shadow", {}), field="shadow")
    except ConfigError as e:
        raise src.error(e.field, e.value, e.problem) from None
    listen = data.get("listen", {})
    if not isinstance(listen, Mapping):
        raise src.error("listen", listen, "must be a mapping with host and port")
    for k in listen:
        if k not in ("host", "port"):
            raise src.error(f"listen.{k}", listen[k], "unknown field (known: host, port)")
    auth = _auth(data.get("auth", {}), src, env)
    cfg = _build(GatewayConfig, "", {
        "models": models, "router": router, "shadow": shadow, "auth": auth,
        "session": _build(SessionConfig, "session", data.get("session", {}), src),
        "health": _build(HealthConfig, "health", data.get("health", {}), src),
        "upstream": _build(UpstreamConfig, "upstream", data.get("upstream", {}), src),
        "shadow_submit": _build(ShadowSubmitConfig, "shadow_submit", data.get("shadow_submit", {}), src),
        "pd": _build(PDConfig, "pd", data.get("pd", {}), src),
        "access_log": _build(AccessLogConfig, "access_log", data.get("access_log", {}), src),
        **{k: listen[k] for k in ("host", "port") if k in listen},
        **({"tokenizer_check": data["tokenizer_check"]} if "tokenizer_check" in data else {}),
        **({"record": _build(RecordConfig, "record", data["record"], src)} if "record" in data else {}),
    }, src, prefix_of={"host": "listen.host", "port": "listen.port"})
    try:
        check_listen("listen.host", cfg.host, cfg.auth)
    except ConfigError as e:
        raise src.error(e.field, e.value, e.problem) from None
    _check_policy(cfg, src)
    _check_tokenizer_names(cfg, src)
    return cfg


def _auth(data: Any, src: _Source, env: Mapping[str, str]) -> AuthConfig:
    """Client keys from ``auth.api_keys`` (a key, ``{key, tenant}`` or
    ``{key_env, tenant}`` each) and from :data:`API_KEYS_ENV`."""
    if not isinstance(data, Mapping):
        raise src.error("auth", data, "must be a mapping with api_keys")
    for k in data:
        if k not in ("api_keys", "isolate_caches"):
            raise src.error(f"auth.{k}", data[k], "unknown field (known: api_keys, isolate_caches)")
    isolate = data.get("isolate_caches", True)
    if not isinstance(isolate, bool):
        raise src.error("auth.isolate_caches", isolate, "must be true or false")
    raw = data.get("api_keys", [])
    if not isinstance(raw, list):
        raise src.error("auth.api_keys", raw, "must be a list of keys or {key | key_env, tenant} mappings")
    found: list[tuple[str, str, str]] = []  # (field, key, tenant)
    for i, entry in enumerate(raw):
        field = f"auth.api_keys[{i}]"
        if isinstance(entry, str):
            entry = {"key": entry}
        if not isinstance(entry, Mapping):
            raise src.error(field, REDACTED, "must be a key or a {key | key_env, tenant} mapping")
        for k in entry:
            if k not in ("key", "key_env", "tenant"):
                raise src.error(f"{field}.{k}", entry[k], "unknown field (known: key, key_env, tenant)")
        if ("key" in entry) == ("key_env" in entry):
            raise src.error(field, REDACTED, "needs exactly one of key (the key) and key_env (a variable holding it)")
        if "key_env" in entry:
            name = entry["key_env"]
            if not isinstance(name, str) or not env.get(name):
                raise src.error(f"{field}.key_env", name, "names no set environment variable")
            key = env[name]
        else:
            key = entry["key"]
        found.append((field, key, entry.get("tenant", "")))
    for i, item in enumerate(e for e in env.get(API_KEYS_ENV, "").split(",") if e.strip()):
        tenant, sep, key = item.strip().partition(":")
        found.append((f"${API_KEYS_ENV}[{i}]", key if sep else tenant, tenant if sep else ""))
    keys: list[ApiKey] = []
    seen: dict[str, str] = {}
    for field, key, tenant in found:
        if not isinstance(key, str) or len(key) < MIN_KEY_LENGTH or not key.isprintable() or " " in key:
            raise src.error(field, REDACTED, f"an API key must be a string of at least {MIN_KEY_LENGTH} "
                            "printable characters without spaces")
        if key in seen:
            raise src.error(field, REDACTED, f"the same key as {seen[key]}")
        seen[key] = field
        if tenant == "":
            tenant = "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        elif not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
            raise src.error(f"{field}.tenant" if field.startswith("auth") else field, tenant,
                            "a tenant name is 1 to 64 letters, digits, '.', '_' or '-'")
        keys.append(ApiKey(key, tenant))
    return AuthConfig(tuple(keys), isolate)


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


def _instance(field: str, data: Any, src: _Source, default_id: str, env: Mapping[str, str],
              default_key_env: str = "") -> InstanceConfig:
    if isinstance(data, str):
        data = {"url": data}
    if isinstance(data, Mapping) and "url" not in data:
        raise src.error(f"{field}.url", None, "is required")
    if isinstance(data, Mapping) and "api_key" in data:
        raise src.error(f"{field}.api_key", REDACTED, "give api_key_env, the name of an environment variable "
                        "holding the key, not the key itself")
    inst = _build(InstanceConfig, field, data, src)
    key_env = inst.api_key_env or default_key_env
    if key_env:
        if not env.get(key_env):
            where = f"{field}.api_key_env" if inst.api_key_env else field.rpartition(".")[0] + ".api_key_env"
            raise src.error(where, key_env, "names no set environment variable")
        inst = attrs.evolve(inst, api_key_env=key_env, api_key=env[key_env])
    return inst if inst.id else attrs.evolve(inst, id=default_id)


def _url_key(url: str) -> str:
    p = urlparse(url)
    port = p.port or (443 if p.scheme == "https" else 80)
    return f"{p.scheme}://{(p.hostname or '').lower()}:{port}{p.path.rstrip('/')}"


#: Instance lists of a model and the role each gives its instances.
ROLE_LISTS = (("instances", None), ("prefill_instances", InstanceRole.PREFILL),
              ("decode_instances", InstanceRole.DECODE))


def _model_instances(field: str, m: Mapping[str, Any], src: _Source, env: Mapping[str, str],
                     name: str, key_env: str) -> tuple[tuple[InstanceConfig, ...], list[str]]:
    """All instances of one model (``instances`` and the P/D lists, in that
    order) and the field path of each; the P/D rules checked, errors naming the field."""
    given = [k for k, _ in ROLE_LISTS if k in m]
    if not given:
        raise src.error(f"{field}.instances", None, "is required: a non-empty list of instances (URLs), or "
                        "prefill_instances and decode_instances for a P/D deployment")
    instances: list[InstanceConfig] = []
    fields: list[str] = []
    for key, role in ROLE_LISTS:
        if key not in m:
            continue
        raw = m[key]
        if not isinstance(raw, list) or not raw:
            raise src.error(f"{field}.{key}", raw, "must be a non-empty list of instances (URLs)")
        for i, d in enumerate(raw):
            f = f"{field}.{key}[{i}]"
            if role is not None and isinstance(d, Mapping) and "role" in d and d["role"] != role.value:
                raise src.error(f"{f}.role", d["role"], f"an instance of {key} has role {role.value!r}")
            if role is not None:
                d = {"url": d} if isinstance(d, str) else {**d, "role": role.value} if isinstance(d, Mapping) else d
            prefix = {"prefill_instances": "p", "decode_instances": "d"}.get(key, "")
            inst = _instance(f, d, src, f"{name}/{prefix}{i}", env, key_env)
            if role is not None:
                inst = attrs.evolve(inst, role=role)
            instances.append(inst)
            fields.append(f)
    roles = {i.role for i in instances}
    if len(roles) > 1 and InstanceRole.BOTH in roles:
        f = fields[next(k for k, i in enumerate(instances) if i.role is InstanceRole.BOTH)]
        raise src.error(f"{f}.role", "both", "a P/D model's instances are all prefill or decode instances "
                        "(give role: prefill or role: decode, or list them under prefill_instances / "
                        "decode_instances)")
    if roles - {InstanceRole.BOTH}:
        for need, key in ((InstanceRole.PREFILL, "prefill_instances"), (InstanceRole.DECODE, "decode_instances")):
            if need not in roles:
                raise src.error(f"{field}.{key}", None, f"is required: a P/D model needs at least one "
                                f"{need.value} instance (or an instance with role: {need.value})")
        if "shadow_instance" in m and m["shadow_instance"] is not None:
            raise src.error(f"{field}.shadow_instance", m["shadow_instance"], "a P/D model runs its shadow "
                            "jobs on its prefill instances; a dedicated shadow instance is not supported there")
    return tuple(instances), fields


def _models(data: Any, src: _Source, env: Mapping[str, str]) -> tuple[ModelConfig, ...]:
    if not isinstance(data, Mapping) or not data:
        raise src.error("models", data, "must be a non-empty mapping of model name -> {instances: [...]}")
    out, seen, urls = [], {}, {}
    for name, m in data.items():
        field = f"models.{name}"
        if not isinstance(m, Mapping):
            raise src.error(field, m, "must be a mapping with instances")
        key_env = m.get("api_key_env", "")
        if not isinstance(key_env, str):
            raise src.error(f"{field}.api_key_env", key_env, "must be the name of an environment variable")
        instances, fields = _model_instances(field, m, src, env, str(name), key_env)
        shadow = m.get("shadow_instance")
        if shadow is not None:
            shadow = _instance(f"{field}.shadow_instance", shadow, src, f"{name}/shadow", env, key_env)
        fields = fields + [f"{field}.shadow_instance"]
        for f, inst in zip(fields, instances + ((shadow,) if shadow else ()), strict=False):
            if inst.id in seen:
                raise src.error(f"{f}.id", inst.id, f"duplicates the id of {seen[inst.id]}")
            seen[inst.id] = f
            u = _url_key(inst.url)
            if u in urls:
                raise src.error(f"{f}.url", inst.url,
                                f"duplicates the URL of {urls[u]}: one server is one instance")
            urls[u] = f
        rest = {k: v for k, v in m.items() if k not in ("shadow_instance", "price") + tuple(k for k, _ in ROLE_LISTS)}
        price = _build(PriceConfig, f"{field}.price", m.get("price", {}), src)
        out.append(_build(ModelConfig, field, {"name": str(name), "instances": instances, "price": price,
                                               "shadow_instance": shadow, **rest}, src))
    return tuple(out)
