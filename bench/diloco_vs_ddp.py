"""Benchmark: DiLoCo (fp32 / int8 / int4+EF pseudo-gradients) vs synchronous data-parallel.

Issue 5 must-show 6. Work in progress; not a test, never part of the test suite.
"""
