"""Print the resharding plan for a model between N trainer and M engine ranks; with --run, sync it over
gloo in a spawned world and print bytes per rank (planned, minimum, measured) and #wrong.

    python -m harness.reshard --trainers 3 --engines 2
    python -m harness.reshard --trainers 3 --engines 2 --vocab 1000 --hidden 64 --run --steps 3
    python -m harness.reshard --trainers 3 --engines 2 --replicas 2 --run     # broadcast per rank group
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from harness.reshard.layout import ModelShape, engine_layout, trainer_layout
from harness.reshard.plan import build_plan
from harness.reshard.sync import WIRE_PLANES, choose_data_plane
from harness.reshard.trainer_shards import DTENSOR, FSDP2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trainers", type=int, default=3, help="trainer ranks (FSDP2 / DTensor shards)")
    parser.add_argument("--engines", type=int, default=2, help="engine ranks (tensor parallel)")
    defaults = ModelShape()
    for f in dataclasses.fields(ModelShape):
        if f.type in ("int", int):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=getattr(defaults, f.name))
    parser.add_argument("--untied", action="store_true", help="lm_head its own tensor (default: tied)")
    parser.add_argument("--qkv-bias", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--api", default=FSDP2, choices=[FSDP2, DTENSOR], help="how the trainer shards")
    parser.add_argument("--json", action="store_true", help="the plan as JSON instead of a table")
    parser.add_argument("--run", action="store_true", help="sync it over gloo and measure")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas, each of --engines ranks")
    parser.add_argument(
        "--plane", default="auto", choices=["auto", *WIRE_PLANES], help="data plane (auto: chosen, and why)"
    )
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error(f"--replicas {args.replicas}: at least 1")
    if args.plane == "broadcast" and args.replicas < 2:
        parser.error("--plane broadcast: needs --replicas 2 or more (one replica's plane is p2p)")
    ints = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelShape) if f.type in ("int", int)}
    model = ModelShape(**ints, tied=not args.untied, qkv_bias=args.qkv_bias)
    plan = build_plan(
        trainer_layout(model, args.trainers, args.dtype, replicate_norms=args.api == DTENSOR),
        engine_layout(model, args.engines),
    )
    print(json.dumps(plan.to_json(), indent=1) if args.json else plan.table(), flush=True)
    if not args.run:
        return 0
    from harness.reshard.world import ReshardWorld, job

    plane, why = choose_data_plane(args.replicas)
    if args.plane != "auto":
        plane, why = args.plane, "named by --plane"
    print(f"\ndata plane: {plane} ({why})", flush=True)
    with ReshardWorld(args.trainers, args.engines, replicas=args.replicas) as world:
        run = world.run(job(model, args.api, args.dtype, steps=args.steps, plan=plan, plane=plane))
    if not run.ok:
        print(f"FAIL: {run.summary()}", flush=True)
        return 1
    print(f"\n{'step':>5} {'seconds (slowest rank)':>23} {'#wrong':>7}")
    for step in range(args.steps):
        slowest = max(rep["steps"][step]["seconds"] for rep in run.reports.values())
        print(f"{step:>5} {slowest:>23.4f} {0:>7}")
    measured = run.measured_bytes(0)
    for q in range(args.replicas):  # each replica's engine ranks against the plan; the trainers' sends
        mine = {k: v for k, v in measured.items() if k.startswith("trainer")}
        mine |= {
            f"engine {e}": measured[f"engine {e}" + (f" of replica {q}" if args.replicas > 1 else "")]
            for e in range(args.engines)
        }
        title = f" (replica {q}; trainers: everything they handed over)" if args.replicas > 1 else ""
        print(f"\nbytes moved in step 0{title}:\n{plan.bytes_table(mine)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
