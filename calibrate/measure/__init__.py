"""Measuring a model on this machine: the harness that times one stage's operations, p2p communication, the
calibration that writes a profile, and the runtime model fitted on probe runs."""
