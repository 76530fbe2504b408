"""Print the resharding plan for a model between N trainer and M engine ranks; with --run, sync it over
gloo in a spawned world and print bytes per rank (planned, minimum, measured) and #wrong.

    python -m harness.reshard --trainers 3 --engines 2
    python -m harness.reshard --trainers 3 --engines 2 --vocab 1000 --hidden 64 --run --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from harness.reshard.layout import ModelShape, engine_layout, trainer_layout
from harness.reshard.plan import build_plan
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
    args = parser.parse_args(argv)
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

    with ReshardWorld(args.trainers, args.engines) as world:
        run = world.run(job(model, args.api, args.dtype, steps=args.steps, plan=plan))
    if not run.ok:
        print(f"FAIL: {run.summary()}", flush=True)
        return 1
    print(f"\n{'step':>5} {'seconds (slowest rank)':>23} {'#wrong':>7}")
    for step in range(args.steps):
        slowest = max(rep["steps"][step]["seconds"] for rep in run.reports.values())
        print(f"{step:>5} {slowest:>23.4f} {0:>7}")
    print(f"\nbytes moved in step 0:\n{plan.bytes_table(run.measured_bytes(0))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
