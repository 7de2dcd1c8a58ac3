"""Make examples/hf/llama3-tiny: a HuggingFace Llama folder small enough to keep in the repository,
for the README's "Start from a HuggingFace model" (and to try the commands with no download).

A Llama-3-shaped model (grouped-query attention, rope_theta 500000) of 0.27M random parameters,
saved by transformers itself (config.json, generation_config.json, model.safetensors), and a
byte-level BPE tokenizer of 512 tokens trained by the tokenizers library on this repository's
docs/ (tokenizer.json, tokenizer_config.json with its EOS). Run from the repository's root:

    python examples/hf/make_llama3_tiny.py [OUT]

(needs transformers: pip install -e '.[test]'). The folder it wrote is committed; running it
again writes the same configuration and tokenizer, and weights drawn from the same seed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
EOS = "<|end_of_text|>"
VOCAB = 512


def tokenizer(out: Path) -> None:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train([str(p) for p in sorted((ROOT / "docs").glob("*.md"))], trainer)
    bpe.save(str(out / "tokenizer.json"))
    config = {"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def model(out: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        eos_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "llama3-tiny"
    out.mkdir(parents=True, exist_ok=True)
    tokenizer(out)
    model(out)
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
