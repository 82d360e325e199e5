"""torchtitan's side of calibrate: its job configs (config, job), its stage split, and the runner that executes a
schedule through torchtitan's own pipeline helpers."""
