"""Record what optimum-rbln's own LoRA config classes write, for the emulated device's fixtures.

optimum-rbln cannot be installed next to atombatch (it pins torch builds and needs rebel-sdk), but
its configuration classes run from the unpacked wheel. This script builds `RBLNLoRAConfig`s for a
few fixed cases (PEFT adapter directories made in a temporary directory) and writes what
`RBLNLlamaForCausalLMConfig(lora_config=...)` serializes, plus which inputs the classes refuse, to
`tests/fakerebel/optimum_lora.json`. `tests/config/test_rbln_lora_config.py` holds the fixture
compiler (`tests/fakerebel/compiler.py`) and atombatch's reader to it.

    pip download --no-deps -d /tmp/orbln 'optimum-rbln==0.12.*'
    cd /tmp/orbln && python -m zipfile -e optimum_rbln-0.12.0-py3-none-any.whl src
    PYTHONPATH=/tmp/orbln/src:tests/fakerebel python tools/optimum_lora_record.py

(`tests/fakerebel` stands in for the `rebel` module optimum-rbln imports at package import.)
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "tests" / "fakerebel" / "optimum_lora.json"

# adapter directories: name -> adapter_config.json (the weights file only has to exist)
ADAPTERS = {
    "sql": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
            "bias": "none", "use_rslora": False, "peft_type": "LORA"},
    "chat": {"r": 2, "lora_alpha": 16.0, "target_modules": ["k_proj", "o_proj", "gate_proj",
                                                            "up_proj"],
             "bias": "none", "use_rslora": True, "peft_type": "LORA"},
}

# (case name, adapters as passed to RBLNLoRAConfig, max_lora_rank); "{dir}" is the adapters' root
ACCEPTED = [
    ("defaults", [{"lora_int_id": 1, "lora_name": "sql", "lora_path": "{dir}/sql"},
                  {"lora_int_id": 2, "lora_name": "chat", "lora_path": "{dir}/chat"}], None),
    ("fields_given", [{"lora_int_id": 2, "lora_name": "sql", "lora_path": "{dir}/sql", "r": 8,
                       "scaling_factor": 0.5},
                      {"lora_int_id": 1, "lora_name": "chat", "lora_path": "{dir}/chat",
                       "target_modules": ["q_proj"], "lora_alpha": 3}], 16),
]
REFUSED = [
    ("id_zero", [{"lora_int_id": 0, "lora_name": "sql", "lora_path": "{dir}/sql"}], None),
    ("ids_not_contiguous", [{"lora_int_id": 1, "lora_name": "sql", "lora_path": "{dir}/sql"},
                            {"lora_int_id": 3, "lora_name": "chat", "lora_path": "{dir}/chat"}],
     None),
    ("ids_twice", [{"lora_int_id": 1, "lora_name": "sql", "lora_path": "{dir}/sql"},
                   {"lora_int_id": 1, "lora_name": "chat", "lora_path": "{dir}/chat"}], None),
    ("rank_above_max", [{"lora_int_id": 1, "lora_name": "sql", "lora_path": "{dir}/sql"}], 2),
    ("bias_all", [{"lora_int_id": 1, "lora_name": "sql", "lora_path": "{dir}/sql",
                   "bias": "all"}], None),
    ("rank_zero", [{"lora_int_id": 1, "lora_name": "sql", "lora_path": "{dir}/sql", "r": 0}],
     None),
    ("alpha_negative", [{"lora_int_id": 1, "lora_name": "sql", "lora_path": "{dir}/sql",
                         "lora_alpha": -1.0}], None),
    ("no_adapters", [], None),
]


def _fill(adapters: list[dict[str, Any]], root: str) -> list[dict[str, Any]]:
    return [{k: (v.replace("{dir}", root) if isinstance(v, str) else v) for k, v in a.items()}
            for a in adapters]


def main() -> None:
    warnings.simplefilter("ignore")
    from optimum.rbln import RBLNLlamaForCausalLMConfig
    from optimum.rbln.__version__ import __version__
    from optimum.rbln.transformers.models.decoderonly.configuration_lora import RBLNLoRAConfig

    record: dict[str, Any] = {"optimum_rbln_version": __version__, "adapter_configs": ADAPTERS,
                              "accepted": {}, "refused": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in ADAPTERS.items():
            (Path(tmp) / name).mkdir()
            (Path(tmp) / name / "adapter_config.json").write_text(json.dumps(config))
            (Path(tmp) / name / "adapter_model.safetensors").write_bytes(b"")
        for case, adapters, max_rank in ACCEPTED:
            lora = RBLNLoRAConfig(adapters=_fill(adapters, tmp), max_lora_rank=max_rank)
            full = RBLNLlamaForCausalLMConfig(lora_config=lora, batch_size=2, max_seq_len=128,
                                              kvcache_num_blocks=3)
            written = json.loads(json.dumps(full._prepare_for_serialization(), default=str))
            text = json.dumps(written["lora_config"]).replace(tmp, "{dir}")
            record["accepted"][case] = {"adapters": adapters, "max_lora_rank": max_rank,
                                        "lora_config": json.loads(text)}
        for case, adapters, max_rank in REFUSED:
            try:
                RBLNLoRAConfig(adapters=_fill(adapters, tmp), max_lora_rank=max_rank)
            except (ValueError, NotImplementedError) as exc:
                record["refused"][case] = {"adapters": adapters, "max_lora_rank": max_rank,
                                           "error": type(exc).__name__}
            else:
                sys.exit(f"optimum-rbln accepted case {case!r}: update REFUSED")
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
