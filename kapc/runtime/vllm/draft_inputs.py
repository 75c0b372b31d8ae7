"""A draft cycle's inputs as a GPU would want them: built once, advanced on the device.

Every draft step of a cycle differs from the one before only by one position per row: the
sequence length and the position grow by one, the KV slot moves to the next, the input token is
the step's own output. So a cycle's block tables (each row's compact table for its LAST draft
position, which covers every earlier step: the kernel reads only `seq_len` tokens of a row),
slots, lengths, positions and first tokens are packed on the host once and uploaded in ONE copy;
each step is then a few device operations on those buffers, and the drafts come back to the
host in ONE read at the cycle's end. The table's width is padded to a power of two of blocks
(kapc.policy.padded_view, as the compiler pads a plan's view), so a captured forward sees few
shapes. `uploads` and `reads` count the host-device transfers the cycle made (the index of the
rows still drafting is uploaded again only when that set shrinks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kapc.policy import padded_view


@dataclass
class StepInputs:
    """One draft forward's inputs on the device, and what the attention metadata needs of them
    on the host (lengths, known without reading the device)."""

    block_table: torch.Tensor  # int32 [rows, width]
    seq_lens: torch.Tensor  # int32 [rows]
    positions: torch.Tensor  # int64 [rows]
    slots: torch.Tensor  # int64 [rows]
    token_ids: torch.Tensor  # int64 [rows]
    seq_lens_host: list[int]


class DraftInputs:
    def __init__(self, tables, seq_lens, positions, slots, tokens, device):
        """Row i drafts len(slots[i]) tokens from position positions[i] (its newest token,
        tokens[i]), reading `tables[i]` (its compact table for its last draft position), which
        shows seq_lens[i] tokens at the first step; draft j writes its key to slots[i][j]."""
        n, kmax = len(tables), max(len(s) for s in slots)
        self.width = padded_view(max(len(t) for t in tables))
        W = self.width
        packed = torch.zeros(n, W + kmax + 3, dtype=torch.int64)
        for i, (t, s) in enumerate(zip(tables, slots)):
            packed[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
            packed[i, W : W + len(s)] = torch.tensor(s, dtype=torch.int64)
        packed[:, W + kmax] = torch.tensor(seq_lens, dtype=torch.int64)
        packed[:, W + kmax + 1] = torch.tensor(positions, dtype=torch.int64)
        packed[:, W + kmax + 2] = torch.tensor(tokens, dtype=torch.int64)
        self.uploads, self.reads = 0, 0
        dev = self._upload(packed, device)
        self.device = device
        self.table = dev[:, :W].to(torch.int32)
        self.slots = dev[:, W : W + kmax]
        self.seq0 = dev[:, W + kmax].to(torch.int32)
        self.pos0 = dev[:, W + kmax + 1]
        self.tokens = dev[:, W + kmax + 2].clone()
        self.steps = [len(s) for s in slots]
        self.first_slots = [int(s[0]) for s in slots]  # the key-layout probe reads one back
        self._seq_host = [int(x) for x in seq_lens]
        self._live: tuple[int, ...] = tuple(range(n))
        self._index: torch.Tensor | None = None
        self.out = torch.zeros(n, kmax, dtype=torch.int64, device=device)

    def _upload(self, host: torch.Tensor, device) -> torch.Tensor:
        self.uploads += 1
        return host.to(device, non_blocking=True) if torch.device(device).type != "cpu" else host

    def live(self, step: int) -> list[int]:
        """The rows still drafting at `step`."""
        return [i for i, k in enumerate(self.steps) if k > step]

    def at(self, step: int) -> StepInputs:
        """The inputs of draft step `step` for the rows still drafting."""
        live = tuple(self.live(step))
        if live != self._live:
            self._live = live
            self._index = self._upload(torch.tensor(live, dtype=torch.long), self.device)
        pick = (lambda t: t) if self._index is None else (lambda t: t.index_select(0, self._index))
        return StepInputs(
            # a copy: query-aware page choice edits the table the kernel reads, layer by layer
            block_table=pick(self.table).clone(),
            seq_lens=pick(self.seq0) + step,
            positions=pick(self.pos0) + step,
            slots=pick(self.slots[:, step]).contiguous(),
            token_ids=pick(self.tokens),
            seq_lens_host=[self._seq_host[i] + step for i in live],
        )

    def advance(self, step: int, drafted: torch.Tensor) -> None:
        """Record step `step`'s drafts (one per live row, on the device) as the next inputs."""
        if self._index is None:
            self.tokens.copy_(drafted)
            self.out[:, step] = drafted
        else:
            self.tokens.index_copy_(0, self._index, drafted)
            self.out[:, step].index_copy_(0, self._index, drafted)

    def drafts(self) -> list[list[int]]:
        """Every row's drafts, read back in one transfer."""
        self.reads += 1
        rows = self.out.tolist()
        return [row[:k] for row, k in zip(rows, self.steps)]


def routed_rows(live: list[int], dyn: list[int], device):
    """(row in the forward, row in the page choice) of the `live` rows (indices into the cycle's
    rows) whose pages are chosen by their query (`dyn`), as index tensors on the device, or None
    when none of them is live: built once per set of live rows, not per step."""
    pairs = [(j, dyn.index(i)) for j, i in enumerate(live) if i in dyn]
    if not pairs:
        return None
    rows, present = zip(*pairs)
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(present, dtype=torch.long, device=device),
    )
