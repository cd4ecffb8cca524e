"""Partition tests: network namespaces the tests make themselves (tests/partition/netns.py)."""
