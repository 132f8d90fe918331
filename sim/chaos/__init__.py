"""Bagel sim.chaos package."""
