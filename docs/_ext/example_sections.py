"""A griffe extension for the API reference: read ``Example:`` as an examples section.

shardfn's docstrings introduce their doctest with a bare ``Example:`` line (Google style,
as the Napoleon and ruff conventions spell it). griffe's Google parser knows only the plural
``Examples:`` as a section; the singular becomes an admonition whose text is Markdown, so the
``>>>`` lines render as nested block quotes and the example reads as one flattened line.
Renaming the heading before griffe parses the docstring gives each example a highlighted
``pycon`` code block, without touching ~440 docstrings. Loaded by ``mkdocs.yml``
(``plugins: mkdocstrings: ... extensions``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_BARE_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.M)


def plural_example_heading(text: str) -> str:
    """The docstring with each bare ``Example:`` heading line spelled ``Examples:``.

    Args:
        text: A docstring's text (already dedented by griffe).

    Returns:
        The same text; only lines that are exactly ``Example:`` (any indentation) change,
        so ``Example: a title`` admonitions and prose mentioning "Example:" stay as written.

    Example:
        >>> plural_example_heading("Sum.\\n\\nExample:\\n    >>> 1 + 1\\n    2")
        'Sum.\\n\\nExamples:\\n    >>> 1 + 1\\n    2'
    """
    return _BARE_EXAMPLE.sub(r"\g<indent>Examples:", text)


class ExampleSections(griffe.Extension):
    """Rewrites ``Example:`` to ``Examples:`` in every object's docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Called by griffe for each module, class, function and attribute it creates."""
        if obj.docstring is not None:
            obj.docstring.value = plural_example_heading(obj.docstring.value)
