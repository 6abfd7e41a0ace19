"""Kit for plugin authors: hypothesis strategies, state machines, a conformance check and a deterministic in-memory fake engine. Needs the ``dev`` extra (hypothesis) for strategies and machines."""
