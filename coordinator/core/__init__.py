"""Bagel coordinator.core package."""
