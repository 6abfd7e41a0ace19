"""An example third-party shadow policy for shadowprefill.

``example-gated-top1`` (:func:`example_shadow_policy.policy.example_gated_top1`)
keeps the paper's SLO-slack controller but shadows to the single most likely
next model, and only when that model is likely enough.
"""

from example_shadow_policy.policy import GatedTopK, example_gated_top1

__all__ = ["GatedTopK", "example_gated_top1"]
