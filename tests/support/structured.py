"""Tiny models for structured-output tests: a byte-level BPE tokenizer trained in the suite and
random-weight checkpoints whose vocabulary it fills (random logits are garbage, so only a
correct grammar mask can make their output match a schema)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from atombatch import ArtifactConfig, Batcher, ModelSpec
from atombatch.runtime import NumpyRuntime

EOS, BOS = "<|eos|>", "<|bos|>"
TOKENIZER_VOCAB = 384                    # 256 bytes + 2 specials + merges
VOCAB = 400                              # the model's logits: wider than the tokenizer, as Qwen3's

SPEC = ModelSpec(name="structured-test", family="llama", vocab_size=VOCAB, hidden_size=64,
                 intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 bos_token_id=1, eos_token_ids=(0,), dtype="float32")
ART = ArtifactConfig(model=SPEC, batch_size=4, max_seq_len=256, block_size=64, num_blocks=17,
                     prefill_chunk_size=32, kv_dtype="float32")

_CORPUS = ['{"name": "Ada", "age": 36, "tags": ["x", "y"], "ok": true, "score": -1.5e3}',
           "yes no maybe 0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
           '[{"id": 1}, {"id": 2}, null, false] user assistant system']


def byte_tokenizer(specials: tuple[str, ...] = (EOS, BOS)) -> Any:
    """A byte-level BPE (`tokenizers.Tokenizer`): the specials first (by default EOS id 0, BOS
    id 1), then every byte, then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    assert [tok.token_to_id(t) for t in specials] == list(range(len(specials)))
    return tok


def checkpoint_dir(path: Path) -> Path:
    """A Qwen3 checkpoint directory `python -m atombatch.serve --model` reads: the suite's tiny
    random transformers model (tests/support/hf_models.py: vocab 512, BOS 1, EOS 2) and a byte-level
    tokenizer whose ids 0..2 are its pad, BOS and EOS."""
    from support.hf_models import save_checkpoint

    save_checkpoint("qwen3", path)
    tok = byte_tokenizer(("<|pad|>", BOS, EOS))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": "<|pad|>"}))
    return path


def batcher(seed: int = 3, **options: Any) -> Batcher:
    """The tiny Llama on the NumPy runtime with the byte tokenizer (a core factory too)."""
    return Batcher(NumpyRuntime.random(ART, seed=seed), tokenizer=byte_tokenizer(), **options)

