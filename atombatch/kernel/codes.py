"""The numbers both block/lane cores share (the compiled `_blocks` and its twin `_blocks_py`): block
ownership states, lane states, what a decode step did to a row and what a lane wants from the
kernel, and the check of compiled decode batch sizes. Defined here once; the compiled core mirrors
the states in a C enum and checks it against these at import."""

from __future__ import annotations

from collections.abc import Sequence

from atombatch.errors import ConfigError

FREE = 0
SPARE = 1
STAGED = 2
LANE = 3
CACHED = 4
STATE_NAMES = ("FREE", "SPARE", "STAGED", "LANE", "CACHED")

LANE_IDLE = 0
LANE_PREFILLING = 1
LANE_DECODING = 2
LANE_STATE_NAMES = ("IDLE", "PREFILLING", "DECODING")

MAX_TABLE_BLOCK = 32767  # block tables are int16 on the device: a larger id cannot be addressed

# What a decode step did to a row (`StepKernel.status`).
ROW_OK = 0          # token appended; the lane decodes on
ROW_SAMPLE = 1      # the lane's request samples: the caller writes the row's token
ROW_NONFINITE = 2   # a NaN or infinite logit: the caller fails the request
ROW_STOP = 3        # the token is one of the lane's stop ids: finish "stop"
ROW_LENGTH = 4      # the output reached its limit: finish "length"
ROW_CHECK = 5       # the caller checks the stop condition (more stop ids than the kernel holds)
ROW_SKIPPED = 6     # the lane stopped decoding during the step (its request failed)
ROW_STATUS_NAMES = ("OK", "SAMPLE", "NONFINITE", "STOP", "LENGTH", "CHECK", "SKIPPED")

# What a lane's request wants from the kernel (`StepKernel.bind` flags).
LANE_SAMPLE = 1       # sampled by the caller (temperature, penalties, ...), not greedy
LANE_OWN_OUTPUT = 2   # the caller builds its outputs (text, logprobs, n > 1 choices)
LANE_STOPCHECK = 4    # set by `bind` when the stop ids do not fit the kernel's per-lane array
MAX_STOP_IDS = 16     # stop ids held per lane (EOS ids plus `stop_token_ids`)


def check_buckets(batch_size: int, buckets: Sequence[int] | None) -> tuple[int, ...]:
    """The compiled decode batch sizes, validated: ascending, unique, 1..B, B among them."""
    if buckets is None:
        return (batch_size,)
    sizes = tuple(buckets)
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) for b in sizes):
        raise ConfigError(f"decoder_batch_sizes={sizes!r} must be a non-empty tuple of ints")
    if list(sizes) != sorted(set(sizes)):
        raise ConfigError(f"decoder_batch_sizes={sizes!r} must be strictly ascending")
    if sizes[0] < 1 or sizes[-1] != batch_size:
        raise ConfigError(f"decoder_batch_sizes={sizes!r} must lie in 1..batch_size={batch_size} "
                          "and include batch_size")
    return sizes
