"""`ElasticRun`, the object a training script holds, composed of parts over one shared
context (no mixins: each part holds the context and uses its public attributes):

    runtime.py        ElasticRun: the public API, the step loop, the composition
    context.py        RunContext: what the parts share (collaborators, the job store, the
                      current generation, the step, flags) and the run's ways out
    startup.py        StartUp: the start under gpuflex, a newcomer's warm-up passes, the join
    boundary.py       Boundary: between two steps (confirm, agree, commit, checkpoint,
                      switch, recover) and the split re-planned at the top of one
    user_calls.py     UserCalls: all_reduce, accumulate, global_mean, register
    data_steps.py     DataParallelSteps: the step strategy of a data-parallel run (backward)
    sharded_steps.py  ShardedSteps: the step strategy of a sharded (FSDP2) run
"""
