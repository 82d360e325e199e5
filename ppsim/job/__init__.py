"""A training job, torch-free: its settings and the one override reader (``settings``, ``overrides``), its parallel
degrees and torchtitan's rules on them (``degrees``), the pipeline it runs (``pipeline``) and each rank's memory
(``memory``). The torch side (shapes from torchtitan's own model and parallelize) is
``ppsim.calibrate.torchtitan.shapes``; it hands the count plain data."""
