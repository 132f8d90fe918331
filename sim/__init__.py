"""Bagel sim package."""
