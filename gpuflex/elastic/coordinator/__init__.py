"""The job coordinator (`python -m gpuflex.elastic.coordinator`): one process per job that
serves its store and alone decides the generations. It imports the protocol, never the
workers' membership or training state."""
