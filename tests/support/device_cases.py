"""Tiny checkpoints of each family with transformers' greedy continuations, and the compiled
layouts, for the device-path tests (the emulated rebel)."""

from __future__ import annotations

import numpy as np

from atombatch import SamplingParams
from support.hf_models import build_model, hf_logits, save_checkpoint

NEW_TOKENS = 8


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


B = 4


_CASES: dict[str, tuple] = {}


def make_case(family, tmp_path_factory):
    """A tiny checkpoint of `family`, prompts (two share a 40-token prefix), and transformers'
    greedy continuations; built once per family."""
    if family not in _CASES:
        path = save_checkpoint(family, tmp_path_factory.mktemp(family))
        model = build_model(family)
        rng = np.random.default_rng(5)
        system = rng.integers(3, 512, size=40).tolist()
        prompts = [rng.integers(3, 512, size=n).tolist() for n in (5, 17, 33)]
        prompts += [system + rng.integers(3, 512, size=n).tolist() for n in (3, 9)]
        references = []
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(NEW_TOKENS):
                seq.append(int(np.argmax(hf_logits(model, seq)[-1])))
            references.append(tuple(seq[len(prompt):]))
        _CASES[family] = (family, path, prompts, references)
    return _CASES[family]


LAYOUTS = {
    "eager": dict(kvcache_num_blocks=B + 1),                        # the B+1 rule
    "flash": dict(kvcache_block_size=32, kvcache_num_blocks=B * 4 + 1),
}
