"""Key names in a job's store: the protocol between the coordinator and the workers.

members/{g}      JSON {generation, kind, members (wids in rank order), prev, created}; written
                 once, by the coordinator only
latest           the newest generation number
ready/{wid}      a worker is warmed up and waiting to join
hb/{wid}         heartbeat counter, bumped by each worker's heartbeat thread
fail/{g}/{wid}   a member of generation g saw a collective fail (or a formation step)
joined/{g}/{wid} a member arrived at generation g's barrier
verdict/{g}      JSON {ok, reason?} from rank 0 once the copied state was verified
timings/{g}      JSON per-phase timings of forming g, from rank 0 after its first step
done/{wid}       the worker finished (training over or stopped); left/{wid}: retired by a shrink
rejected/{wid}   the coordinator gave up on a newcomer (e.g. its state did not verify)
released/{wid}   a newcomer no longer wanted (a shrink came before it joined): exit 0
desired          JSON list of wids the controller wants
desired_request  JSON list of wids a worker's control socket was asked for (a `resize`
                 poke with members); the coordinator validates it and turns it into `desired`
progress         JSON {step, epoch, samples_per_s, loss, time} from rank 0, about once a second
finished         rank 0 reached the end of training
events           a counter every worker bumps after writing a key the coordinator acts on,
                 so an idle coordinator reads one key per tick instead of all of them

Exit codes of a worker (the runtime's side of the protocol; the control side reads them):
STORE_LOST_EXIT  75 (EX_TEMPFAIL): the job store is gone; the job restarts from its last
                 on-disk checkpoint
EVICTED_EXIT     3: this worker was dropped from the job (or its state was rejected)
"""

from __future__ import annotations

STORE_LOST_EXIT = 75
EVICTED_EXIT = 3


def members(g: int) -> str:
    return f"members/{g}"


def ready(wid: int) -> str:
    return f"ready/{wid}"


def hb(wid: int) -> str:
    return f"hb/{wid}"


def fail(g: int, wid: int) -> str:
    return f"fail/{g}/{wid}"


def joined(g: int, wid: int) -> str:
    return f"joined/{g}/{wid}"


def verdict(g: int) -> str:
    return f"verdict/{g}"


def timings(g: int) -> str:
    return f"timings/{g}"


def done(wid: int) -> str:
    return f"done/{wid}"


def left(wid: int) -> str:
    return f"left/{wid}"


def rejected(wid: int) -> str:
    return f"rejected/{wid}"


def released(wid: int) -> str:
    return f"released/{wid}"


def pg_prefix(g: int) -> str:
    return f"pg/{g}/"


LATEST = "latest"
DESIRED = "desired"
DESIRED_REQUEST = "desired_request"
PROGRESS = "progress"
FINISHED = "finished"
EVENTS = "events"
