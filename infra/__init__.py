"""Shared infrastructure every poolserve package may import, and which imports none of them:
logging, metrics export, background loops, small statistics, the load generator, and
look-ups of deployments in other Serve applications (`handles`)."""
