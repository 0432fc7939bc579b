"""The error every refused conversion raises, and the name lists its messages show."""

from collections.abc import Iterable


class ConversionError(ValueError):
    """A checkpoint cannot be converted; the message names what is wrong and how to fix it."""


def names_preview(names: Iterable[str], limit: int = 8) -> str:
    """The first `limit` of `names`, sorted, and how many more there are: a message stays readable for any model."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
