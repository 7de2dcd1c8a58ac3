"""The formats a corpus comes in, by name: what --data and `hethub data prepare` accept (no
torch here: `hethub data prepare` reads these without loading it)."""

from __future__ import annotations

BUILTIN_NAME = "the built-in corpus"
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
"""Files read as text (bytes): alone, or found in a folder."""
PREPARED_FILES = ("metadata.json", "tokens.bin", "tokens.idx")
"""What ``hethub data prepare`` writes into its folder (beside tokenizer/)."""
TEXT_SEPARATOR = b"\n\n"
"""Between the files of a folder of text, as a blank line between documents."""
COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"PK\x03\x04": "zip",
}
"""Magic numbers of compressed files: refused whatever their name says."""
COMPRESSED_SUFFIXES = (".gz", ".zst", ".bz2", ".xz", ".zip", ".lz4", ".7z", ".tar")
"""Refused in a folder given to `hethub data prepare`, where other unknown files are skipped."""
ACCEPTED = (
    "--data takes a folder written by `hethub data prepare`, a Megatron-LM PREFIX "
    "(PREFIX.bin + PREFIX.idx), nanoGPT's .bin of uint16 tokens, a text file "
    f"({' '.join(TEXT_SUFFIXES)}) or a folder of them, or a blend W1:PATH1,W2:PATH2"
)
