"""Run a command and report the most memory its whole process tree held at once.

    python .ci/peak_memory.py [--limit-gib 8] -- python -m pytest ...

Every second it sums, over the command and all its descendants (rank processes are forks of a fork
server the run starts: descendants too), the proportional set size (PSS: a page shared by k processes
counts 1/k to each, so forks of one server are not counted k times) and the resident set size (RSS, which
counts shared pages in every process). Prints the peaks and how many processes were alive at the PSS peak;
exits with the command's status, or 1 where the peak RSS sum passed --limit-gib (the stricter of the two:
what a machine needs is nearer the PSS; the RSS sum is what a memory budget that counts each process sees)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(name))
    return tree


def _tree(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def _pss_rss_kib(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in KiB, from one read of smaps_rollup: the kernel walks the process's
    page tables for every read, and with 70 processes of a few hundred MB each two reads a second cost
    the watch 15 % of a CPU."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


def _kind(pid: int) -> str:
    """What a process is, for the peak's census: its command line's first words (a rank, a fork server,
    a torchrun worker, the pytest interpreter)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in words if w]
    words = [os.path.basename(words[0]), *words[1:]] if words else ["?"]
    return " ".join(words[:4])[:90]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--limit-gib", type=float, default=None, help="fail where the peak RSS sum passes this"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    proc = subprocess.Popen(command)
    peak_pss = peak_rss = procs_at_peak = most_procs = 0
    rss_census: dict[str, list[int]] = {}
    while proc.poll() is None:
        pids = _tree(proc.pid)
        sizes = {p: _pss_rss_kib(p) for p in pids}
        pss = sum(size[0] for size in sizes.values())
        rss_of = {p: size[1] for p, size in sizes.items()}
        rss = sum(rss_of.values())
        if pss > peak_pss:
            peak_pss, procs_at_peak = pss, len(pids)
        if rss > peak_rss:  # what held it: each kind of process and its RSS
            census: dict[str, list[int]] = {}
            for p in pids:
                entry = census.setdefault(_kind(p), [0, 0])
                entry[0] += 1
                entry[1] += rss_of[p]
            peak_rss, rss_census = rss, census
        most_procs = max(most_procs, len(pids))
        time.sleep(1.0)
    gib = 1 << 20
    print(
        f"peak memory of the tree: PSS {peak_pss / gib:.2f} GiB ({procs_at_peak} processes alive then), "
        f"RSS sum {peak_rss / gib:.2f} GiB, at most {most_procs} processes",
        flush=True,
    )
    for kind, (n, kib) in sorted(rss_census.items(), key=lambda kv: -kv[1][1]):
        print(f"  at the RSS peak: {n:3d} x {kind}: {kib / gib:.2f} GiB", flush=True)
    if args.limit_gib is not None and peak_rss / gib > args.limit_gib:
        print(
            f"peak RSS sum {peak_rss / gib:.2f} GiB is over the limit of {args.limit_gib:g} GiB", flush=True
        )
        return proc.returncode or 1
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
