"""`python -m ppsim.cli ...` runs the command line (as the Slurm recipe and the benchmarks do)."""

from ppsim.cli import main

main()
