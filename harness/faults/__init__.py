"""Fault injection for the fault suite: real faults between real processes, hosts and networks."""
