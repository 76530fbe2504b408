"""The trainer <-> rank call protocol: one table of operations (`protocol.py`) from which the rank loop's
dispatch (harness.launch) and the pipe proxies' methods are made, and which names each operation's HTTP
route (harness.control.remote) or why it has none."""
