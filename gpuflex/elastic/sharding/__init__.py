"""Sharded (FSDP2) state: a sharded run's set-up, resharding in place on a resize, the
shards' moves, their distributed checkpoints, and memory made ready before a grow."""
