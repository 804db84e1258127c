"""One "did you mean" for every message that names an unknown word."""

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`; did you mean `x`?` when a known word is close to `word`, else the empty string."""
    close = difflib.get_close_matches(str(word), sorted(known), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""
