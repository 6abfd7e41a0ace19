"""Session traces: recorded or converted agent sessions, one LLM call per line
(:mod:`shadow_traces.session_trace`, the versioned format and its JSON Schema),
loaders from SWE-agent trajectories, Copilot traces and per-call CSV tables
(:mod:`shadow_traces.agent_loaders`), the ``shadowprefill sessions`` command
(:mod:`shadow_traces.command`) and the conversion into the engines' session
plans (:mod:`shadow_traces.replay`).

A package of its own because it validates with ``jsonschema`` and may count
tokens with a user's tokenizer, which ``shadowcore`` (attrs and numpy only)
never imports. It depends on ``shadowcore``; ``shadowcore`` never on it.
"""
