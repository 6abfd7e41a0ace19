"""Griffe extension for the docs build: turn Sphinx roles into cross-references.

The core's docstrings use Sphinx roles (``:class:`~shadowcore.types.StepPlan```,
``:mod:`shadowcore.hook```, ``:meth:`commit```). mkdocstrings renders Markdown,
where such a role would show as a literal ``:class:`` before the code span. This
extension rewrites each role into an *optional* autorefs cross-reference:

* the target is resolved in the scope of the documented object (so ``commit``
  inside ``SlackController`` and ``PolicySpec`` inside ``shadowcore.policy``
  find their full paths, imports included);
* ``~`` shows only the last component, as in Sphinx;
* an optional reference that does not resolve (an object not rendered on the
  site) becomes plain code, never a warning, so ``mkdocs build --strict`` stays
  clean whatever the docstrings name.

Docs build only; the package does not import this file.
"""

from __future__ import annotations

import html
import re
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:class|mod|meth|func|attr|data|exc|obj|const):`(?P<tilde>~?)(?P<target>[^`]+)`")


def _resolve(obj: Object, target: str) -> str:
    head, _, rest = target.partition(".")
    try:
        path = obj.resolve(head)
    except Exception:  # noqa: BLE001 - unresolvable: keep the target as written
        return target
    return f"{path}.{rest}" if rest else path


class SphinxRoles(Extension):
    """Rewrite Sphinx roles in every docstring once the package is loaded."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None or ":`" not in docstring.value:
            return
        scope = obj if obj.is_class or obj.is_module else (obj.parent or obj)

        def replace(match: re.Match[str]) -> str:
            target = match["target"].strip()
            title = target.rsplit(".", 1)[-1] if match["tilde"] else target
            identifier = html.escape(_resolve(scope, target), quote=True)
            return f'<autoref identifier="{identifier}" optional><code>{html.escape(title)}</code></autoref>'

        docstring.value = _ROLE.sub(replace, docstring.value)
