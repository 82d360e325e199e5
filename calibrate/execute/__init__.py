"""Executing a schedule for real: `ppsim run`'s library side, ppsim's executor, the step loop and clock every runner
shares, launching ranks, the numerics check, synthetic stages and the torch version adapter."""
