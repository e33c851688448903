"""`ElasticRun`, the object a training script holds: its start-up, the calls a script makes,
and the data-parallel and sharded steps."""
