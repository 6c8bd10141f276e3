"""Calibration for deployments whose router, client and workers share a few CPU cores: the
costs (`costs.SplitCost`), how the simulator applies them (`overlay`), and how they are
measured (`calibrate`, `interference`, `jitter`) and corrected for the machine's drift
(`drift`)."""
