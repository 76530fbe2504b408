"""The built-in backends: each path of harness/paths/ wired into a deployment (the trainer's sender
and a receiver per rank process). The factories here are what harness.registry names."""
