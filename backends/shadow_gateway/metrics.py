"""Prometheus metrics of one gateway (its own registry, so several gateways
can live in one process, as in tests).

Invariants: every counter only grows; label values are model names,
instance ids and fixed reason words, never session ids (bounded cardinality).
"""

from __future__ import annotations

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram

P = "shadowprefill_gateway_"


@attrs.define(eq=False)
class GatewayMetrics:
    registry: CollectorRegistry = attrs.Factory(CollectorRegistry)
    calls: Counter = attrs.field(init=False)
    switch_calls: Counter = attrs.field(init=False)
    prompt_tokens: Counter = attrs.field(init=False)
    cached_tokens: Counter = attrs.field(init=False)
    switch_cached_tokens: Counter = attrs.field(init=False)
    shadow_tokens_submitted: Counter = attrs.field(init=False)
    shadow_tokens_used: Counter = attrs.field(init=False)
    shadow_requests: Counter = attrs.field(init=False)
    fallbacks: Counter = attrs.field(init=False)
    errors: Counter = attrs.field(init=False)
    call_seconds: Histogram = attrs.field(init=False)
    ejections: Counter = attrs.field(init=False)
    pushes: Counter = attrs.field(init=False)
    push_tokens: Counter = attrs.field(init=False)
    decode_cached_tokens: Counter = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        r = self.registry
        self.calls = Counter(P + "calls", "Calls served", ["model", "kind"], registry=r)
        self.switch_calls = Counter(P + "switch_calls", "Session calls on another model than the previous call",
                                    ["model"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of session calls", ["model"], registry=r)
        self.cached_tokens = Counter(P + "cached_tokens", "Prompt tokens the instance reported cached",
                                     ["model"], registry=r)
        self.switch_cached_tokens = Counter(P + "switch_cached_tokens", "Cached prompt tokens of switch calls",
                                            ["model"], registry=r)
        self.shadow_tokens_submitted = Counter(P + "shadow_tokens_submitted",
                                               "Shadow tokens handed to instances (completed submissions)",
                                               ["model", "mode"], registry=r)
        self.shadow_tokens_used = Counter(P + "shadow_tokens_used",
                                          "Cached tokens of switch calls that only a shadow had provided",
                                          ["model"], registry=r)
        self.shadow_requests = Counter(P + "shadow_requests", "Shadow requests by outcome",
                                       ["model", "mode", "outcome"], registry=r)
        self.fallbacks = Counter(P + "fallbacks", "Degraded paths taken (reason)", ["reason"], registry=r)
        self.errors = Counter(P + "errors", "Upstream errors (where: routed, plain, shadow, health)",
                              ["where", "instance"], registry=r)
        self.ejections = Counter(P + "ejections", "Instances taken out of placement as outliers (reason: "
                                 "first-byte-bound, timeout)", ["instance", "reason"], registry=r)
        self.pushes = Counter(P + "pushes", "P/D shadow pushes to decode instances by outcome (completed, "
                              "skipped-held, timeout, failed, http-Nxx)", ["model", "outcome"], registry=r)
        self.push_tokens = Counter(P + "push_tokens", "Shadow prefix tokens pushed to decode instances beyond "
                                   "what they were expected to hold", ["model"], registry=r)
        self.decode_cached_tokens = Counter(P + "decode_cached_tokens", "P/D calls: prompt tokens the decode "
                                            "instance reported cached (usage.prompt_tokens_details)", ["model"],
                                            registry=r)
        self.call_seconds = Histogram(P + "call_seconds", "Routed call duration at the gateway", ["model"],
                                      registry=r)
