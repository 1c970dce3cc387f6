"""Shared infrastructure every poolserve package may import, and which imports none of them:
logging, metrics export, background loops, small statistics, the load generator."""
