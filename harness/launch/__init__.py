"""Receiver ranks as processes: start on one host (forks of a warm server, harness.warm), serve
lifecycle and engine calls, supervise.

Each rank process holds one engine and one receiver. The parent talks to it through a pipe carrying
JSON headers and safetensors frames (harness.wire), and supervises it: a rank that dies is reported
with its exit code and log tail; a rank that does not answer within the timeout gets its Python
stacks dumped (faulthandler, SIGUSR1) into its log, is killed, and the call fails. Never a silent hang.

One module per job; what crosses the pipe is harness.ranks.protocol's table:

- `rank_server`: the rank's side: its loop (`rank_main`) and the operations it serves itself;
- `supervision`: the parent's handle on one rank (`RankProcess`): calls under a deadline, death,
  hangs and stacks, and the registry of live ranks that hang reports and memory bounds read;
- `pipe_proxies`: the `Receiver` and `Engine` a trainer holds for a rank, over its pipe (the HTTP
  proxies, harness.control.remote, are another thing);
- `rank_deployment`: a sender here and N supervised ranks as one `Deployment`, restarts included.
"""

from harness.launch.rank_deployment import RankDeployment
from harness.launch.supervision import RankProcess

__all__ = ["RankDeployment", "RankProcess"]
