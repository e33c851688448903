"""A worker's membership in a generation: joining it (rendezvous, forming the process group,
receiving the state), staying alive in it (liveness), agreeing at step boundaries, and the
collectives it runs over the generation's group."""
