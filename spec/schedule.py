"""Per-batch-size number of speculative tokens, with the semantics of vLLM's dynamic speculative decoding.

`num_speculative_tokens_per_batch_size` is a list of inclusive ranges `(range_start, range_end, K)`
(vLLM PR #32374): the first range starts at batch size 1; bounds are positive and ranges are non-overlapping
(they are sorted on input); K >= 0, and K = 0 means no speculation at those batch sizes. A batch size in a gap
between ranges carries the previous range's K forward; batch sizes past the last range carry the last K.
The effective K is min(num_speculative_tokens, K). Under these rules the K of batch size b is that of the last
range starting at or below b, so the ranges are parsed once into their starts and K: a range ending near 10**9
costs no memory.
"""

import bisect

from spec.checks import is_int

FIELD = "num_speculative_tokens_per_batch_size"


def validate_ranges(ranges) -> list[tuple[int, int, int]]:
    """The ranges as sorted (start, end, k) tuples; ValueError naming the rule that a range breaks."""
    if not isinstance(ranges, (list, tuple)):
        raise ValueError(f"{FIELD}={ranges!r}: expected a list of [range_start, range_end, K] entries, e.g. "
                         "[[1, 8, 4], [9, 64, 1]]")
    if not ranges:
        raise ValueError(f"{FIELD}={ranges!r}: must not be empty (as in vLLM); give [range_start, range_end, K] "
                         "entries, or leave the key out (None) for num_speculative_tokens at every batch size")
    parsed = sorted(_parse_entry(entry) for entry in ranges)
    if parsed[0][0] != 1:
        raise ValueError(f"{FIELD}: the first range starts at {parsed[0][0]}; it must start at batch size 1, "
                         f"e.g. [1, {parsed[0][1]}, {parsed[0][2]}]")
    for (start, end, _), (next_start, next_end, _) in zip(parsed, parsed[1:]):
        if next_start <= end:
            raise ValueError(f"{FIELD}: ranges [{start}, {end}] and [{next_start}, {next_end}] overlap; "
                             "make each range start after the previous one ends")
    return parsed


def _parse_entry(entry) -> tuple[int, int, int]:
    if not isinstance(entry, (list, tuple)) or len(entry) != 3:
        raise ValueError(f"{FIELD}: entry {entry!r} is not [range_start, range_end, K]; give three integers")
    if not all(is_int(x) for x in entry):
        raise ValueError(f"{FIELD}: entry {list(entry)!r} must hold integers (not bools or floats)")
    start, end, k = entry
    if start < 1 or end < 1:
        raise ValueError(f"{FIELD}: entry {list(entry)!r} has a non-positive bound; batch sizes start at 1")
    if start > end:
        raise ValueError(f"{FIELD}: entry {list(entry)!r} starts after it ends; write [{end}, {start}, {k}]")
    if k < 0:
        raise ValueError(f"{FIELD}: entry {list(entry)!r} has K={k}; K must be >= 0 (0 turns speculation off)")
    return start, end, k


class BatchSizeSchedule:
    """Batch size -> K built once from the ranges: `starts` (sorted) and the effective K from each start on;
    `k_for_batch_size` is a binary search over them (O(log num_ranges))."""

    def __init__(self, ranges, num_speculative_tokens: int):
        self.ranges = validate_ranges(ranges)
        self.starts = [start for start, _, _ in self.ranges]
        self.ks = [min(k, num_speculative_tokens) for _, _, k in self.ranges]

    def k_for_batch_size(self, batch_size: int) -> int:
        if batch_size < 0:
            raise ValueError(f"batch_size={batch_size}: must be >= 0")
        if batch_size == 0:
            return 0  # batch size 0 runs nothing
        return self.ks[bisect.bisect_right(self.starts, batch_size) - 1]  # gaps and the tail carry the last K
