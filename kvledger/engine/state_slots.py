"""State slots: which sequence owns which window ring of the model, and the decode replica area.

A model with sliding-window layers keeps one window ring per slot on the device. Each slot also
owns a host buffer of one snapshot (`spec.state_size_to_disk()` bytes), the replica area of
rule 4: each time a decoding sequence crosses a multiple of B, its window at that boundary is
copied there; at request end the latest copy is stored, attached at its boundary.
Models without sliding-window layers have no slots (`num_slots` 0, sequences use slot −1).
"""

from __future__ import annotations

import torch

from kvledger.engine.models.base import Model


class StateSlots:
    def __init__(self, num_slots: int, snapshot_bytes: int) -> None:
        assert num_slots >= 0 and snapshot_bytes >= 0
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.replica = torch.zeros((num_slots, snapshot_bytes), dtype=torch.uint8)
        self.replica_position = [0] * num_slots
        self.staging = torch.zeros(snapshot_bytes, dtype=torch.uint8)  # one snapshot in flight (fetch/store)

    def allocate(self) -> int | None:
        if not self.free:
            return None
        slot = self.free.pop()
        self.replica_position[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot < 0:
            return
        assert slot not in self.free, f"slot {slot} released twice"
        self.free.append(slot)

    def copy_replica(self, model: Model, slot: int, boundary: int) -> None:
        """The window at `boundary` (a multiple of B just crossed) into the slot's replica area."""
        model.export_window(slot, boundary, self.replica[slot])
        self.replica_position[slot] = boundary

    def check_integrity(self, used: int) -> None:
        assert len(self.free) + used == self.num_slots, f"slot leak: {len(self.free)} free + {used} used"
