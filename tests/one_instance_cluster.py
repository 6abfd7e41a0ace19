"""A fake cluster port for manager tests: one instance per model, block size
16, nothing cached, prefills instant (the manager's placement and gap
tracking without an engine)."""

from __future__ import annotations


class OneInstanceCluster:
    def instances(self, model):
        return (f"{model}-0",)

    def block_size(self, instance_id):
        return 16

    def cached_prefix_tokens(self, instance_id, history):
        return 0

    def estimated_prefill_completion_s(self, instance_id, num_uncached_tokens):
        return 0.0
