"""Where bytes live: segments (memfd or named) and arenas that pack small arrays."""
