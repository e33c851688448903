"""Pure decisions: (state, settings) -> actions. No I/O here."""
