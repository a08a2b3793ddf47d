"""Weights and migrated KV between the actors: the transports, the weight-transfer group, the
wire layout and fingerprints."""
