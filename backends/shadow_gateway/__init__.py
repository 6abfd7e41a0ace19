"""The session gateway (``shadowprefill serve``): an OpenAI-compatible front
door that routes agent calls per step and keeps the next model warm.

Modules: ``config`` (the YAML file), ``router`` (per-step routers, entry-point
group ``shadowprefill.routers``), ``cluster`` (the core's ClusterPort from what
the gateway saw), ``shadow`` (shadow submission lanes), ``gateway`` (the
logic), ``app`` (the FastAPI surface), ``serve`` (the command). Importing
this package imports none of FastAPI, uvicorn or httpx.
"""
