"""Bagel sim.netlab package: the network test bed (namespaces, NAT, shaped links) on one machine."""
