"""Bagel sim.discrete package."""
