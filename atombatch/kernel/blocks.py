"""The one place that picks the block/lane core: the compiled `_blocks` or its pure-Python twin.

`ATOMBATCH_NO_EXTENSIONS=1` forces the twin; so does a missing or broken extension.
"""

from __future__ import annotations

import os

NO_EXTENSIONS = bool(os.environ.get("ATOMBATCH_NO_EXTENSIONS"))

if NO_EXTENSIONS:
    from atombatch.kernel import _blocks_py as _impl
else:
    try:
        from atombatch.kernel import _blocks as _impl  # type: ignore[attr-defined,no-redef]
    except ImportError:  # pragma: no cover - exercised by installs without a compiler
        from atombatch.kernel import _blocks_py as _impl  # type: ignore[no-redef]

BlockPool = _impl.BlockPool
LaneTable = _impl.LaneTable
SlidingSlots = _impl.SlidingSlots
DecodeInputs = _impl.DecodeInputs
PrefillInputs = _impl.PrefillInputs
StepKernel = _impl.StepKernel
block_digests = _impl.block_digests  # a prompt's full-block prefix digests in one call
chain_digests = _impl.chain_digests  # the same, written into a chain's digest array
PrefixTable = _impl.PrefixTable      # the device prefix index's blocks, in arrays
common_prefix = _impl.common_prefix  # leading tokens two int64 arrays share
match_digests = _impl.match_digests  # the run of a chain's digests a dict holds
argmax_call = _impl.argmax_call      # the same on a decode call's result, when it can
argmax_rows = _impl.argmax_rows      # numpy's argmax of every row (and its logit), compiled
picked_logits = _impl.picked_logits  # the logit each row's token picked, in one call
gather_tokens = _impl.gather_tokens  # one step's tokens into the next step's input ids
IMPLEMENTATION: str = _impl.IMPLEMENTATION

from atombatch.kernel.codes import (  # noqa: E402  (constants are shared by both implementations)
    CACHED,
    FREE,
    LANE,
    LANE_DECODING,
    LANE_IDLE,
    LANE_OWN_OUTPUT,
    LANE_PREFILLING,
    LANE_SAMPLE,
    LANE_STATE_NAMES,
    LANE_STOPCHECK,
    ROW_CHECK,
    ROW_LENGTH,
    ROW_NONFINITE,
    ROW_OK,
    ROW_SAMPLE,
    ROW_SKIPPED,
    ROW_STATUS_NAMES,
    ROW_STOP,
    SPARE,
    STAGED,
    STATE_NAMES,
)

__all__ = [
    "CACHED",
    "FREE",
    "IMPLEMENTATION",
    "LANE",
    "LANE_DECODING",
    "LANE_IDLE",
    "LANE_OWN_OUTPUT",
    "LANE_PREFILLING",
    "LANE_SAMPLE",
    "LANE_STATE_NAMES",
    "LANE_STOPCHECK",
    "ROW_CHECK",
    "ROW_LENGTH",
    "ROW_NONFINITE",
    "ROW_OK",
    "ROW_SAMPLE",
    "ROW_SKIPPED",
    "ROW_STATUS_NAMES",
    "ROW_STOP",
    "SPARE",
    "STAGED",
    "STATE_NAMES",
    "BlockPool",
    "DecodeInputs",
    "LaneTable",
    "PrefillInputs",
    "PrefixTable",
    "SlidingSlots",
    "StepKernel",
    "argmax_call",
    "argmax_rows",
    "block_digests",
    "chain_digests",
    "common_prefix",
    "gather_tokens",
    "match_digests",
    "picked_logits",
]
