"""Words for counts in what hethub prints."""

from __future__ import annotations


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and its noun, singular for one: "1 rank", "2 ranks", "3 processes" (``nouns``:
    the plural where adding an s is wrong)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
