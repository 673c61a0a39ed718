"""Faults injected into the grammar library, as a grammar worker's check function
(`GrammarWorkers(target="support.grammar_faults:check")`, `create_app(grammar_check=...)`).

A constraint whose text holds one of the markers below makes the worker misbehave the way a
native library can; any other is checked for real (`atombatch.sampling.grammar_check.check_in_worker`).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import msgspec

from atombatch.api.structured import StructuredOutput
from atombatch.sampling.grammar_check import check_in_worker

CRASH = "FAULT_CRASH"      # the worker dies of SIGSEGV, as on a native stack overflow
HANG = "FAULT_HANG"        # the worker never answers (a library stuck in a loop)
HOG = "FAULT_HOG"          # the worker allocates until its memory limit stops it
SPIN = "FAULT_SPIN"        # the worker computes forever (CPU time runs out)
SLOW = "FAULT_SLOW"        # the worker waits 2 s (no CPU), then checks for real


def check(tokenizer: Any, structured: StructuredOutput, vocab_size: int) -> str:
    text = structured.value + "".join(structured.choices)
    if CRASH in text:  # a real fault (a signal sent with kill may be blocked; a fault is not)
        import ctypes

        ctypes.string_at(0)
        os.kill(os.getpid(), signal.SIGKILL)  # (never reached)
    if HANG in text:
        while True:
            time.sleep(1)
    if SPIN in text:
        while True:
            pass
    if SLOW in text:
        time.sleep(2.0)
        structured = msgspec.structs.replace(structured, value=structured.value.replace(SLOW, ""))
    if HOG in text:
        hoard = []
        while True:  # 256 MiB at a time (calloc'd: fast) until the address-space limit refuses one
            hoard.append(bytes(256 << 20))
    return check_in_worker(tokenizer, structured, vocab_size)
