"""Training: the trainer (one step's data path top to bottom), its start-up checks."""
