"""The launcher's Ray backend: pools as Ray Serve deployments, the router as a Ray actor."""
