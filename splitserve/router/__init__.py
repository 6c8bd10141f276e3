"""The OpenAI-compatible front door: picks a (P, D) pair, runs the two legs, relays the stream."""
