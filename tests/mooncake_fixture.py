"""A hand-made Mooncake-shaped trace (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks) whose prefix reuse is
worked out by hand, for the prefix-sharing tests of the simulator and of vLLM
virtual time. Requests are 20 s apart, so each one has finished (and its
blocks are cached) before the next arrives; nothing is evicted.

:data:`CACHED` is each request's cached prompt tokens on an engine with
16-token blocks: the whole blocks of its longest hash-list prefix an earlier
request also had, inside both requests' hashed tokens, and at most
``(prompt - 1) // 16`` blocks (the last prompt token is always computed).
"""

from __future__ import annotations

import json
from pathlib import Path

BLOCK_SIZE = 16
#: (input_length, output_length, hash_ids), 20 s apart.
ROWS: tuple[tuple[int, int, list[int]], ...] = (
    (1536, 4, [1, 2, 3]),   # first: nothing cached
    (1536, 4, [1, 2, 4]),   # shares [1, 2]: 1024 tokens
    (1000, 4, [1, 2]),      # hashed 1000 tokens, all in [1, 2]: 62 whole blocks = 992
    (2048, 4, [5, 6, 7, 8]),  # new ids: 0
    (1536, 4, [1, 2, 3]),   # the first request again: 96 blocks, the last prompt token computed: 95 = 1520
    (600, 4, [9]),          # new; 88 tokens past its one hash are its own: 0
    (700, 4, [9]),          # shares [9]: 512 (its tokens past 512 are its own)
    (1024, 4, [6, 5]),      # ids seen before, but not as a prefix: 0
)
CACHED = (0, 1024, 992, 0, 1520, 0, 512, 0)
PROMPT_TOKENS = sum(r[0] for r in ROWS)  # 9980
HIT_RATE = sum(CACHED) / PROMPT_TOKENS  # 4048 / 9980
GAP_S = 20.0


def write(path: Path) -> Path:
    lines = [json.dumps({"timestamp": int(k * GAP_S * 1000), "input_length": p, "output_length": o, "hash_ids": h})
             for k, (p, o, h) in enumerate(ROWS)]
    path.write_text("\n".join(lines) + "\n")
    return path
