"""Ray actors (a partition replica, the controller) and the client side of their calls."""
