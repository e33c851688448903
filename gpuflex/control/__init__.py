"""The control side: applies decisions through transports and records them."""
