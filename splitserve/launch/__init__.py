"""Start a deployment (workers + router) with one command."""
