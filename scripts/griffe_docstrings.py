"""A Griffe extension for the API reference (mkdocs.yml loads it for mkdocstrings).

gacli's docstrings follow the house style: Google sections, an ``Example:`` of doctest lines, and
Sphinx roles (``:class:`~gacli.AccumulationConfig```) where a name is another object. Griffe reads
``Examples:`` (plural) as code and ``Example:`` as prose, in which a ``>>> # comment`` line would
become a heading; and it leaves Sphinx roles as text. This extension reads the docstrings as
written: ``Example:`` as ``Examples:``, and a role as the plain code name it points at.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|obj|data|exc):`~?(?:[\w.]+\.)?(\w+)`")


class ReadDocstringsAsWritten(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(r"`\1`", text)
