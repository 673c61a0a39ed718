"""A scripted model for tests of what the server makes of a model's text (tool calls, reasoning,
Responses items): `ScriptedRuntime` writes a given text after any prompt (or another text after
a prompt holding a marker), on a byte-level BPE whose added tokens are Qwen3's tool and think
tags (`save_tokenizer`). Only the logits are scripted; blocks, lanes and the engine are real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from atombatch import ArtifactConfig, ModelSpec
from atombatch.runtime.numpy_runtime import NumpyRuntime

NAME = "tools-test"


def save_tokenizer(path: Path, template: str, eos: str, extra: list[str]) -> Any:
    """A byte-level BPE with `extra` as added non-special tokens, saved by transformers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ['{"name": "get_weather", "arguments": {"city": "Seoul"}} weather time zone',
              "What is the weather in Seoul? It is humid. Busan KST UTC think"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    hf.chat_template = template
    hf.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def spec_for(hf: Any, eos: str) -> ModelSpec:
    return ModelSpec(name=NAME, family="qwen3", vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, eos_token_ids=(hf.convert_tokens_to_ids(eos),),
                     dtype="float32")


def artifact(spec: ModelSpec) -> ArtifactConfig:
    return ArtifactConfig(model=spec, batch_size=4, max_seq_len=2048, block_size=2048,
                          num_blocks=5, prefill_chunk_size=128)


class ScriptedRuntime(NumpyRuntime):
    """Writes `script` (token ids) after whatever prompt it prefilled, then EOS.

    A sequence is known by the first block of its table; the prefill's last real position P
    is remembered for it, and the logits at position P + k put all their mass on script[k]."""

    script: list[int]
    replies: list[tuple[list[int], list[int]]] = []  # (marker ids, script): used instead of
                                                     #   `script` when the prompt holds the marker

    def one_hot(self, token: int) -> np.ndarray:
        row = np.full(self.artifact.model.vocab_size, -30.0, dtype=np.float32)
        row[token] = 30.0
        return row

    def next_of(self, block: int, position: int) -> np.ndarray:
        k = position - self.starts[block]
        eos = self.artifact.model.eos_token_ids[0]
        script = self.chosen.get(block, self.script)
        return self.one_hot(script[k] if 0 <= k < len(script) else eos)

    def prefill(self, inputs: Any, *, every_position: bool = False) -> np.ndarray:
        if not hasattr(self, "starts"):
            self.starts: dict[int, int] = {}
            self.prompts: dict[int, list[int]] = {}
            self.chosen: dict[int, list[int]] = {}
        q = int(inputs.query_position)
        block = int(inputs.block_tables[0])
        if int(inputs.cache_position[0, 0]) == 0:  # a new sequence's first chunk
            self.prompts[block] = []
        prompt = self.prompts.setdefault(block, [])
        prompt.extend(int(t) for t in inputs.input_ids[0, :q + 1])
        self.chosen.pop(block, None)
        for marker, script in self.replies:
            if any(prompt[i:i + len(marker)] == marker for i in range(len(prompt))):
                self.chosen[block] = script
                break
        self.starts[block] = int(inputs.cache_position[0, q])
        return self.next_of(block, self.starts[block])

    def decode(self, inputs: Any) -> np.ndarray:
        rows = []
        for lane in range(inputs.input_ids.shape[0]):
            block = int(inputs.block_tables[lane][0])
            rows.append(self.next_of(block, int(inputs.cache_position[lane, 0]))
                        if block in self.starts else self.one_hot(0))
        return np.stack(rows)


def script_ids(hf: Any, text: str) -> list[int]:
    ids = list(hf(text, add_special_tokens=False)["input_ids"])
    assert hf.decode(ids) == text
    return ids


def scripted_batcher(path: str, text: str, replies: tuple[tuple[str, str], ...] = (),
                     eos: str = "<|im_end|>") -> Any:
    """A Batcher whose model writes `text` (or a reply's text after a prompt holding its marker),
    with the tokenizer saved at `path` (a core factory too: module-level, it pickles)."""
    from transformers import AutoTokenizer

    from atombatch import Batcher
    from atombatch.serve.tokens import HFCodec

    hf = AutoTokenizer.from_pretrained(path)
    runtime = ScriptedRuntime.random(artifact(spec_for(hf, eos)), seed=0)
    runtime.script = script_ids(hf, text)
    runtime.replies = [(script_ids(hf, marker), script_ids(hf, reply))
                       for marker, reply in replies]
    codec = HFCodec.from_dir(Path(path))
    return Batcher(runtime, tokenizer=getattr(codec, "tokenizer", None))
