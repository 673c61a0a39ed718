"""The sampler tests' tiny model and a piece tokenizer (token t decodes to a short piece)."""

from __future__ import annotations

from typing import Any

from atombatch import ArtifactConfig, ModelSpec

VOCAB = 97


EOS = 7


def spec(eos: tuple[int, ...] = (EOS,)) -> ModelSpec:
    return ModelSpec(name="tiny", family="qwen3", vocab_size=VOCAB, hidden_size=32, num_heads=2,
                     intermediate_size=64, num_layers=2, num_kv_heads=1, head_dim=16,
                     eos_token_ids=eos)


def artifact(batch_size: int = 4, block_size: int = 16, chunk: int = 16) -> ArtifactConfig:
    return ArtifactConfig(model=spec(), batch_size=batch_size, max_seq_len=64,
                          block_size=block_size, num_blocks=batch_size * (64 // block_size) + 8,
                          prefill_chunk_size=chunk)


# -- stop strings -------------------------------------------------------------------------------------
PIECES = ["<unk>", "<eos>"] + [f"p{i}" for i in range(VOCAB - 2)]


def piece_tokenizer() -> Any:
    """A tokenizer whose token t (t >= 2) decodes to a 2-3 character piece, glued together."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {p: i for i, p in enumerate(PIECES)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>"])
    return tok
