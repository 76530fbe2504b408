"""What the weight sync costs per step and per run, and where to put the engines (`weightsync cost`).

Two answers, each with its arithmetic printed line by line:

- **overhead**: every GPU the job holds waits on the sync, every step, so
  GPU-hours = sync seconds × GPUs held × steps / 3600, and money = GPU-hours × $/GPU-hour. The seconds
  come from a measured report (a `results.json` of `weightsync certify` or `weightsync bench`), from a
  given time (`--sync-s`), or from a model size and a throughput (`--params` with `--throughput-gbs`).
  `--pause-s` bills the time the engines are paused around the sync the same way.
- **placement** (`--params`): collocated (trainer and engine on the same GPUs, synced by a same-GPU
  CUDA IPC copy) against disaggregated (the engines on GPUs of their own, synced by a broadcast over the
  fabric): what fits on one GPU, how many GPUs each needs, what sync each implies, and which holds fewer.

Units: model and throughput figures are decimal (GB = 1e9 B, GB/s; a fabric's Gb/s / 8 = GB/s), as
results.json and NIC ratings are; GPU memory is binary (GiB = 2**30 B), as torch reports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

GB = 1e9
GIB = 1 << 30
MIB = 1 << 20
SECONDS_PER_HOUR = 3600

#: torch on one H200 (the lent `nvidia-h200`, 2026-12): 139.80 GiB total, 139.29 GiB free once the CUDA
#: context exists; NVIDIA rates it "141 GB". Activations and framework buffers are not counted.
H200_USABLE_GIB = 139.0
NDR_GBPS = 400.0  # InfiniBand NDR, one port: 400 Gb/s = 50 GB/s raw
#: the share of a link's raw rate that reaches the buffers (headers, acks, protocol): ~45 of NDR's 50 GB/s
PAYLOAD_EFFICIENCY = 0.9
BF16_BYTES = 2
BF16_GRAD_BYTES = 2
ADAM_OPTIMIZER_BYTES = 12  # fp32 master copy + two fp32 moments
DEFAULT_KV_GIB = 16.0
#: the changed fraction of the RL regime (harness.bench.DEFAULT_CHANGED, not imported: it loads torch);
#: a delta path's row at this fraction is the one billed when a size holds several
RL_CHANGED = 0.01

DESCRIPTION = __doc__

# Why one file: the cost arithmetic, the placement advice and the worked examples use the same figures and
# must show the same arithmetic; the command's output is built from them in order.


class CostInputError(ValueError):
    """A value `weightsync cost` cannot use; the message names it."""


# ---- the arithmetic -------------------------------------------------------------------------------


def gpu_hours(seconds: float, gpus: int, steps: int) -> float:
    """GPU-hours spent waiting: every held GPU waits the whole time, every step."""
    return seconds * gpus * steps / SECONDS_PER_HOUR


def gbps_to_gbs(gbps: float) -> float:
    """A link rating in gigabits per second as gigabytes per second (8 bits a byte)."""
    return gbps / 8


def fabric_payload_gbs(gbps: float, efficiency: float = PAYLOAD_EFFICIENCY) -> float:
    """What a link of `gbps` delivers into the buffers, in GB/s."""
    return gbps_to_gbs(gbps) * efficiency


_MULTIPLIERS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_params(text: str) -> float:
    """A parameter count as people write it: 7B, 70b, 1.5T, 350M, 7e9."""
    match = re.fullmatch(r"\s*(\d*\.?\d+(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*", text, re.IGNORECASE)
    if not match:
        raise CostInputError(f"--params {text!r}: not a parameter count (e.g. 7B, 70B, 350M, 7e9)")
    count = float(match[1]) * _MULTIPLIERS[match[2].lower()]
    if count <= 0:
        raise CostInputError(f"--params {text!r}: a model has more than 0 parameters")
    return count


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def fmt_count(count: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if count >= size:
            return f"{count / size:g}{unit}"
    return f"{count:g}"


def plural_gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def fmt_money(dollars: float) -> str:
    return f"${dollars:,.2f}" if dollars >= 0.01 or dollars == 0 else f"${dollars:.3g}"


def fmt_size(size_bytes: int) -> str:
    return f"{size_bytes / GIB:g} GiB" if size_bytes % GIB == 0 else f"{size_bytes / MIB:g} MiB"


# ---- billing a time per step --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bill:
    """One time paid every step (the sync, or the pause around it) by every GPU held."""

    what: str
    seconds: float
    source: str  # where the seconds came from, with their arithmetic
    gpus: int
    steps: int
    price: float | None  # $ per GPU-hour; None: no money figures

    @property
    def gpu_seconds_per_step(self) -> float:
        return self.seconds * self.gpus

    @property
    def gpu_hours_per_step(self) -> float:
        return gpu_hours(self.seconds, self.gpus, 1)

    @property
    def gpu_hours_per_run(self) -> float:
        return gpu_hours(self.seconds, self.gpus, self.steps)

    def money(self, hours: float) -> float | None:
        return None if self.price is None else hours * self.price

    @property
    def arithmetic(self) -> str:
        line = (
            f"{self.what}: {self.seconds:.6g} s × {plural_gpus(self.gpus)} × {self.steps} steps / 3600 "
            f"= {self.gpu_hours_per_run:.6g} GPU-hours"
        )
        if self.price is not None:
            line += f" × ${self.price:g}/GPU-hour = {fmt_money(self.money(self.gpu_hours_per_run))}"
        return line

    def to_json(self) -> dict:
        return {
            "what": self.what,
            "seconds_per_step": self.seconds,
            "source": self.source,
            "gpus": self.gpus,
            "steps": self.steps,
            "price_per_gpu_hour": self.price,
            "gpu_seconds_per_step": self.gpu_seconds_per_step,
            "gpu_hours_per_step": self.gpu_hours_per_step,
            "gpu_hours_per_run": self.gpu_hours_per_run,
            "money_per_step": self.money(self.gpu_hours_per_step),
            "money_per_run": self.money(self.gpu_hours_per_run),
        }


# ---- a measured report ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeasuredRow:
    """One throughput row of a results.json: a median full-lifecycle push."""

    file: str
    path: str
    receivers: int
    size_bytes: int
    time_s: float
    device: str
    ceiling_kind: str
    changed: float

    @property
    def gbs(self) -> float:
        return self.size_bytes / self.time_s / GB

    def label(self) -> str:
        return f"the {self.path} {self.receivers}rx {fmt_size(self.size_bytes)} row"

    def describe(self) -> str:
        changed = f", {self.changed:.1%} changed" if self.changed else ""
        ceiling = f", ceiling {self.ceiling_kind}" if self.ceiling_kind else ""
        return (
            f"{self.path} {self.receivers}rx {fmt_size(self.size_bytes)} on {self.device}{changed}{ceiling}: "
            f"{self.time_s * 1e3:.3g} ms = {self.gbs:.4g} GB/s, {self.file}"
        )


#: what billing a row needs of it (docs/results-schema.md, "A throughput row")
ROW_KEYS = ("path", "receivers", "size_bytes", "time_s")


def read_rows(file: Path) -> list[dict]:
    """The throughput rows of a results.json: certify writes them under `throughput`, bench under `rows`."""
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise CostInputError(f"--results {file}: no such file") from None
    except (OSError, ValueError) as exc:
        raise CostInputError(f"--results {file}: not a readable results.json ({exc})") from None
    rows = data.get("throughput", data.get("rows")) if isinstance(data, dict) else None
    if not rows:
        raise CostInputError(
            f"--results {file}: holds no throughput rows (certify writes them under 'throughput', bench "
            "under 'rows'; certify --no-bench writes none)"
        )
    for i, row in enumerate(rows):
        lacking = [k for k in ROW_KEYS if k not in row]
        if lacking:
            raise CostInputError(f"--results {file}: row {i} lacks {', '.join(lacking)}")
    return rows


def _one_of(rows: list[dict], key: str, wanted, asked: str, file: str) -> list[dict]:
    """The rows whose `key` is `wanted`; none is a usage error naming what was asked and what there is."""
    kept = [r for r in rows if r[key] == wanted]
    if not kept:
        there = ", ".join(str(v) for v in sorted({r[key] for r in rows}))
        raise CostInputError(f"{asked}: no such row in {file} ({key} there: {there})")
    return kept


def _at_size(rows: list[dict], size_mib: float | None, file: str) -> list[dict]:
    """The rows of the named size, or of the largest measured (nearest a model's bytes)."""
    if size_mib is None:
        return [r for r in rows if r["size_bytes"] == max(r["size_bytes"] for r in rows)]
    kept = [r for r in rows if r["size_bytes"] == round(size_mib * MIB)]
    if not kept:
        there = ", ".join(f"{s / MIB:g}" for s in sorted({r["size_bytes"] for r in rows}))
        raise CostInputError(
            f"--row-size-mib {size_mib:g}: no {rows[0]['path']} {rows[0]['receivers']}rx row of that size in "
            f"{file} (MiB there: {there})"
        )
    return kept


def pick_row(
    rows: list[dict],
    file: str,
    path: str | None = None,
    size_mib: float | None = None,
    receivers: int | None = None,
) -> MeasuredRow:
    """The row to bill: the named path (or the only one), the fewest receivers, the largest size (nearest
    a model's bytes), unless named. Bucket-sweep rows measure a bucket size, not the path as deployed."""
    own_plan = [r for r in rows if not r.get("bucket_bytes")]
    paths = sorted({r["path"] for r in own_plan})
    if path is None and len(paths) != 1:
        raise CostInputError(f"--results {file} holds rows of {', '.join(paths)}: name one with --row-path")
    path = path or paths[0]
    mine = _one_of(own_plan, "path", path, f"--row-path {path}", file)
    rx = min(r["receivers"] for r in mine) if receivers is None else receivers
    mine = _one_of(mine, "receivers", rx, f"--row-receivers {rx} of {path}", file)
    mine = _at_size(mine, size_mib, file)
    # dense rows carry changed 0; of a delta path's fractions, the RL regime's (1%) is the sync a run pays
    row = min(mine, key=lambda r: abs(r.get("changed", 0.0) - RL_CHANGED))
    measured = MeasuredRow(
        file=file,
        path=row["path"],
        receivers=row["receivers"],
        size_bytes=row["size_bytes"],
        time_s=row["time_s"],
        device=row.get("device", "cpu"),
        ceiling_kind=row.get("ceiling_kind", ""),
        changed=row.get("changed", 0.0),
    )
    if row.get("wrong"):
        raise CostInputError(
            f"the row {measured.describe()} has #wrong {row['wrong']}: its bytes did not arrive intact, so its "
            "time is no sync time"
        )
    if not measured.time_s > 0:
        raise CostInputError(f"the row {measured.describe()} has time_s {measured.time_s}: not a time")
    return measured


# ---- placement ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    params: float
    weight_bytes: float = BF16_BYTES
    grad_bytes: float = BF16_GRAD_BYTES
    optimizer_bytes: float = ADAM_OPTIMIZER_BYTES

    @property
    def weights(self) -> float:
        """Bytes an engine serves and a sync moves."""
        return self.params * self.weight_bytes

    @property
    def trainer_state(self) -> float:
        """Bytes the trainer keeps: weights, gradients and optimizer state (activations not counted)."""
        return self.params * (self.weight_bytes + self.grad_bytes + self.optimizer_bytes)


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu_mem_gib: float = H200_USABLE_GIB
    kv_gib: float = DEFAULT_KV_GIB  # per GPU of an engine
    fabric_gbps: float = NDR_GBPS
    payload_efficiency: float = PAYLOAD_EFFICIENCY
    links: int = 1  # NICs one sync may use at once (one per GPU)
    replicas: int = 1  # engine replicas of the disaggregated placement
    trainer_gpus: int | None = None  # None: the fewest that hold the trainer's state
    same_gpu_gbs: float | None = None  # the same-GPU (CUDA IPC) sync rate, measured or given
    same_gpu_source: str = ""


@dataclasses.dataclass(frozen=True)
class Line:
    what: str
    arithmetic: str
    result: str


@dataclasses.dataclass(frozen=True)
class Placement:
    name: str
    gpus: int | None  # None: does not fit on any number of GPUs
    fullest_gpu_gib: float | None
    sync_s: float | None  # None: no rate to compute it from
    how: str  # how it syncs

    def gpu_seconds_per_step(self) -> float | None:
        return None if self.gpus is None or self.sync_s is None else self.sync_s * self.gpus


@dataclasses.dataclass(frozen=True)
class Plan:
    lines: list[Line]
    collocated: Placement
    disaggregated: Placement
    advice: str


CAVEAT = (
    "Judged on memory and sync alone. Disaggregated placement lets rollout run while the trainer steps "
    "(asynchronous RL) and scales rollout apart from training, which this does not weigh; activations "
    "are not counted (lower --gpu-mem-gib by them); collocated keeps the trainer's state resident beside "
    "the engine, sharded over the same GPUs as the engine's weights (a framework that offloads or "
    "reshards pays that on top)."
)


def fits(need_gib: float, have_gib: float) -> str:
    sign, verdict = ("≤", "fits") if need_gib <= have_gib else (">", "DOES NOT FIT")
    return f"{verdict} ({need_gib:.2f} {sign} {have_gib:g} GiB)"


def _ceil_div(need: float, room: float) -> int:
    return max(1, math.ceil(need / room - 1e-12))  # 1e-12: 2.0000000000000004 is two GPUs, not three


def plan_placement(model: Model, cluster: Cluster) -> Plan:
    """Both placements for `model` on `cluster`, with every step of the arithmetic as a Line."""
    lines: list[Line] = []
    w_gib, t_gib = model.weights / GIB, model.trainer_state / GIB
    mem, kv = cluster.gpu_mem_gib, cluster.kv_gib
    p = fmt_count(model.params)
    lines += [
        Line(
            "weights W",
            f"{p} params × {model.weight_bytes:g} B",
            f"{model.weights / GB:.2f} GB = {w_gib:.2f} GiB",
        ),
        Line(
            "trainer state T",
            f"{p} × ({model.weight_bytes:g} weights + {model.grad_bytes:g} grads + "
            f"{model.optimizer_bytes:g} optimizer) B",
            f"{model.trainer_state / GB:.2f} GB = {t_gib:.2f} GiB",
        ),
        Line(
            "GPU memory M, KV-cache budget KV",
            "--gpu-mem-gib, --kv-gib (per engine GPU)",
            f"{mem:g} GiB, {kv:g} GiB",
        ),
        Line(
            "one GPU, collocated",
            f"T + W + KV = {t_gib:.2f} + {w_gib:.2f} + {kv:g}",
            fits(t_gib + w_gib + kv, mem),
        ),
        Line("one GPU, disaggregated trainer", f"T = {t_gib:.2f}", fits(t_gib, mem)),
        Line("one GPU, disaggregated engine", f"W + KV = {w_gib:.2f} + {kv:g}", fits(w_gib + kv, mem)),
    ]
    n_t = _trainer_gpus(lines, t_gib, mem, cluster.trainer_gpus)
    n_c, fullest_c = _collocated_gpus(lines, t_gib, w_gib, mem, kv, n_t)
    n_e = _engine_gpus(lines, w_gib, mem, kv)
    n_d = _disaggregated_gpus(lines, t_gib, mem, n_t, n_e, cluster.replicas)
    t_c = _collocated_sync(lines, model, n_c, cluster)
    t_d = _disaggregated_sync(lines, model, n_e, cluster)
    collocated = Placement("collocated", n_c, fullest_c, t_c, "same-GPU CUDA IPC")
    disaggregated = Placement(
        "disaggregated",
        n_d,
        max(t_gib / n_t, w_gib / n_e + kv) if n_d else None,
        t_d,
        f"broadcast, {cluster.fabric_gbps:g} Gb/s",
    )
    return Plan(lines, collocated, disaggregated, advise(collocated, disaggregated))


def _trainer_gpus(lines: list[Line], t_gib: float, mem: float, given: int | None) -> int:
    least = _ceil_div(t_gib, mem)
    if given is None:
        lines.append(
            Line("trainer GPUs N_t (fully sharded)", f"ceil(T / M) = ceil({t_gib:.2f} / {mem:g})", str(least))
        )
        return least
    verdict = fits(t_gib / given, mem)
    lines.append(
        Line("trainer GPUs N_t", f"--trainer-gpus {given}: T / N_t = {t_gib:.2f} / {given}", verdict)
    )
    return given


def _collocated_gpus(lines, t_gib, w_gib, mem, kv, n_t) -> tuple[int | None, float | None]:
    on_trainer = (t_gib + w_gib) / n_t + kv
    lines.append(
        Line(
            f"collocated on the trainer's {plural_gpus(n_t)}",
            f"(T + W) / N_t + KV = ({t_gib:.2f} + {w_gib:.2f}) / {n_t} + {kv:g}",
            fits(on_trainer, mem),
        )
    )
    if on_trainer <= mem:
        lines.append(Line("collocated GPUs N_c", "N_t: it fits on the trainer's own GPUs", str(n_t)))
        return n_t, on_trainer
    if kv >= mem:
        lines.append(
            Line("collocated GPUs N_c", f"KV {kv:g} ≥ M {mem:g}: no room for weights", "DOES NOT FIT")
        )
        return None, None
    n_c = _ceil_div(t_gib + w_gib, mem - kv)
    lines.append(
        Line(
            "collocated GPUs N_c",
            f"ceil((T + W) / (M − KV)) = ceil({t_gib + w_gib:.2f} / {mem - kv:g})",
            str(n_c),
        )
    )
    return n_c, (t_gib + w_gib) / n_c + kv


def _engine_gpus(lines, w_gib, mem, kv) -> int | None:
    if kv >= mem:
        lines.append(
            Line("engine GPUs per replica N_e", f"KV {kv:g} ≥ M {mem:g}: no room for weights", "DOES NOT FIT")
        )
        return None
    n_e = _ceil_div(w_gib, mem - kv)
    lines.append(
        Line(
            "engine GPUs per replica N_e", f"ceil(W / (M − KV)) = ceil({w_gib:.2f} / {mem - kv:g})", str(n_e)
        )
    )
    return n_e


def _disaggregated_gpus(lines, t_gib, mem, n_t, n_e, replicas) -> int | None:
    if n_e is None or t_gib / n_t > mem:
        lines.append(Line("disaggregated GPUs", "the trainer or an engine does not fit", "DOES NOT FIT"))
        return None
    total = n_t + replicas * n_e
    lines.append(Line("disaggregated GPUs", f"N_t + replicas × N_e = {n_t} + {replicas} × {n_e}", str(total)))
    return total


def _collocated_sync(lines, model: Model, n_c: int | None, cluster: Cluster) -> float | None:
    what = "collocated sync (same-GPU CUDA IPC)"
    if n_c is None:
        return None
    rate = cluster.same_gpu_gbs
    if rate is None:
        lines.append(Line(what, "no same-GPU rate: give --results (a CUDA IPC row) or --throughput-gbs", "–"))
        return None
    share = model.weights / n_c
    seconds = share / (rate * GB)
    lines.append(
        Line(
            what,
            f"(W / N_c) / rate = ({model.weights / GB:.2f} GB / {n_c}) / {rate:.4g} GB/s ({cluster.same_gpu_source})",
            fmt_s(seconds),
        )
    )
    return seconds


def _disaggregated_sync(lines, model: Model, n_e: int | None, cluster: Cluster) -> float | None:
    if n_e is None:
        return None
    raw = gbps_to_gbs(cluster.fabric_gbps)
    payload = fabric_payload_gbs(cluster.fabric_gbps, cluster.payload_efficiency)
    lines.append(
        Line(
            "fabric payload rate B (per link)",
            f"{cluster.fabric_gbps:g} Gb/s / 8 = {raw:g} GB/s raw × {cluster.payload_efficiency:g}",
            f"{payload:.4g} GB/s",
        )
    )
    # each engine GPU takes its 1/N_e of W on its own NIC: more links than that only queue at the receivers
    k = min(cluster.links, n_e)
    lines.append(Line("links used at once k", f"min(--links {cluster.links}, N_e {n_e})", str(k)))
    seconds = model.weights / (k * payload * GB)
    lines.append(
        Line(
            "disaggregated sync (broadcast)",
            f"W / (k × B) = {model.weights / GB:.2f} GB / ({k} × {payload:.4g} GB/s)",
            fmt_s(seconds),
        )
    )
    return seconds


def advise(collocated: Placement, disaggregated: Placement) -> str:
    """The placement holding fewer GPUs; on a tie, the one whose sync costs fewer GPU-seconds per step."""
    fitting = [p for p in (collocated, disaggregated) if p.gpus is not None]
    if not fitting:
        return "Neither placement fits: the KV-cache budget leaves no room for weights on a GPU."
    if len(fitting) == 1:
        return f"{fitting[0].name}: the only placement that fits ({plural_gpus(fitting[0].gpus)})."

    def cost(p: Placement) -> tuple[int, float]:
        sync = p.gpu_seconds_per_step()
        return (p.gpus, math.inf if sync is None else sync)

    best, other = sorted(fitting, key=cost)
    if best.gpus < other.gpus:
        reason = f"it holds {plural_gpus(best.gpus)} against {other.gpus}"
    else:
        reason = f"both hold {plural_gpus(best.gpus)}, and its sync costs fewer GPU-seconds per step"
    syncs = ", ".join(f"{p.name} {fmt_s(p.sync_s)}" for p in fitting if p.sync_s is not None)
    return f"{best.name}: {reason}" + (f" (sync per step: {syncs})." if syncs else ".")


# ---- the command ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    bills: list[Bill]
    plan: Plan | None
    steps: int | None
    price: float | None
    notes: list[str]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `weightsync cost` (the parser itself is made in harness/cli.py)."""
    t = parser.add_argument_group("time per step (one of --sync-s, --results, --throughput-gbs)")
    t.add_argument("--sync-s", type=float, help="the sync's seconds per step, as given")
    t.add_argument("--results", help="a results.json of weightsync certify or bench: a measured row's time")
    t.add_argument("--row-path", help="the row's path when the results hold several (e.g. ipc)")
    t.add_argument("--row-size-mib", type=float, help="the row's size (default: the largest measured)")
    t.add_argument("--row-receivers", type=int, help="the row's receiver count (default: the fewest)")
    t.add_argument(
        "--throughput-gbs",
        type=float,
        help="a sync rate in GB/s: with --params, the sync time (and the collocated same-GPU rate)",
    )
    t.add_argument("--pause-s", type=float, help="seconds the engines are paused around the sync, per step")
    b = parser.add_argument_group("billing")
    b.add_argument("--gpus", type=int, help="GPUs the job holds (each waits on the sync)")
    b.add_argument("--steps", type=int, help="steps in the run")
    b.add_argument("--price", type=float, help="$ per GPU-hour (money figures only when given)")
    m = parser.add_argument_group("model (placement advice)")
    m.add_argument("--params", help="parameter count: 7B, 70B, 7e9 (turns a rate into a time; placement)")
    m.add_argument("--weight-bytes", type=float, default=BF16_BYTES, help="bytes per weight (bf16: 2)")
    m.add_argument("--grad-bytes", type=float, default=BF16_GRAD_BYTES, help="bytes per gradient (bf16: 2)")
    m.add_argument(
        "--optimizer-bytes",
        type=float,
        default=ADAM_OPTIMIZER_BYTES,
        help="optimizer bytes per parameter (Adam: fp32 master + 2 fp32 moments = 12)",
    )
    h = parser.add_argument_group("memory and fabric")
    h.add_argument(
        "--gpu-mem-gib", type=float, default=H200_USABLE_GIB, help="usable GiB per GPU (H200: 139)"
    )
    h.add_argument("--kv-gib", type=float, default=DEFAULT_KV_GIB, help="KV-cache budget per engine GPU, GiB")
    h.add_argument("--fabric-gbps", type=float, default=NDR_GBPS, help="link rating, Gb/s (NDR: 400)")
    h.add_argument(
        "--fabric-efficiency",
        type=float,
        default=PAYLOAD_EFFICIENCY,
        help="share of the raw rate that is payload (0.9: ~45 of NDR's 50 GB/s)",
    )
    h.add_argument("--links", type=int, default=1, help="NICs one sync may use at once (default: 1)")
    h.add_argument("--trainer-gpus", type=int, help="trainer GPUs (default: the fewest holding its state)")
    h.add_argument("--replicas", type=int, default=1, help="engine replicas when disaggregated (default: 1)")
    parser.add_argument("--json", action="store_true", help="machine output on stdout instead of tables")


def _check_ranges(args: argparse.Namespace) -> None:
    """Refuse a value the arithmetic would turn into nonsense, naming it."""
    positive = {
        "--sync-s": args.sync_s,
        "--pause-s": args.pause_s,
        "--throughput-gbs": args.throughput_gbs,
        "--row-size-mib": args.row_size_mib,
        "--row-receivers": args.row_receivers,
        "--gpus": args.gpus,
        "--steps": args.steps,
        "--weight-bytes": args.weight_bytes,
        "--gpu-mem-gib": args.gpu_mem_gib,
        "--fabric-gbps": args.fabric_gbps,
        "--links": args.links,
        "--trainer-gpus": args.trainer_gpus,
        "--replicas": args.replicas,
    }
    for flag, value in positive.items():
        if value is not None and not value > 0:  # `not >` also refuses nan
            raise CostInputError(f"{flag} {value}: must be greater than 0")
    at_least_zero = {
        "--price": args.price,
        "--grad-bytes": args.grad_bytes,
        "--optimizer-bytes": args.optimizer_bytes,
        "--kv-gib": args.kv_gib,
    }
    for flag, value in at_least_zero.items():
        if value is not None and not value >= 0:
            raise CostInputError(f"{flag} {value}: must be 0 or more")
    if not 0 < args.fabric_efficiency <= 1:
        raise CostInputError(
            f"--fabric-efficiency {args.fabric_efficiency}: a share, greater than 0 and at most 1"
        )


def _measured_row(args: argparse.Namespace) -> MeasuredRow | None:
    if args.results is None:
        for flag, value in (
            ("--row-path", args.row_path),
            ("--row-size-mib", args.row_size_mib),
            ("--row-receivers", args.row_receivers),
        ):
            if value is not None:
                raise CostInputError(f"{flag} {value}: picks a row of --results, and no --results was given")
        return None
    rows = read_rows(Path(args.results))
    return pick_row(rows, args.results, args.row_path, args.row_size_mib, args.row_receivers)


def _check_one_time_source(args: argparse.Namespace) -> None:
    given = [
        flag
        for flag, value in (
            ("--sync-s", args.sync_s),
            ("--results", args.results),
            ("--throughput-gbs", args.throughput_gbs),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise CostInputError(f"{' and '.join(given)}: give one source of the sync time, not {len(given)}")


def _sync_time(args, model: Model | None, row: MeasuredRow | None) -> tuple[float, str] | None:
    """The sync's seconds per step and where they came from, or None when no time source was given."""
    if args.sync_s is not None:
        return args.sync_s, f"given, --sync-s {args.sync_s:g}"
    if row is not None and model is None:
        return row.time_s, f"measured, the row {row.describe()}"
    if row is not None:
        seconds = model.weights / (row.gbs * GB)
        return (
            seconds,
            f"W {model.weights / GB:.2f} GB / {row.gbs:.4g} GB/s, the rate of the row {row.describe()}",
        )
    if args.throughput_gbs is not None:
        if model is None:
            raise CostInputError(
                f"--throughput-gbs {args.throughput_gbs:g}: needs --params to turn a rate into a time"
            )
        seconds = model.weights / (args.throughput_gbs * GB)
        return seconds, f"W {model.weights / GB:.2f} GB / {args.throughput_gbs:g} GB/s (--throughput-gbs)"
    return None


def _billing_gaps(args: argparse.Namespace, seconds: float) -> str:
    """What a time to bill still needs (the GPUs that wait on it, the steps that pay it); '' if nothing."""
    for flag, value, why in (
        ("--gpus", args.gpus, "how many GPUs the job holds, each waiting on it"),
        ("--steps", args.steps, "how many steps the run takes"),
    ):
        if value is None:
            return f"{flag} is needed to bill {fmt_s(seconds)} per step: {why}"
    return ""


def build_report(args: argparse.Namespace) -> Report:
    _check_ranges(args)
    _check_one_time_source(args)
    model = None
    if args.params is not None:
        model = Model(parse_params(args.params), args.weight_bytes, args.grad_bytes, args.optimizer_bytes)
    row = _measured_row(args)
    sync = _sync_time(args, model, row)
    pause = None if args.pause_s is None else (args.pause_s, f"given, --pause-s {args.pause_s:g}")
    bills, notes = [], []
    for what, timed in (("sync", sync), ("pause", pause)):
        if timed is None:
            continue
        missing = _billing_gaps(args, timed[0])
        if missing and model is None:
            raise CostInputError(missing)
        if missing:  # the placement stands on its own; the bill waits for what it needs
            notes.append(f"{what} not billed: {missing}")
        else:
            bills.append(Bill(what, *timed, args.gpus, args.steps, args.price))
    if sync is not None and pause is not None and pause[0] < sync[0]:
        notes.append(
            f"--pause-s {args.pause_s:g} is shorter than the sync ({sync[0]:.4g} s) it is paused around"
        )
    if row is not None and row.ceiling_kind != "device-copy" and model is not None:
        notes.append(
            f"the collocated rate is {row.describe()}: not a same-GPU CUDA IPC row (ceiling device-copy)"
        )
    plan = None
    if model is not None:
        rate, source = (row.gbs, row.label()) if row else (args.throughput_gbs, "--throughput-gbs")
        cluster = Cluster(
            args.gpu_mem_gib,
            args.kv_gib,
            args.fabric_gbps,
            args.fabric_efficiency,
            args.links,
            args.replicas,
            args.trainer_gpus,
            rate,
            source,
        )
        plan = plan_placement(model, cluster)
    if not bills and plan is None:
        raise CostInputError(
            "nothing to cost: give --sync-s, --results, or --throughput-gbs with --params (a sync time), "
            "--pause-s, or --params (placement advice)"
        )
    return Report(bills, plan, args.steps, args.price, notes)


def placement_bill(p: Placement, steps: int | None, price: float | None) -> dict:
    """A placement's sync billed like Bill: every GPU it holds waits on its sync, every step."""
    per_step = p.gpu_seconds_per_step()
    per_run = None if per_step is None or steps is None else gpu_hours(p.sync_s, p.gpus, steps)
    return {
        "gpu_seconds_per_step": per_step,
        "gpu_hours_per_run": per_run,
        "money_per_run": None if per_run is None or price is None else per_run * price,
    }


def report_json(report: Report) -> dict:
    plan = report.plan
    placement = None
    if plan is not None:
        placement = {
            "lines": [dataclasses.asdict(line) for line in plan.lines],
            "advice": plan.advice,
            "caveat": CAVEAT,
        }
        for p in (plan.collocated, plan.disaggregated):
            placement[p.name] = dataclasses.asdict(p) | placement_bill(p, report.steps, report.price)
    return {
        "bills": [b.to_json() for b in report.bills],
        "placement": placement,
        "notes": report.notes,
    }


def _or_dash(value, fmt) -> str:
    return "–" if value is None else fmt(value)


def _table(title: str, columns: tuple[str, ...] = (), left: tuple[str, ...] = ()):
    """A rich table in the cost report's style, with `columns` right-justified (the figures) but those in
    `left` (the names)."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def bills_table(report: Report):
    table = _table(
        "sync overhead: seconds × GPUs held × steps",
        (
            "what",
            "s / step",
            "GPUs",
            "steps",
            "GPU-s / step",
            "GPU-h / step",
            "GPU-h / run",
            "$ / step",
            "$ / run",
        ),
        left=("what",),
    )
    for b in report.bills:
        table.add_row(
            b.what,
            f"{b.seconds:.4g}",
            str(b.gpus),
            str(b.steps),
            f"{b.gpu_seconds_per_step:.4g}",
            f"{b.gpu_hours_per_step:.4g}",
            f"{b.gpu_hours_per_run:.4g}",
            _or_dash(b.money(b.gpu_hours_per_step), fmt_money),
            _or_dash(b.money(b.gpu_hours_per_run), fmt_money),
        )
    return table


def lines_table(plan: Plan):
    table = _table("placement arithmetic")
    table.add_column("step", no_wrap=True)
    table.add_column("arithmetic", overflow="fold")
    table.add_column("result", no_wrap=True)
    for line in plan.lines:
        table.add_row(line.what, line.arithmetic, line.result)
    return table


def placements_table(report: Report):
    table = _table(
        "placements",
        ("placement", "GPUs", "fullest GPU", "sync / step", "GPU-s / step", "GPU-h / run", "$ / run", "how"),
        left=("placement", "how"),
    )
    for p in (report.plan.collocated, report.plan.disaggregated):
        bill = placement_bill(p, report.steps, report.price)
        table.add_row(
            p.name,
            "does not fit" if p.gpus is None else str(p.gpus),
            _or_dash(p.fullest_gpu_gib, lambda g: f"{g:.2f} GiB"),
            _or_dash(p.sync_s, fmt_s),
            _or_dash(bill["gpu_seconds_per_step"], lambda v: f"{v:.4g}"),
            _or_dash(bill["gpu_hours_per_run"], lambda v: f"{v:.4g}"),
            _or_dash(bill["money_per_run"], fmt_money),
            p.how,
        )
    return table


def render(report: Report, file=None) -> None:
    """The report as rich tables, each figure's arithmetic beside it."""
    from rich.console import Console

    console = Console(file=file or sys.stdout, width=120, highlight=False)
    if report.bills:
        console.print(bills_table(report))
        for b in report.bills:
            console.print(f"  {b.what} per step: {b.source}", markup=False, soft_wrap=True)
            console.print(f"  {b.arithmetic}", markup=False, soft_wrap=True)
    if report.plan is not None:
        console.print(lines_table(report.plan))
        console.print(placements_table(report))
        console.print(f"Advice: {report.plan.advice}", markup=False, soft_wrap=True)
        console.print(CAVEAT, markup=False, style="dim", soft_wrap=True)
    for note in report.notes:
        console.print(f"note: {note}", markup=False, soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    """`weightsync cost`: 0 with the figures on stdout, 2 (usage error) for a value it cannot use."""
    try:
        report = build_report(args)
    except CostInputError as exc:
        print(f"usage error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report_json(report), indent=2, sort_keys=True))
    else:
        render(report)
    return 0
