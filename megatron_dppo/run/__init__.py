"""One run's bookkeeping, below everything that trains: its directory and identity, the metrics
log, checkpoint cadence, the stall watchdog, process hygiene, host collectives and the
throughput profile.
"""
