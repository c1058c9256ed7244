"""``When`` gates on the driver: which gates a composed config has, and the table rows they switch
between.

A gate is decided on the device, inside the forward, so the driver prepares every outcome: for
each selection pattern of a config, one row per combination of its gates' outcomes (``2^n`` rows
for ``n`` gates), each holding the items active under that combination. A token starts on the row
with every gate off; at a gate's hook point the row holds the gate's slot (what to read, how to
compare, the mode below) and the rows to move to for each outcome of the gates there, and the
token continues on the row its outcomes chose (``steering.edit_tables``).

A ``scope="prompt"`` gate decides once per request: its rows tell the device what each row does
by its role in the request (``ROLE_SELECTS``), the first prompt row resetting the request's sum,
every prompt row adding to it, the last one deciding, and generated rows applying the decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from steerable.errors import InvalidRequestError
from steerable.selection import SelectSpec
from steerable.steering.edits import Gate
from steerable.steering.spec import Intervention
from steerable.step import Site

# The roles of a row in a request with a prompt-scope gate: the first prompt row, the last one,
# and rows whose input is a generated token.
ROLE_SELECTS = (SelectSpec(prompt_positions=[0]), SelectSpec(prompt_positions=[-1]), SelectSpec(generation="all"))
# Gate slot modes (bits): per-row gate; reset the request's sum; add the row's value to it;
# decide from the mean; apply the decision.
TOKEN, RESET, ACCUMULATE, DECIDE, APPLY = 1, 2, 4, 8, 16
MAX_GATES = 6  # distinct gates per config: 2^6 rows per selection pattern

GateSlots = tuple[Site, list[tuple[Gate, int]], list[int]]  # (site, (gate, mode) per slot, row per outcome code)


@dataclass
class ConfigGates:
    gates: list[Gate]  # distinct gates, by digest, in the order the config gives them
    gate_of: list[int]  # per intervention: the index of its gate, or -1
    roles: tuple[int, int, int] | None  # selection bits of ROLE_SELECTS, when a gate has scope "prompt"

    def by_site(self) -> dict[Site, list[int]]:
        sites: dict[Site, list[int]] = {}
        for g, gate in enumerate(self.gates):
            sites.setdefault(gate.site, []).append(g)
        return sites


def config_gates(items: Sequence[Intervention], selects: list[SelectSpec]) -> ConfigGates | None:
    """The gates of a config's items (None: it has none); adds the role selections to
    ``selects`` when a gate decides over the prompt."""
    index: dict[bytes, int] = {}
    gates: list[Gate] = []
    gate_of = []
    for item in items:
        gate = item.gate
        if gate is None:
            gate_of.append(-1)
            continue
        if gate.digest not in index:
            index[gate.digest] = len(gates)
            gates.append(gate)
        gate_of.append(index[gate.digest])
    if not gates:
        return None
    if len(gates) > MAX_GATES:
        raise InvalidRequestError(f"steering_vectors: {len(gates)} distinct When gates in one request's steering; "
                                  f"at most {MAX_GATES}")
    roles = None
    if any(gate.scope == "prompt" for gate in gates):
        for select in ROLE_SELECTS:
            if select not in selects:
                selects.append(select)
        roles = tuple(selects.index(select) for select in ROLE_SELECTS)
    return ConfigGates(gates, gate_of, roles)


def slot_mode(gate: Gate, pattern: int, roles: tuple[int, int, int] | None) -> int:
    """What a gate slot does on a row of selection ``pattern``."""
    if gate.scope == "token":
        return TOKEN
    first, last, generated = (pattern >> bit & 1 for bit in roles)
    if generated:
        return APPLY
    return ACCUMULATE | (RESET if first else 0) | (DECIDE if last else 0)


def gate_slots(gating: ConfigGates, pattern: int, bits: int, row_of: Callable[[int], int]) -> list[GateSlots]:
    """The gate slots of the row for ``pattern`` under gate outcomes ``bits``, at each gate's hook
    point: outcome code ``c`` (bit k: slot k passed) moves a token to ``row_of(bits | gates of c)``."""
    out = []
    for site, gates in gating.by_site().items():
        slots = [(gating.gates[g], slot_mode(gating.gates[g], pattern, gating.roles)) for g in gates]
        rows = []
        for code in range(1 << len(gates)):
            moved = bits
            for k, g in enumerate(gates):
                if code >> k & 1:
                    moved |= 1 << g
            rows.append(row_of(moved))
        out.append((site, slots, rows))
    return out
