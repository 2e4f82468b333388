"""`cb profile`: time real steps of a model on this machine and fit the simulator's cost model.

The profile (JSON) records the fitted step-time model, its fit error, and the
hardware, model, dtype, backend and thread count it was measured with;
``cb simulate --profile FILE`` reads it. ``cb profile --check`` times nothing:
it prints how well each measured GPU profile reproduces rows held out of its
own table.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from cbcore.cli.main import CLIError

if TYPE_CHECKING:
    from cbcore.sim.profile import Profile


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = sub.add_parser(
        "profile",
        parents=[common],
        help="time real steps over a grid of step shapes and fit a step-time model",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--out", default="profile.json", metavar="FILE", help="where to write the profile")
    parser.add_argument("--backend", metavar="NAME", help="attention backend (default: the config's)")
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds, for tests and checks)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--refit",
        nargs="+",
        metavar="FILE",
        help="time nothing: fit the steps recorded in these profiles again (after the model form changed, "
        "or to join profiles of one machine taken at different times)",
    )
    parser.add_argument(
        "--check",
        nargs="*",
        metavar="NAME",
        help="time nothing: print the held-out error of the measured GPU profiles (all, or those named), "
        "per operator and per layer, beside the fitted roofline's",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write the profile even when its held-out fit error is above the threshold "
        "(cbcore.sim.profile.MAX_HOLDOUT_ERROR, 25 %%)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.check is not None:
        return check(args.check)
    if args.refit:
        return refit(args.refit, args.out, args.force)
    import torch

    from cbcore.cli.common import engine_config
    from cbcore.engine import Engine
    from cbcore.models.default_model import MODEL_NAME
    from cbcore.models.loading import load_model_and_tokenizer
    from cbcore.sim.profiler import FULL, QUICK, make_profile, profile_config

    if args.threads is not None:
        if args.threads < 1:
            raise CLIError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    extra = {"backend": {"name": args.backend}} if args.backend else None
    grid = QUICK if args.quick else FULL
    config = profile_config(engine_config(args, extra), grid)
    model, tokenizer = load_model_and_tokenizer(config.model.path, config.model)
    engine = Engine(model, tokenizer, config)
    name = config.model.path or MODEL_NAME

    def note(what: str) -> None:
        print(f"profile: {what}", file=sys.stderr, flush=True)

    profile = make_profile(engine, name, grid, seed=args.seed, progress=note)
    retry = (
        "nothing was written. Run `cb profile` again when the machine is quiet (stop other jobs; "
        "--threads below the number of idle cores), or pass --force to write it anyway"
    )
    write(profile, args.out, retry, args.force)
    return 0


def write(profile: Profile, out: str, retry: str, force: bool) -> None:
    """Save ``profile`` unless its fit is too poor to price a simulation (and ``force`` is not set)."""
    summarize(profile, out)
    problem = profile.unreliable(f"profile {out}", retry)
    if problem is not None and not force:
        raise CLIError(problem)
    if problem is not None:
        print(f"cb: warning: {problem.split(';')[0]}; written anyway (--force)", file=sys.stderr)
    profile.save(out)


def check(names: list[str]) -> int:
    from cbcore.sim.gpu import check as gpu_check
    from cbcore.sim.gpu.catalog import CatalogError, all_specs, parse

    specs = []
    for name in names:
        try:
            spec = parse(name)
        except CatalogError as exc:
            raise CLIError(f"--check {name}: {exc}") from None
        if spec is None:
            raise CLIError(f"--check {name}: not a measured GPU profile (e.g. a100-llama-2-7b-tp1)")
        specs.append(spec)
    rows = gpu_check.check_all(specs or all_specs())
    print("Held-out error of the measured GPU profiles (%; every fourth token count held out, the curves rebuilt")
    print("without it): each operator, the whole layer (its operators summed), the four linear products beside")
    print("the fitted roofline's error on them, the all-reduce (every fourth message size), and the extrapolation")
    print("rule (tables cut at half their token range, the rest predicted).\n")
    print(gpu_check.table(rows))
    print("\n" + gpu_check.summary(rows))
    return 0


def refit(sources: list[str], out: str, force: bool = False) -> int:
    from cbcore.sim.fitted import FittedCost
    from cbcore.sim.fitted import refit as refit_cost
    from cbcore.sim.profile import ProfileError, load_profile

    profiles = []
    for source in sources:
        try:
            profile = load_profile(source)
        except ProfileError as exc:
            raise CLIError(str(exc)) from None
        if not isinstance(profile.cost, FittedCost) or not profile.cost.steps:
            raise CLIError(f"--refit {source}: not a measured profile with recorded steps")
        profiles.append(profile)
    first = profiles[0]
    for source, other in zip(sources[1:], profiles[1:], strict=True):
        for field in ("hardware", "model", "dtype", "backend", "backend_variant", "threads", "linear", "forward"):
            mine, theirs = getattr(first.identity, field), getattr(other.identity, field)
            if mine != theirs:
                raise CLIError(
                    f"--refit {source}: measured with {field} {theirs!r}, {sources[0]} with {mine!r}; "
                    "only profiles of the same machine and set-up fit one model"
                )
    profile = first.model_copy(update={"cost": refit_cost(*(p.cost for p in profiles))})
    retry = "nothing was written. Time the steps again on a quiet machine, or pass --force to write it anyway"
    write(profile, out, retry, force)
    return 0


def summarize(profile: Profile, out: str) -> None:
    fit = profile.cost.fit  # type: ignore[union-attr]
    held = f"{100 * fit.holdout_mean_abs:.1f} %" if fit.holdout_mean_abs is not None else "-"
    ident = profile.identity
    print(
        f"{out}: {fit.num_steps} steps of {ident.model} ({ident.dtype}, {ident.backend}, "
        f"{ident.threads} threads) on {ident.hardware}; mean step-time error "
        f"{100 * fit.mean_abs:.1f} % (held out: {held}), p90 {100 * fit.p90_abs:.1f} %"
    )
