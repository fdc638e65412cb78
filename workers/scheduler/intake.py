"""What a scheduler does with a job it took (read new, or reclaimed from a dead owner).

`shared.ownership.own` bumped the owner epoch and returned where the request stands; here
that becomes a Sequence: a new request, a request resumed after the ids already generated,
one that ends at once (aborted, or dead-lettered after too many deliveries), or nothing at all
(someone else owns it now, or it already finished). Pure: no Redis, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from shared import protocol
from shared.ownership import Owned
from workers.scheduler.core.scheduler import ABORTED
from workers.scheduler.core.sequence import Sequence, SequenceStatus


class Disposition(enum.Enum):
    RUN = enum.auto()  # hand it to the core
    END = enum.auto()  # finished at once (aborted or dead-lettered): publish its finish
    DEAD = enum.auto()  # END, and copy the job to the dead-letter stream first
    ACK = enum.auto()  # someone already finished it: only the ack is left
    SKIP = enum.auto()  # not ours any more


@dataclass
class Intake:
    disposition: Disposition
    seq: Sequence | None = None
    reason: str = ""  # why it was dead-lettered
    deliveries: int = 0


def dead_letter_message(deliveries: int) -> str:
    return (
        f"The request was given up after {deliveries} deliveries to schedulers "
        "(each one died or stopped while running it)."
    )


def take(
    job: protocol.GenerateJob, entry_id: bytes, owned: Owned | None, max_deliveries: int
) -> Intake:
    """Decide what to do with `job`, given what `own` found."""
    if owned is None:
        return Intake(Disposition.SKIP)
    if owned.status in ("finished", "aborted"):
        return Intake(Disposition.ACK)
    seq = _sequence(job, entry_id, owned)
    if owned.aborted:
        seq.status, seq.finish = SequenceStatus.FINISHED, ABORTED
        return Intake(Disposition.END, seq)
    if owned.deliveries > max_deliveries:
        message = dead_letter_message(owned.deliveries)
        seq.status = SequenceStatus.FINISHED
        seq.finish = protocol.FinishReason(type="abort", message=message, status_code=500)
        return Intake(Disposition.DEAD, seq, message, owned.deliveries)
    return Intake(Disposition.RUN, seq)


def _sequence(job: protocol.GenerateJob, entry_id: bytes, owned: Owned) -> Sequence:
    # The client may have re-attached to another api replica since the job was written.
    detok = job.detok
    if owned.api_id and owned.api_id != detok.api_id:
        detok = msgspec.structs.replace(detok, api_id=owned.api_id)
    seq = Sequence(
        job.rid,
        job.input_ids,
        job.sampling,
        epoch=owned.epoch,
        entry_id=entry_id,
        detok=detok,
        logprobs=job.logprobs,
        embed=job.embed,
        priority=job.priority,
        deadline=job.deadline,
        created_at=job.created_at,
    )
    if owned.ids and not job.embed:
        seq.resume(owned.ids)
    return seq
