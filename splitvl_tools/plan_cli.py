"""``splitvl plan``'s command line: ``--calibrate`` (:mod:`splitvl_tools.plan_measure`),
``--profile`` (the search of :mod:`splitvl_tools.plan`) and ``--validate``. Its own
module so that the model never imports the measurement, which imports the model."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from splitvl_tools.plan import Profile, Workload, answer, plan, print_plan

#: The lowest --rate served, requests/s (one request in about 17 minutes).
MIN_RATE = 0.001


def _sides(text: str) -> dict[int, float]:
    """``128`` or ``128:3,256:1`` -> {side: weight}."""
    out: dict[int, float] = {}
    for item in text.split(","):
        side, _, weight = item.partition(":")
        try:
            out[int(side)] = float(weight or 1.0)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--sides {text!r}: expected SIDE[:WEIGHT],... e.g. 128:3,256:1"
            ) from None
        if not math.isfinite(out[int(side)]) or out[int(side)] <= 0 or int(side) <= 0:
            raise argparse.ArgumentTypeError(
                f"--sides {text!r}: sides and weights must be finite and > 0"
            )
    return out


def _rate(text: str) -> float:
    """Arrivals per second: finite, at least ``MIN_RATE`` (below it the simulated times
    vanish in the float rounding of the gaps)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate {text!r}: expected requests/s") from None
    if not math.isfinite(value) or value < MIN_RATE:
        raise argparse.ArgumentTypeError(
            f"--rate {text!r}: expected a finite rate >= {MIN_RATE} requests/s"
        )
    return value


def _fractions(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers like 0.35,0.65") from None
    if not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each utilisation must be in (0, 1)")
    return values


def main(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.validate:
        from splitvl_tools.plan_measure import validate

        t0 = time.perf_counter()
        result = validate(
            model=args.model,
            utilisations=args.utilisations,
            side=min(args.sides),
            max_tokens=args.max_tokens,
            repeat_fraction=args.repeat_fraction,
            duration_s=args.duration,
            decoders=args.decoders,
            seed=args.seed,
            log=log,
            p95_ttft_ms=args.p95_ttft_ms,
        )
        result["command"] = " ".join(["splitvl", "plan", *sys.argv[2:]])
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result) if args.json else _validation_table(result))
        return 0
    if args.calibrate:
        from splitvl_tools.cluster import own_cluster
        from splitvl_tools.plan_measure import calibrate, processes

        with own_cluster(model=args.model, log_dir=None, prefix="splitvl-plan-", log=log) as own:
            ports = own.cluster.ports
            profile = calibrate(
                ports.address("gateway"),
                [ports.metrics[n] for n in own.cluster.instances("encoder")],
                sides=sorted(args.sides),
                max_tokens=args.max_tokens,
                seed=args.seed,
                log=log,
                processes=processes(own.cluster),
            )
            own.ok = True
        Path(args.calibrate).write_text(profile.to_json())
        log(f"profile written to {args.calibrate}")
        return 0
    if not args.profile or args.rate is None or args.p95_ttft_ms is None:
        print(
            "splitvl plan: give --profile FILE --rate R --p95-ttft-ms T "
            "(or --calibrate FILE, or --validate)",
            file=sys.stderr,
        )
        return 2
    try:
        profile = Profile.from_json(Path(args.profile).read_text())
    except (OSError, ValueError) as err:
        print(f"splitvl plan: cannot read --profile {args.profile}: {err}", file=sys.stderr)
        return 2
    workload = Workload(args.rate, args.sides, args.repeat_fraction, args.max_tokens)
    try:
        candidates = plan(
            profile,
            workload,
            p95_ttft_ms=args.p95_ttft_ms,
            max_replicas=args.max_replicas,
            host_cores=args.host_cores,
        )
    except ValueError as err:
        print(f"splitvl plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        best = answer(candidates)
        print(
            json.dumps(
                {
                    "answer": asdict(best) if best else None,
                    "candidates": [asdict(c) for c in candidates],
                }
            )
        )
    else:
        print_plan(candidates, args.p95_ttft_ms, sys.stdout)
    return 0


def _validation_table(result: dict[str, Any]) -> str:
    lines = [
        f"decoders: {result['decoders']}",
        "| utilisation | rate | TTFT p50 ms pred / meas | TTFT p95 ms pred / meas "
        "| req/s pred / meas (1.00 by construction) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in result["runs"]:
        p, m = row["predicted"], row["measured"]
        lines.append(
            f"| {row['utilisation']:.2f} | {row['rate']:g} "
            + " | ".join(
                f"{p[k]:g} / {m[k]} ({row['ratio'][k]}x)"
                for k in ("ttft_p50_ms", "ttft_p95_ms", "req_per_s")
            )
            + " |"
        )
    lines += ["", result["req_per_s_note"], "", "replica counts (p95 TTFT SLO):"]
    for row in result["runs"]:
        lines.append(f"  utilisation {row['utilisation']:.2f}: {_replicas_line(row['replicas'])}")
    return "\n".join(lines)


def _replicas_line(check: dict[str, Any]) -> str:
    """One line of :func:`splitvl_tools.plan_measure.check_replicas`'s answer."""

    def name(r: dict[str, Any]) -> str:
        return f"{r['encoder']}e/{r['decoder']}d/{r['cache']}c"

    replayed = check["ran_replay"]
    ran = (
        f"ran {name(check['ran'])}: planner says "
        f"{'meets' if check['planner_says_ran_meets'] else 'misses'}, measured "
        f"{'meets' if check['ran_meets'] else 'misses'} "
        f"({'agrees' if check['agrees'] else 'DISAGREES'}); replayed p95 "
        f"{replayed['ttft_p95_ms']:g} ms, {replayed['req_per_s']:g} req/s "
        f"({'matches' if check['search_matches_replay'] else 'DIFFERS FROM'} the search)"
    )
    if check["recommended"] is None:
        return f"SLO {check['p95_ttft_ms']:g} ms: no configuration meets it; {ran}"
    replay = ", ".join(
        f"{name(r)} p95 {r['ttft_p95_ms']:g} ms {'meets' if r['meets'] else 'misses'}"
        for r in check["replay"]
    )
    minimal = "minimal" if check["minimal"] else "NOT minimal"
    return (
        f"SLO {check['p95_ttft_ms']:g} ms: recommends {name(check['recommended'])}; "
        f"on the run's arrivals {replay} ({minimal}); {ran}"
    )


def add_parser(sub: Any) -> None:
    from splitvl.argtypes import fraction, non_negative_int, positive_float, positive_int

    p = sub.add_parser("plan", help="replicas for a load: simulate measured service times")
    p.add_argument("--profile", help="service times from --calibrate (JSON)")
    p.add_argument("--calibrate", metavar="FILE", help="measure a fresh cluster, write FILE")
    p.add_argument("--validate", action="store_true", help="predicted vs measured open-loop runs")
    p.add_argument("--rate", type=_rate, help="arrivals, requests/s")
    p.add_argument(
        "--p95-ttft-ms",
        type=positive_float,
        help="the target, ms (--validate: the SLO of its replica check; default twice the "
        "TTFT p50 predicted with no queueing)",
    )
    p.add_argument(
        "--sides", type=_sides, default={128: 1.0}, help="image sides and weights: 128:3,256:1"
    )
    p.add_argument("--repeat-fraction", type=fraction, default=0.5)
    p.add_argument("--max-tokens", type=positive_int, default=32, help="output tokens")
    p.add_argument("--max-replicas", type=positive_int, default=4, help="per service")
    p.add_argument(
        "--host-cores",
        type=non_negative_int,
        default=0,
        help="every replica on one host of N cores, sharing them (0: each on its own)",
    )
    p.add_argument(
        "--utilisations",
        type=_fractions,
        default=[0.35, 0.65],
        help="--validate: loads as the busiest service's predicted utilisation",
    )
    p.add_argument("--duration", type=positive_float, default=60.0, help="--validate: s per load")
    p.add_argument("--decoders", type=positive_int, default=1, help="--validate: replicas")
    p.add_argument("--model", help="checkpoint (default: the tiny one)")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--out", help="--validate: also write the JSON here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
