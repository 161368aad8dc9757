"""Ray-free protocol state and wire formats: messages, cluster metadata, replica and group state, leases."""
