"""The README's examples run as written: the embedding example, its inline runtime swaps, the
serving block in a shell; the quick start is what CI runs."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.served import free_port

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_embedding_example_runs(capsys):
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    example = blocks[0]
    assert len(example.strip().splitlines()) <= 12
    exec(compile(example, str(README), "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].endswith("length")
    assert len(lines) == 8  # one streamed output per generated token


def test_readme_quick_start_is_two_commands_and_ci_runs_the_second():
    text = README.read_text()
    quick = re.search(r"## Quick start.*?```bash\n(.*?)```", text, flags=re.S).group(1)
    commands = [line for line in quick.strip().splitlines() if line.strip()]
    assert len(commands) == 2 and "python -m atombatch.bench" in commands[0]
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci


def inline_code(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


@pytest.mark.numerics
def test_readme_runtime_swaps_run_as_written(tmp_path: Path, capsys: Any) -> None:
    """The embedding section's inline swaps: a Hugging Face checkpoint's runtime, with its default
    artifact and with `artifact=` built from its own spec (the README elides the shape fields,
    filled here), and the asyncio form, on a tiny checkpoint saved here."""
    from support.hf_models import save_checkpoint

    from atombatch import ArtifactConfig, AsyncBatcher, Batcher, ModelSpec, SamplingParams
    from atombatch.runtime import NumpyRuntime

    section = README.read_text().split("## Embedding", 1)[1].split("\n## ", 1)[0]
    spans = inline_code(section)
    default = next(s for s in spans if s.startswith("NumpyRuntime.from_pretrained("))
    sized = next(s for s in spans if s.startswith("artifact=ArtifactConfig(model=ModelSpec"))
    streamed = next(s for s in spans if s.startswith("async with AsyncBatcher("))
    assert sized.endswith(", ...)")
    shapes = "batch_size=2, max_seq_len=128, block_size=128, num_blocks=3, prefill_chunk_size=32"
    names = {"checkpoint_dir": save_checkpoint("qwen3", tmp_path / "ckpt"),
             "ArtifactConfig": ArtifactConfig, "ModelSpec": ModelSpec,
             "NumpyRuntime": NumpyRuntime}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = []
    for call in (default, default[:-1] + ", " + sized[:-len("...)")] + shapes + "))"):
        runtime = eval(call, names)
        outputs.append(Batcher(runtime).generate([[5, 6, 7]], params)[0].token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4
    assert runtime.artifact.batch_size == 2

    # one line in the prose: the `async with` and its `async for` on lines of their own
    outer, inner = streamed.removesuffix(" ...").split(": ", 1)
    code = f"async def main(batcher, prompt, params):\n    {outer}:\n        {inner}\n" \
           "            print(out)\n"
    scope = {"AsyncBatcher": AsyncBatcher}
    exec(code, scope)
    asyncio.run(scope["main"](Batcher(runtime), [5, 6, 7], params))
    streamed_ids = [int(t) for line in capsys.readouterr().out.splitlines()
                    for t in re.findall(r"new_token_ids=\((\d+),?\)", line)]
    assert streamed_ids == list(outputs[0])


def test_readme_serving_block_runs_as_written(tmp_path: Path) -> None:
    """The "Serving over HTTP" block pasted into a shell (its install line aside; another port):
    the server answers once it is up, the stream ends, the metrics name the lanes."""
    section = README.read_text().split("## Serving over HTTP", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = [line for line in block.splitlines() if not line.startswith("pip install")]
    port = str(free_port())
    script = "\n".join(lines).replace("8000", port).replace("python -m", f"{sys.executable} -m")
    script = f"set -e\ntrap 'kill $(jobs -p) 2>/dev/null' EXIT\n{script}\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert '{"status":"ok"}' in out.stdout.replace(" ", "")
    assert "data: [DONE]" in out.stdout
    assert re.search(r"^atombatch_occupied_lanes \d", out.stdout, flags=re.M), out.stdout
