"""Shared helpers for the suites (the plugin in harness.pytest_plugin provides the fixtures)."""
