"""The steering plane's caches. A decode step's rows come from what earlier steps resolved (each
request's row holds over a span of positions), and must equal what resolving every token's
selections from scratch gives, whatever happens between steps: windows and position lists
crossed, token selections, requests finishing, joining, reordered, preempted or prefilled one
token at a time, prompts grown by streaming input. Freed table rows are cleared lazily. A parse
checks a vector or selection given for many layers once, with the same interventions as one by one."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from steerable import LLM, Add, Clamp, SamplingParams, SelectSpec, SteeringSpec
from steerable.request import Request, ScheduledRequest
from steerable.steering.manager import SteeringManager
from steerable.steering.rows import RowTables
from steerable.steering.spec import SpecParser

H, LAYERS = 8, 4


def _vec(seed: int) -> list[float]:
    return torch.randn(H, generator=torch.Generator().manual_seed(seed)).tolist()


SELECTS = [None, SelectSpec(generation_window=(0, 3)), SelectSpec(generation_positions=[1, 4, 5]),
           SelectSpec(generation_tokens=[3, 5, 7]), SelectSpec(prompt="all"), SelectSpec(generation="all"),
           SelectSpec(generation_window=(2, None), exclude_generation_positions=[6])]


def _request(i: int, prompt_len: int, add: SelectSpec | None, clamp: SelectSpec | None,
             steered: bool = True) -> Request:
    """Request ``i`` with an add selected by ``add`` and a clamp at another site selected by
    ``clamp``, or unsteered."""
    steering = SteeringSpec(interventions=[Add(i % LAYERS, _vec(i), select=add),
                                           Clamp(1, _vec(100 + i), hook="pre_attn", max=0.0, select=clamp)])
    return Request(f"r{i}", f"c{i}", None, list(range(10, 10 + prompt_len)),
                   SamplingParams(steering_vectors=steering if steered else None), 0, [])


def _expected(request: Request, position: int, token: int) -> tuple[bytes, int] | None:
    """(config, pattern) a token's row must hold, from its selections alone; None: row 0."""
    state = request.steering
    if state is None:
        return None
    config = state.config
    pattern = 0
    for bit, select in enumerate(config.selects):
        if select.mask(torch.tensor([position]), request.num_prompt_tokens, torch.tensor([token]))[0]:
            pattern |= 1 << bit
    return (config.identity, pattern) if config.active(pattern) else None


def _step(manager: SteeringManager, chunks: list[tuple[Request, list[int], list[int]]]) -> None:
    """Plan one step of (request, positions, token ids) chunks and check every token's row."""
    scheduled = [ScheduledRequest(r, len(pos), True) for r, pos, _ in chunks]
    positions = np.array([p for _, pos, _ in chunks for p in pos], dtype=np.int64)
    tokens = np.array([t for _, _, tok in chunks for t in tok], dtype=np.int64)
    query_start = np.concatenate([[0], np.cumsum([len(pos) for _, pos, _ in chunks])]).astype(np.int64)
    plan = manager.plan(scheduled, positions, tokens, query_start)
    index = plan.index if plan is not None else np.zeros(len(positions), dtype=np.int64)
    k = 0
    for request, pos, tok in chunks:
        for p, t in zip(pos, tok):
            want = _expected(request, p, t)
            got = None if index[k] == 0 else manager.row_owner[int(index[k])]
            assert got == want, (request.request_id, p, t)
            k += 1


@pytest.mark.parametrize("seed", range(6))
def test_decode_rows_equal_resolving_every_selection(seed):
    rng = random.Random(seed)
    manager = SteeringManager(H, LAYERS, max_num_seqs=8)
    made = 0

    def new() -> list:
        """A request admitted and prefilled: [request, next position]."""
        nonlocal made
        request = _request(made, rng.randrange(1, 6), rng.choice(SELECTS), rng.choice(SELECTS), rng.random() < 0.9)
        made += 1
        manager.admit(request)
        P = request.num_prompt_tokens
        _step(manager, [(request, list(range(P)), [rng.randrange(10) for _ in range(P)])])
        return [request, P]

    batch = [new() for _ in range(8)]
    for _ in range(40):
        event = rng.random()
        if event < 0.1 and batch:  # a request finishes
            manager.release(batch.pop(rng.randrange(len(batch)))[0])
        elif event < 0.2:  # one joins
            batch.append(new())
        elif event < 0.25:  # the batch is reordered
            rng.shuffle(batch)
        elif event < 0.3 and batch:  # preempted: prompt and generated rows prefilled again
            entry = rng.choice(batch)
            _step(manager, [(entry[0], list(range(entry[1])), [rng.randrange(10) for _ in range(entry[1])])])
        chunks = []
        for entry in batch:
            request, position = entry
            if rng.random() < 0.1 and position > 0:  # the last prompt rows prefilled one by one
                position = rng.randrange(position)
            chunks.append((request, [position], [rng.randrange(10)]))
            entry[1] = max(entry[1], position + 1)
        if chunks:
            _step(manager, chunks)
    for request, _ in batch:
        manager.release(request)
    assert not manager.row_refs and not manager.configs and not manager.reads_generated_tokens()
    assert manager.spans.live == 0


def test_a_repeated_decode_batch_resolves_only_requests_leaving_their_span():
    manager = SteeringManager(H, LAYERS)
    requests = [_request(0, 3, None, None), _request(1, 3, SELECTS[1], None),
                _request(2, 3, SELECTS[4], SELECTS[5]), _request(3, 3, None, None, steered=False)]
    for request in requests:
        manager.admit(request)
    resolved = []
    rows_for = manager._rows_for
    manager._rows_for = lambda request, *args: resolved.append(request.request_id) or rows_for(request, *args)
    for position in range(3, 12):
        resolved.clear()
        _step(manager, [(r, [position], [0]) for r in requests])
        if position == 3:
            assert resolved == ["r0", "r1", "r2"]
        elif position == 6:  # r1's window (0, 3) closes
            assert resolved == ["r1"]
        else:
            assert resolved == []


def test_reads_generated_tokens_follows_live_configs():
    manager = SteeringManager(H, LAYERS)
    reader, other = _request(0, 2, SELECTS[3], None), _request(1, 2, SELECTS[1], None)
    for request in (reader, other):
        manager.admit(request)
    assert manager.reads_generated_tokens()
    sibling = _request(2, 2, None, None, steered=False)
    manager.share(sibling, reader)
    manager.release(reader)
    assert manager.reads_generated_tokens()  # the sibling still holds the config
    manager.release(sibling)
    assert not manager.reads_generated_tokens()


def test_a_freed_row_sends_nothing_and_its_reuse_clears_what_it_left():
    parser, tables = SpecParser(H, LAYERS), RowTables(4, H)
    tables.write(1, parser.parse({"post_mlp": {0: [1.0] * H}, "pre_attn": {2: [2.0] * H}}, "s"))
    tables.take_update()
    tables.clear(1)
    assert tables.take_update() is None
    tables.write(1, parser.parse({"pre_attn": {2: [3.0] * H}}, "s"))
    update = tables.take_update()
    writes = {write.site: write for write in update.writes}
    assert set(writes) == {("post_mlp", 0), ("pre_attn", 2)} and {w.table for w in update.writes} == {"add"}
    assert update.rows(writes[("post_mlp", 0)]).tolist() == [1]
    assert update.vectors(writes[("post_mlp", 0)]).tolist() == [[0.0] * H]
    assert update.vectors(writes[("pre_attn", 2)]).tolist() == [[3.0] * H]


def test_a_parse_checks_each_vector_and_selection_once_with_the_same_interventions():
    parser = SpecParser(H, LAYERS)
    directions = torch.randn(2, H, generator=torch.Generator().manual_seed(4)) * 3
    vector = _vec(5)  # a list: known by identity
    spec = SteeringSpec(interventions=[
        *[Clamp(layer, directions[0], min=-1.0, max=1.0, select=SelectSpec(generation="all")) for layer in range(LAYERS)],
        *[Add(layer, vector, hook="pre_attn", select=SelectSpec(generation="all")) for layer in range(LAYERS)],
        Clamp(0, directions[1], hook="post_attn", max=0.0, select="all_prompt")])
    items = parser.parse(spec, "s")
    assert len({id(item.vector) for item in items[:LAYERS]}) == 1  # one unit direction for every layer
    assert len({id(item.select) for item in items[:2 * LAYERS]}) == 1  # equal selections: one object
    for item, given in zip(items, spec.interventions):
        alone = parser.parse([given], "s")[0]
        assert item.digest == alone.digest and item.select == alone.select and torch.equal(item.vector, alone.vector)
    with pytest.raises(ValueError, match="direction"):
        parser.parse([Clamp(0, [0.0] * H), Clamp(1, [0.0] * H)], "s")


def test_a_streaming_input_chunk_counts_its_window_from_its_own_prompt(model_dirs):
    """Decode rows resolved under the first chunk's prompt length must not carry over once the
    prompt grows: the second chunk's window (0, 2) steers its own first two generated rows."""
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096)
    engine = llm.llm_engine
    v = _vec(3) * 8  # the model's hidden size is 64

    def params(select: SelectSpec) -> SamplingParams:
        return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                              steering_vectors=SteeringSpec(interventions=[Add(1, v, select=select)]))

    def oracle(prompt: list[int], select: SelectSpec) -> list[int]:
        return llm.generate([prompt], params(select), use_tqdm=False)[0].outputs[0].token_ids

    window = SelectSpec(generation_window=(0, 2))
    first, extra = [5, 6, 7, 8], [9, 10, 11]
    prompt2 = first + oracle(first, window)[:-1] + extra
    # The first chunk steered its first two generated rows, prompt rows (4 and 5) of the second.
    gen2 = oracle(prompt2, SelectSpec(positions=[4, 5], generation_window=(0, 2)))
    assert gen2 != oracle(prompt2, SelectSpec(positions=[4, 5]))
    engine.add_request("grow", first, params(window), resumable=True)
    engine.extend_request("grow", extra)
    engine.close_request_input("grow")
    final = None
    while engine.has_unfinished_requests():
        final = next((out for out in engine.step() if out.finished), final)
    assert final.prompt_token_ids == prompt2 and final.outputs[0].token_ids == gen2
