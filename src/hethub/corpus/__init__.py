"""Training data at any size: tokenized corpora read where they lie (never loaded whole, never
widened; only a batch's windows are copied), windows in a seeded order shuffled by epoch,
weighted blends; and ``hethub data prepare``, which tokenizes raw text into Megatron-LM's
indexed format.

    formats   the formats by name (no torch)
    indexed   Megatron-LM's .bin + .idx, read and written bit for bit
    tokens    a corpus's token files as one stream; only the windows asked for are copied
    windows   Corpus: the epochs' seeded orders of windows, blends, evaluation's windows
    sources   open_corpus: what --data names (prepared folder, prefix, .bin, text, blend)
    prepare   tokenizing text, .jsonl and .parquet with a HuggingFace tokenizer (no torch)

``from hethub.corpus import open_corpus, Corpus`` loads torch (a Corpus hands out tensors) at
that moment, not when the package is imported: `hethub data prepare` runs without it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hethub.corpus.sources import absolute_spec, open_corpus
    from hethub.corpus.windows import BlendedCorpus, Corpus, TokenCorpus

EXPORTS = {
    "open_corpus": "sources",
    "absolute_spec": "sources",
    "Corpus": "windows",
    "TokenCorpus": "windows",
    "BlendedCorpus": "windows",
}
__all__ = ["BlendedCorpus", "Corpus", "TokenCorpus", "absolute_spec", "open_corpus"]


def __getattr__(name: str) -> object:
    if name not in EXPORTS:
        raise AttributeError(f"module 'hethub.corpus' has no attribute {name!r}")
    return getattr(import_module(f"hethub.corpus.{EXPORTS[name]}"), name)
