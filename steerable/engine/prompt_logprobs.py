"""Prompt logprobs on the driver side: which rows of a step must report them, and the reports
turned into each request's ``prompt_logprobs`` (vLLM's shape: per prompt token a dict of
``Logprob`` for the token itself and the k most likely, None for the first token).

Rows are asked for in prompt order; a prefill recomputed after a preemption asks again for rows
already recorded, and those reports are skipped.
"""

from __future__ import annotations

import numpy as np

from steerable.engine.tokenizer import Tokenizer
from steerable.outputs import Logprob
from steerable.request import Request, ScheduledRequest
from steerable.step import PromptLogprobsInput


def plan(scheduled: list[ScheduledRequest], query_start: np.ndarray, wanted: set[str]) -> list[PromptLogprobsInput]:
    """Entries for the scheduled requests in ``wanted`` whose chunk covers prompt positions that
    predict a prompt token (every position but the last prompt one); call before the step advances."""
    entries = []
    for i, item in enumerate(scheduled):
        request = item.request
        if request.request_id not in wanted:
            continue
        start = request.num_computed_tokens
        first = max(start, len(request.prompt_logprobs) - 1)
        end = min(start + item.num_tokens, request.num_prompt_tokens - 1)
        if first >= end:
            continue
        row = int(query_start[i]) - start
        entries.append(PromptLogprobsInput(i, first, np.arange(row + first, row + end, dtype=np.int64),
                                           np.array(request.prompt_token_ids[first + 1:end + 1], dtype=np.int64),
                                           request.params.prompt_logprobs))
    return entries


def record(request: Request, entry: PromptLogprobsInput, result: list[np.ndarray], tokenizer: Tokenizer) -> bool:
    """Append a report's rows not recorded yet; True once every prompt token has its entry."""
    chosen, ranks, top_ids, top_values = (a.tolist() for a in result)
    recorded = request.prompt_logprobs
    text = tokenizer.token_text
    for r in range(len(recorded) - 1 - entry.position, len(chosen)):
        target = int(entry.targets[r])
        logprobs = {target: Logprob(chosen[r], ranks[r], text(target))}
        for rank, (token, value) in enumerate(zip(top_ids[r], top_values[r]), start=1):
            logprobs.setdefault(token, Logprob(value, rank, text(token)))
        recorded.append(logprobs)
    return len(recorded) >= request.num_prompt_tokens
