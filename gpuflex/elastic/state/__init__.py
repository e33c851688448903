"""Training state: the tree a run owns (capture, light per-step commits, checksums), its
safe encoding, the state a newcomer receives, buffers kept equal, and checkpoints."""
