"""The paper's approaches (Table 2) as registered shadow policies.

Each is a plain function of JSON keyword arguments returning a
:class:`shadowcore.policy.PolicySpec`; they register through the
``shadowprefill.policies`` entry points exactly as a third-party policy does.
"""
