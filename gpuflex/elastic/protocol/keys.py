"""Key names in a job's store: the protocol between the coordinator and the workers.

Anyone who reaches the store's port can read and write every key, so what the coordinator
or a worker acts on is a signed record (auth.py: an HMAC under the job's secret, bound to
the key and to this run of the store); a record that does not verify is ignored as if it
were absent, counted, and reported (the coordinator's status()["forged"]). "signed" below
means that; "unsigned" keys are never acted on in a way a forgery could turn into a
membership, state or outcome change, and why is said for each.

run              signed, by the coordinator at start: a random id every other MAC is bound
                 to, so records of an earlier store of the same job cannot be replayed here
members/{g}      signed JSON {generation, kind, members (wids in rank order), prev, created,
                 message}; written once, by the coordinator only (a forged one would add a
                 member, or drop one); the coordinator puts its newest one back if changed and
                 deletes a members/{g+1} it did not publish
latest           unsigned: the newest generation number, a hint; workers act only on the
                 signed members/{g} it points to (and parse it leniently), and the
                 coordinator puts its own value back when it was changed
ready/{wid}      signed: a worker is warmed up and waiting to join (a forged one would put a
                 worker that is not ready into a generation)
hb/{wid}         unsigned: heartbeat counter, bumped (`add`) by each worker's heartbeat
                 thread; a forgery can only make a dead worker look alive for longer (delay,
                 which deleting keys in an open store achieves too), never change members
fail/{g}/{wid}   signed: a member of generation g saw a collective fail (or a formation step);
                 a forged one would make the coordinator form a needless generation
joined/{g}/{wid} signed: a member arrived at generation g's barrier (workers verify it)
verdict/{g}      signed JSON {ok, reason?} from rank 0 once the copied state was verified (a
                 forged "not ok" would roll back and reject the newcomers)
timings/{g}      signed JSON per-phase timings of forming g, from rank 0 after its first step
                 (shown in status; a forged one is ignored)
done/{wid}       signed: the worker finished (training over or stopped); left/{wid}: signed,
                 retired by a shrink (either, forged, would make the coordinator drop a live
                 member at the next recovery)
rejected/{wid}   signed: the coordinator gave up on a newcomer (e.g. its state did not verify);
                 forged, it would evict a worker
released/{wid}   signed: a newcomer no longer wanted (a shrink came before it joined): exit 0;
                 forged, it would send a worker away
desired          unsigned: JSON list of wids the coordinator wants, a mirror for reading;
                 nobody acts on it (the coordinator keeps its own copy)
desired_request  signed JSON {members, seq} a worker's control socket was asked for (a
                 `resize` poke with members); the coordinator validates it and acts on it
                 only when seq is above the last it acted on, so an old request replayed is
                 ignored; seq comes from `add(request_seq, 1)`
request_seq      unsigned counter for desired_request's seq (a forged bump only skips numbers)
progress         unsigned JSON {step, epoch, samples_per_s, loss, time} from rank 0, about once
                 a second: shown by `gpuflex status`, never acted on
finished         signed: rank 0 reached the end of training (forged, it would stop the
                 coordinator's decisions and send waiting newcomers away)
stopped          signed JSON {wid, by, step, of}: the members agreed to stop before the end of
                 training because worker wid was asked to (`by`: a SIGTERM or its control
                 socket's stop), written by that worker; when no cancel or time limit of
                 gpuflex's ended the run, the control side restarts the job from its
                 checkpoint instead of calling a run that exited 0 early a success (forged,
                 it would restart a job whose script ended its loop early)
crashed/{wid}    signed JSON {error, traceback: [last lines], phase}: the worker's training
                 code raised; written by the worker just before it exits (a bug, not a fault:
                 the coordinator forms no generation without it, the control side fails or
                 restarts the job)
waiting/{wid}    signed JSON {for: [wids], since, phase}: this member has waited at a step
                 barrier (liveness.py) for more than a second for members that are alive
                 but busy; {for: []} once it no longer waits; shown by `gpuflex status`
abort            signed JSON {reason, cause, at}: written by the coordinator when the same
                 failure (a rollback, a failed formation) repeated max_same_failures times
                 (cause "repeated"), or when none of an in-place job's first workers joined
                 the runtime within the formation deadline (cause "never-joined": a plain
                 script); `at`: its wall-clock time. Every worker exits ABORTED_EXIT and the
                 job fails with the reason (read up to ABORT_REASON_CHARS, never cut shorter)
barrier/{g}      counter of arrivals at generation g's step barriers (liveness.py: the
                 n-th barrier is passed at n x world), a hint: a forged count makes a
                 member decide early (at a voting barrier it checks the arrivals; at a
                 plain one the members enter the collective early, fenced by its timeout). barrier/{g}/{n}/in the
                 arrivals themselves, one signed line "wid vote" appended by each member;
                 barrier/{g}/{n} the outcome, signed ("ok", "ok SUM" or "fail: reason"),
                 decided once for every member by a member that verified all the arrivals
                 (or one that gave up); a forged outcome is overwritten by a member that
                 verified the arrivals and is never acted on. barrier/{g}/at/{wid} the last
                 barrier a waiting member reached (who is missing): a hint, a forged one
                 can only make the others wait for a member longer
abort            see above; the coordinator also writes it when failures with different
                 causes follow each other too often without training progress
events           unsigned counter every worker bumps after writing a key the coordinator acts
                 on, so an idle coordinator reads one key per tick instead of all of them; a
                 forged bump only causes a full read
pg/{g}/...       torch's own rendezvous of generation g's process group (unsigned: torch
                 writes it); only the members of a signed members/{g} join, and what they
                 send each other is checked (the state header is signed, see `state`, and
                 the copied state's checksum is compared across members)
shards/bytes     signed JSON: a sharded job's state (parameters and optimizer state, all
                 shards) in bytes, written by rank 0 after each formation; a newcomer
                 reserves its share of memory before a resize (pages.py), at most 4x the
                 bytes of its own model
state/{g}        not a store key: the name the state header a member broadcasts while forming
                 generation g is signed under (the header itself travels over the process
                 group, as JSON, never pickle)

Exit codes of a worker (the runtime's side of the protocol; the control side reads them):
STORE_LOST_EXIT  75 (EX_TEMPFAIL): the job store is gone; the job restarts from its last
                 on-disk checkpoint
EVICTED_EXIT     3: this worker was dropped from the job (or its state was rejected)
ABORTED_EXIT     76: the coordinator ended the job (see `abort`); the job fails with that
                 reason
SHARDS_LOST_EXIT 79: a sharded run lost shards it holds the only copy of (a member killed
                 or a collective failed mid-step: shard_checkpoints.py); the job restarts
                 from its last distributed checkpoint and replays the steps since
Exit code of the coordinator (its supervisor's exit record keeps it for the control side):
ORPHAN_EXIT      77: it ended itself because its job was gone: its job directory was
                 removed, or no worker heartbeat and no control-socket request came for its
                 --orphan-timeout (the [jobs] orphan_timeout_s key); its log's last line is
                 JSON {"event": "orphan", "reason", "exit_code"}. A job still running then is
                 requeued with that reason
Any other non-zero exit of a worker (a Python exception, sys.exit(n)) is a bug in the training code,
not a fault: the job fails, or restarts while `--retries` allow. A death by signal is a
fault (elastic: the others go on without it).
"""

from __future__ import annotations

STORE_LOST_EXIT = 75
EVICTED_EXIT = 3
ABORTED_EXIT = 76
SHARDS_LOST_EXIT = 79
RUNTIME_EXITS = (STORE_LOST_EXIT, EVICTED_EXIT, ABORTED_EXIT, SHARDS_LOST_EXIT)   # the runtime's own ways out
ORPHAN_EXIT = 77   # the coordinator's, not a worker's: its job was gone
ABORT_REASON_CHARS = 1000   # an abort's reason is read up to this long (the coordinator's are shorter)


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


def crashed(wid: int) -> str:
    return f"crashed/{wid}"


def waiting(wid: int) -> str:
    return f"waiting/{wid}"


def counter_key(g: int) -> str:
    return f"barrier/{g}"


def outcome_key(g: int, n: int) -> str:
    return f"barrier/{g}/{n}"


def arrivals_key(g: int, n: int) -> str:
    return f"barrier/{g}/{n}/in"


def arrival_key(g: int, wid: int) -> str:
    return f"barrier/{g}/at/{wid}"


def pg_prefix(g: int) -> str:
    return f"pg/{g}/"


def state(g: int) -> str:
    return f"state/{g}"


RUN = "run"
LATEST = "latest"
DESIRED = "desired"
DESIRED_REQUEST = "desired_request"
REQUEST_SEQ = "request_seq"
PROGRESS = "progress"
SHARD_BYTES = "shards/bytes"
FINISHED = "finished"
STOPPED = "stopped"
EVENTS = "events"
ABORT = "abort"
