"""Study "scale": DiLoCo beyond two machines (issue 52), on the lm study's protocol.

The lm study's model, data and budget (configs/lm_tiny.py's transformer on this
Python's standard library, 8 workers, 2,048 tokens a machine... 16,384 tokens a step
in all, 2,000 steps, Adam 8e-3 with warm-up and cosine), its tuned data-parallel
baseline (the fp32 all-reduce, 3 seeds: the same 8 workers' mean whatever the machine
count, so one baseline serves 2, 4 and 8 machines) and its 2-machine recipe
(configs/lm_study.py: H=10, the 4-bit min-max exchange with error feedback, outer
Nesterov 0.7 / 0.6 warmed up over the first 200 steps). What changes is the number
of machines at the same tokens per step: 4 machines x 2 workers and 8 x 1.

1. 4 machines, tuned as the field tunes: the outer learning rate x the outer momentum
   jointly (3 x 3 at seed 0, a winning edge extended), at H=10, its winner over 3
   seeds; then (after 2 and 3, which build on H=10's winner) the same at H=5 on a
   lower grid (the momentum warm-up over the same 200 steps).
2. Muon as the inner optimizer (MuLoCo, arXiv 2505.23725): the all-reduce with Muon,
   its learning rate swept, beside the all-reduce with Adam; DiLoCo with Muon on 4
   machines at H=10's tuned outer step, its learning rate swept; the winner over 3
   seeds counts against the better of the two baselines.
3. A lever of the literature with its ablation: the outer momentum decayed to 0 over
   the last tenth or quarter of the rounds at H=10's winner (Pier, arXiv 2511.17849,
   warms the outer momentum up and decays it; the recipe already warms it up). A
   second at the best 4-machine recipe (Muon inside): a slow outer momentum (0.9,
   0.95) mixed into the outer step at weight 0.25 or 0.5 beside the fast one, at the
   same steady gain (MT-DAO, arXiv 2510.05361: slow and fast moments side by side).
   Then (3e) the best 4-machine recipe re-tuned at its best batch (x0.125: 8x the
   rounds, each on 8x fewer tokens): the outer lr, the outer momentum, Muon's rate and
   H one at a time at seed 0, the all-reduce's rate swept there too; what beats the
   recipe (together, if several) over 3 seeds at 4 and 8 machines.
4. 8 machines x 1: the 2-machine recipe and the best 4-machine recipe (Muon inner)
   over 3 seeds each; then that recipe's outer learning rate swept again, a new winner
   over 3 seeds.
5. H=10's winner on configs/lm_small.py (1.29M parameters), 3 seeds, beside the lm
   study's runs there (13-18 min a run); and at seed 0 the all-reduce with Muon and
   the best 4-machine recipe (Muon inner) there, at lm_tiny's Muon rates.

Long: each run of lm_tiny takes about 3.5 min alone on 2 cores; runs already in
docs/experiments.json (the lm study's 4-machine outer sweep and its baselines) count
with --keep-published.
"""

from __future__ import annotations

from bench.experiments import scale_tables
from bench.experiments.lm import ALLREDUCE
from bench.experiments.lm import DILOCO
from bench.experiments.lm import EF4
from bench.experiments.lm import HEADLINE_DILOCO
from bench.experiments.lm import TUNED
from bench.experiments.lm import headline_config
from bench.experiments.lm import label
from bench.experiments.lm import lm_config
from bench.experiments.lm import seeds
from bench.experiments.lm import tune
from bench.experiments.runner import Runner
from configs import default
from configs import lm_small
from configs import lm_study
from configs import lm_tiny

STUDY = "scale"
DEFAULT_MUON_BETA = default.get_config().muon_beta
# The 2-machine recipe (configs/lm_study.py): the inner rate, H=10 and the outer step.
RECIPE = dict(
    learning_rate=lm_study.get_config().learning_rate,
    local_steps=lm_study.get_config().local_steps,
    outer_lr=lm_study.get_config().outer_lr,
    outer_momentum=lm_study.get_config().outer_momentum,
    outer_warmup_rounds=lm_study.get_config().outer_warmup_rounds,
)
# The momentum warm-up lasts 200 steps whatever H.
WARMUP_STEPS = RECIPE["outer_warmup_rounds"] * RECIPE["local_steps"]
OUTER_LR_GRID = (0.7, 1.0, 1.4)
OUTER_MOMENTUM_GRID = (0.6, 0.8, 0.9)
# H=5 steps out twice as often: its grid sits lower, around its first runs (0.7 / 0.6
# ended 2.2706 and 0.7 / 0.8 2.3683, where H=10 liked 0.8 and 1.0-1.4 diverged there).
H5_GRIDS = {"outer_lr": (0.5, 0.7, 1.0), "outer_momentum": (0.4, 0.6, 0.8)}
H_VALUES = (10, 5)
MUON_LR_GRID = (0.01, 0.02, 0.04)
EIGHT_OUTER_LR_GRID = (0.7, 1.0, 1.4)
# The lever's ablation: the outer momentum decayed over these parts of the rounds.
DECAY_PARTS = (0.1, 0.25)
# The second lever's grid: the slow outer momentum and its weight in the outer step.
SLOW_MOMENTA = (0.9, 0.95)
SLOW_WEIGHTS = (0.25, 0.5)
# The batch per machine count: the batch times these, the steps over them (equal tokens).
BATCH_FACTORS = (0.5, 2.0)
# Muon's own momentum inside DiLoCo (0.95 the recipe's, configs/default.py).
MUON_BETAS = (0.9, 0.98)


def batch_config(factor: float):
    """The study's recipe with `factor` x the batch and 1 / `factor` x the steps (the
    same tokens); the learning rate's warm-up stays a twentieth of the steps."""

    def base(quick: bool):
        steps = lm_config(quick).num_steps
        # (A quick run is a smoke test of the plan: its few steps whatever the batch.)
        config = lm_study.recipe(lm_tiny.get_config(), steps if quick else int(steps / factor))
        config.batch_size = int(lm_tiny.get_config().batch_size * factor)
        config.log_every = max(1, config.log_every)  # (a quick run's few steps)
        return config

    return base


def momentum_step(value: float, direction: int) -> float:
    """The next outer momentum past a grid's edge: 1 - momentum halved or doubled (at
    least 0)."""
    return max(0.0, round(1 - (1 - value) * (0.5 if direction > 0 else 2.0), 4))


EXTEND = {"outer_lr": 1.4, "outer_momentum": momentum_step}


def batch_runs(
    runner, out: dict, muon_ar: dict, muon_setting: dict, muon: dict, grid, study
) -> None:
    """1b of `plan`: the batch sweep of the Muon all-reduce and the Muon recipe, into `out`."""
    ar_setting = ALLREDUCE | muon | muon_ar
    factors = sorted(grid(BATCH_FACTORS))

    def run(kind: str, factor: float, count: int = 1):
        if factor == 1.0:  # the recipe's own batch: its runs above
            return out.get("muon allreduce" if kind == "allreduce" else "muon diloco")
        if kind == "allreduce":
            title, setting = label(f"all-reduce fp32 Muon, batch x{factor:g}", muon_ar), ar_setting
        else:
            title = label(f"{name(4, 10, ', Muon inner')}, batch x{factor:g}", shown(muon_setting))
            setting = muon_setting
        return seeds(runner, title, setting, count=count, base=batch_config(factor), **study)

    def best(kind: str) -> float | None:
        done = {f: out.get(f"batch x{f:g} {kind}") for f in [*factors, 1.0]}
        done = {f: r for f, r in done.items() if r}
        if len(done) < len(factors) + 1:
            return None
        return min(done, key=lambda f: scale_tables.score(done[f][0]))

    for attempt in range(3):
        for factor in factors:
            for kind in ("allreduce", "diloco"):
                out[f"batch x{factor:g} {kind}"] = run(kind, factor)
        out["batch x1 allreduce"], out["batch x1 diloco"] = (
            run("allreduce", 1.0),
            run("diloco", 1.0),
        )
        winners = {best("allreduce"), best("diloco")} - {None}
        grew = [f for f in (min(factors) / 2, max(factors) * 2)
                if (f < min(factors) and min(factors) in winners)
                or (f > max(factors) and max(factors) in winners)]  # fmt: skip
        if not grew or runner.quick or attempt == 2:  # (a grown edge is run before it counts)
            break
        factors = sorted([*factors, *grew])
    out["batch factors"] = factors
    for kind in ("allreduce", "diloco"):
        factor = best(kind)
        if factor is not None and factor != 1.0:
            out[f"batch {kind} best"] = run(kind, factor, count=3)
            out[f"batch {kind} best factor"] = factor
    factor = out.get("batch diloco best factor")
    if factor is not None:
        eight = muon_setting | {"machines": 8}
        out["batch 8 machines"] = seeds(
            runner, label(f"{name(8, 10, ', Muon inner')}, batch x{factor:g}", shown(eight)),
            eight, base=batch_config(factor), **study,
        )  # fmt: skip


# 3e. The recipe re-tuned at its best batch, one field at a time (seed 0): its grids,
# each centred on the recipe's value; H below 5 would send more than 1/16 of the
# all-reduce's bytes on 4 machines (H=5: 1/16), so H grows only upward past its edge.
RETUNE_GRIDS = {
    "outer_lr": (0.5, 0.7, 1.0),
    "outer_momentum": (0.6, 0.8, 0.9),
    "learning_rate": (0.005, 0.01, 0.02),
}
RETUNE_H = (5, 10, 20)
# 8 machines send 1.8x the bytes a worker of 4 machines' (1/18 of the all-reduce's at
# H=10): below H=10 they would pass the 1/16 budget.
EIGHT_MIN_H = 10


def with_h(setting: dict, h: int) -> dict:
    """`setting` at H=`h`, its momentum warm-up over the same steps."""
    return setting | {"local_steps": h, "outer_warmup_rounds": WARMUP_STEPS // h}


def h_sweep(runner, title, setting: dict, base, hs=RETUNE_H, study=STUDY) -> tuple:
    """`setting` at each H of `hs` (seed 0; the momentum warm-up over the same steps), a
    winning top edge doubled (twice at most). Returns (the best H or None while a run
    is missing, {H: record})."""
    hs, records = list(hs), {}
    for _ in range(3):
        for h in hs:
            if h not in records:
                runs = seeds(runner, title(h), with_h(setting, h), count=1, base=base, study=study)
                records[h] = runs[0] if runs else None
        if any(r is None for r in records.values()):
            return None, records
        best = min(records, key=lambda h: scale_tables.score(records[h]))
        if best != hs[-1]:
            break
        hs.append(2 * hs[-1])
    records[best]["sweep_winner"] = f"{title(best)}: local_steps"
    return best, records


def retune(
    runner, out: dict, setting: dict, ar: dict, factor: float, ar_factor: float, grid, study
) -> None:
    """3e of `plan`: the recipe (`setting`, Muon inner) re-tuned at the batch x`factor`,
    one field at a time at seed 0, and the all-reduce's rate (`ar`, the best baseline's
    setting) swept at its own best batch (x`ar_factor`), into `out`. The fields that beat the recipe's seed 0 go
    together (seed 0), the better of that and the best single field over 3 seeds, at 4
    machines and at 8 (H at least EIGHT_MIN_H there), and the best at 2 machines."""
    base = batch_config(factor)
    batch = f", Muon inner, batch x{factor:g}"
    recipe = out.get(f"batch x{factor:g} diloco")
    winners, complete = {}, True
    for field, values in RETUNE_GRIDS.items():
        grids = {field: grid(values)}
        extend = {field: EXTEND.get(field, 2.0)}
        best, out[f"retune {field} sweep"] = tune(
            runner, name(4, 10, batch), without(setting, grids), grids, extend, base=base, **study
        )
        complete &= best is not None
        if best is not None and best[field] != setting[field]:
            winners[field] = best[field]
    h, out["retune H sweep"] = h_sweep(
        runner, lambda h: label(name(4, h, batch), shown(setting)), setting, base,
        hs=grid(RETUNE_H), **study,
    )  # fmt: skip
    complete &= h is not None
    if h is not None and h != setting["local_steps"]:
        winners["local_steps"] = h
    rates = {"learning_rate": grid(MUON_LR_GRID)}
    ar_title = f"all-reduce fp32 Muon, batch x{ar_factor:g}, muon_beta={ar['muon_beta']:g}"
    ar_base = batch_config(ar_factor)
    best, out["retune allreduce sweep"] = tune(
        runner, ar_title, without(ar, rates), rates, {"learning_rate": 2.0}, base=ar_base,
        **study,
    )  # fmt: skip
    if best is not None and best["learning_rate"] != ar["learning_rate"]:
        out["retune allreduce"] = seeds(
            runner, label(ar_title, best), ar | best, base=ar_base, **study
        )

    def fields_of(changes: dict) -> dict:
        s = setting | changes
        return with_h(s, s["local_steps"])

    def title_of(s: dict, machines: int = 4) -> str:
        return label(name(machines, s["local_steps"], batch), shown(s))

    def at_two(s: dict) -> None:
        """The 4-machine recipe `s` on 2 machines x 4 (the summary's 2-machine row)."""
        two = s | {"machines": 2}
        out["retune 2 machines"] = seeds(runner, title_of(two, 2), two, base=base, **study)

    if not recipe:
        return
    if not winners:
        if complete:  # the recipe won every sweep
            at_two(setting)
        return
    candidates = {k: fields_of({k: v}) for k, v in winners.items()}
    if len(winners) > 1:
        together = fields_of(winners)
        out["retune together seed 0"] = seeds(
            runner, title_of(together), together, count=1, base=base, **study
        )
        if not out["retune together seed 0"]:
            return
        candidates["together"] = together
    # (each one's seed 0 is a sweep's run, read back from the cache)
    first = {
        k: seeds(runner, title_of(s), s, count=1, base=base, **study) for k, s in candidates.items()
    }
    if not all(first.values()):
        return
    key = min(first, key=lambda k: scale_tables.score(first[k][0]))
    chosen = candidates[key]
    out["retune best from"] = key
    out["retune best"] = seeds(runner, title_of(chosen), chosen, base=base, **study)
    eight = with_h(chosen, max(chosen["local_steps"], EIGHT_MIN_H)) | {"machines": 8}
    out["retune 8 machines"] = seeds(runner, title_of(eight, 8), eight, base=base, **study)
    at_two(chosen)


def at(machines: int, h: int, **fields) -> dict:
    """DiLoCo 4-bit EF at `machines` x (8 / machines) workers and H=h, from the recipe."""
    setting = DILOCO | EF4 | RECIPE | {"machines": machines, "local_steps": h}
    setting["outer_warmup_rounds"] = WARMUP_STEPS // h
    if machines == 8:  # one worker a machine: nothing to split
        setting["shard_model"] = False
    return setting | fields


def without(setting: dict, grids: dict) -> dict:
    """`setting` less the fields `grids` sweeps (`tune` sets those)."""
    return {k: v for k, v in setting.items() if k not in grids}


def name(machines: int, h: int, extra: str = "") -> str:
    return f"DiLoCo H={h} 4-bit EF on {machines} machines x {8 // machines}{extra}"


def shown(setting: dict) -> dict:
    return {k: setting[k] for k in TUNED}


def lever(runner: Runner, runs: dict, base: list | None) -> tuple[dict, list | None]:
    """A lever's ablation: each of `runs` ({key: (label, setting)}) at seed 0; the best
    over 3 seeds if it ends below `base`'s seed 0. Returns ({key: its records}, the
    best's records or None)."""
    ablation = {k: seeds(runner, n, s, count=1, study=STUDY) for k, (n, s) in runs.items()}
    done = {k: r for k, r in ablation.items() if r}
    if not done or not base:
        return ablation, None
    key = min(done, key=lambda k: scale_tables.score(done[k][0]))
    if scale_tables.score(done[key][0]) >= scale_tables.score(base[0]):
        return ablation, None
    label_, setting = runs[key]
    return ablation, seeds(runner, label_, setting, study=STUDY)


def plan(runner: Runner) -> dict:
    """Every run of the study, in order of importance; pieces not trained yet are None."""
    quick = runner.quick
    grid = (lambda g: g[:1]) if quick else (lambda g: g)
    out: dict = {}
    study = dict(study=STUDY)
    # The baselines and the 2-machine recipe: the lm study's runs (3 seeds each).
    ar = {"learning_rate": lm_study.ALLREDUCE_LEARNING_RATE}
    # Found under the lm study's own label (its records predate the vocab_size field of
    # model_kwargs, so only the label finds them again), and listed under this study too.
    named = label("all-reduce fp32", ar)
    out["allreduce"] = seeds(runner, named, ALLREDUCE | ar, study="lm")
    if out["allreduce"]:
        runner.entries += [dict(r, study=STUDY) for r in out["allreduce"]]
    else:  # (a json whose copy under this study's name shadows the lm study's record)
        out["allreduce"] = seeds(runner, named, ALLREDUCE | ar, **study)
    two = at(2, 10)
    out["2 machines"] = seeds(runner, name(2, 10), two, **study)
    out["4 machines recipe"] = seeds(runner, name(4, 10), at(4, 10), **study)
    # 1. 4 machines: outer learning rate x outer momentum at H=10, its winner over 3
    # seeds, and (after the levers, which build on H=10's winner) the same at H=5.
    outer_grids = {"outer_lr": grid(OUTER_LR_GRID), "outer_momentum": grid(OUTER_MOMENTUM_GRID)}
    winners = {}

    def sweep(h: int) -> None:
        grids = outer_grids if h == 10 else {k: grid(v) for k, v in H5_GRIDS.items()}
        best, out[f"4 machines H={h} sweep"] = tune(
            runner, name(4, h), without(at(4, h), grids), grids, EXTEND, **study
        )
        if best is not None:
            winners[h] = best
            out[f"4 machines H={h} best"] = seeds(
                runner, label(name(4, h), shown(at(4, h, **best))), at(4, h, **best), **study
            )

    sweep(10)
    ten = at(4, 10, **winners[10]) if 10 in winners else None
    # 2. Muon inner: the all-reduce with Muon (each worker the whole model: Muon
    # orthogonalizes whole matrices), and DiLoCo with Muon on 4 machines at H=10's
    # tuned outer step.
    muon = {"optimizer": "muon", "shard_model": False}
    rates = {"learning_rate": grid(MUON_LR_GRID)}
    muon_ar, out["muon allreduce sweep"] = tune(
        runner, "all-reduce fp32 Muon", ALLREDUCE | muon, rates, {"learning_rate": 2.0}, **study
    )
    if muon_ar is not None:
        out["muon allreduce"] = seeds(
            runner, label("all-reduce fp32 Muon", muon_ar), ALLREDUCE | muon | muon_ar, **study
        )
    if ten is not None:
        muon_dl, out["muon diloco sweep"] = tune(
            runner, name(4, 10, ", Muon inner"), without(ten | muon, rates), rates,
            {"learning_rate": 2.0}, **study,
        )  # fmt: skip
        if muon_dl is not None:
            setting = ten | muon | muon_dl
            out["muon diloco setting"] = setting
            out["muon diloco"] = seeds(
                runner, label(name(4, 10, ", Muon inner"), shown(setting)), setting, **study
            )
    # 3. The lever: the outer momentum decayed to 0 over the last rounds (a tenth and a
    # quarter of them) at H=10's winner; the better, if it helps, over 3 seeds.
    if ten is not None:
        rounds = lm_config(quick).num_steps // 10
        decays = {}

        def decayed(decay: int) -> dict:
            # (A quick run's 2 rounds: the warm-up shortened to leave the decay room.)
            warm = min(ten["outer_warmup_rounds"], rounds - decay)
            return ten | {"outer_decay_rounds": decay, "outer_warmup_rounds": warm}

        def decay_name(decay: int) -> str:
            return label(name(4, 10, ", momentum decay"), shown(ten)) + (
                f", outer_decay_rounds={decay}"
            )

        for part in DECAY_PARTS[:1] if quick else DECAY_PARTS:
            decay = max(1, int(rounds * part))
            decays[decay] = (decay_name(decay), decayed(decay))
        out["decay ablation"], best = lever(runner, decays, out.get("4 machines H=10 best"))
        if best is not None:
            out["decay best"] = best
    # 4a. 8 machines x 1 at the best 4-machine recipe so far (DiLoCo with Muon inner at
    # H=10's tuned outer step), 3 seeds; its outer learning rate is swept last.
    muon_setting = out.get("muon diloco setting")
    eight_best = None
    if muon_setting is not None:
        eight_best = muon_setting | {"machines": 8}
        out["8 machines best"] = seeds(
            runner, label(name(8, 10, ", Muon inner"), shown(eight_best)), eight_best, **study
        )
    sweep(5)
    out["4 machines best"] = None
    if len(winners) == len(H_VALUES):
        sweeps = {h: out[f"4 machines H={h} sweep"] for h in H_VALUES}

        def seed0(h):
            values = tuple(winners[h][k] for k in outer_grids)
            return scale_tables.score(sweeps[h][values])

        h = min(H_VALUES, key=seed0)
        out["4 machines best"] = out[f"4 machines H={h} best"]
        out["4 machines best setting"] = at(4, h, **winners[h])
    # 4. 8 machines x 1: the 2-machine recipe over 3 seeds; and the outer learning rate
    # swept at 4a's recipe (its momentum, H and Muon), the winner over 3 seeds.
    out["8 machines recipe"] = seeds(runner, name(8, 10), at(8, 10), **study)
    if eight_best is not None:
        title = name(8, 10, ", Muon inner")
        fixed = without(eight_best, {"outer_lr": None})
        best, out["8 machines sweep"] = tune(
            runner, title, fixed, {"outer_lr": grid(EIGHT_OUTER_LR_GRID)}, {"outer_lr": 1.4},
            **study,
        )  # fmt: skip
        if best is not None and best["outer_lr"] != eight_best.get("outer_lr", RECIPE["outer_lr"]):
            setting = fixed | best
            out["8 machines tuned"] = seeds(runner, label(title, shown(setting)), setting, **study)
    # 2b. Last: the outer learning rate swept again under Muon (the outer step was tuned
    # for Adam's pseudo-gradients), at the momentum and H of 2; a new winner over 3 seeds.
    if muon_setting is not None:
        title = name(4, 10, ", Muon inner")
        fixed = without(muon_setting, {"outer_lr": None})
        best, out["muon outer sweep"] = tune(
            runner, title, fixed, {"outer_lr": grid(OUTER_LR_GRID)}, {"outer_lr": 1.4}, **study
        )
        if best is not None and best["outer_lr"] != muon_setting["outer_lr"]:
            setting = fixed | best
            out["muon outer best"] = seeds(runner, label(title, shown(setting)), setting, **study)
    # 3b. A second lever at the best 4-machine recipe (Muon inside, 0.7 / 0.8, H=10): a
    # slow outer momentum beside the fast one (MT-DAO's timescales), its momentum x its
    # weight at seed 0; the best, if it beats the recipe's seed 0, over 3 seeds.
    if muon_setting is not None:

        def slow_name(values: tuple) -> str:
            return label(name(4, 10, ", Muon inner, slow outer momentum"), shown(muon_setting)) + (
                f", outer_slow_momentum={values[0]:g}, outer_slow_weight={values[1]:g}"
            )

        def slowed(values: tuple) -> dict:
            return muon_setting | dict(
                zip(("outer_slow_momentum", "outer_slow_weight"), values, strict=True)
            )

        slows = {
            (b, w): (slow_name((b, w)), slowed((b, w)))
            for b in grid(SLOW_MOMENTA)
            for w in grid(SLOW_WEIGHTS)
        }
        out["slow ablation"], best = lever(runner, slows, out.get("muon diloco"))
        if best is not None:
            out["slow best"] = best
    # Each lever's winner over 3 seeds, by its key in `out`: the best goes to 8 machines.
    candidates: dict[str, dict] = {}
    # 2c. The outer momentum swept under Muon at the recipe's outer rate (2b swept the
    # rate at momentum 0.8; together the two axes around the winner), a new winner over
    # 3 seeds. 2d. Muon inner at H=5 (twice the exchanges: 1/16 of the all-reduce's
    # bytes) from H=5's tuned outer rate, its momentum swept; its winner over 3 seeds if
    # it beats the H=10 recipe's seed 0.
    if muon_setting is not None:
        title = name(4, 10, ", Muon inner")
        fixed = without(muon_setting, {"outer_momentum": None})
        momenta = {"outer_momentum": grid(OUTER_MOMENTUM_GRID)}
        best, out["muon momentum sweep"] = tune(
            runner, title, fixed, momenta, {"outer_momentum": momentum_step}, **study
        )
        if best is not None and best["outer_momentum"] != muon_setting["outer_momentum"]:
            setting = fixed | best
            candidates["muon momentum best"] = setting
            out["muon momentum best"] = seeds(
                runner, label(title, shown(setting)), setting, **study
            )
        if 5 in winners:
            title = name(4, 5, ", Muon inner")
            five = at(4, 5, outer_lr=winners[5]["outer_lr"]) | muon
            five["learning_rate"] = muon_setting["learning_rate"]
            momenta = {"outer_momentum": grid(H5_GRIDS["outer_momentum"])}
            best, out["muon h5 sweep"] = tune(
                runner, title, without(five, momenta), momenta,
                {"outer_momentum": momentum_step}, **study,
            )  # fmt: skip
            base = out.get("muon diloco")
            sweep = out["muon h5 sweep"]
            if best is not None and base:
                seed0 = scale_tables.score(sweep[(best["outer_momentum"],)])
                if seed0 < scale_tables.score(base[0]):
                    setting = five | best
                    candidates["muon h5 best"] = setting
                    out["muon h5 best"] = seeds(
                        runner, label(title, shown(setting)), setting, **study
                    )
    # 1b. The batch per machine count (seed 0): the all-reduce with Muon and the best
    # 4-machine recipe (Muon inner) at half and twice the batch, the same tokens, a
    # winning edge extended (twice at most); each one's best batch over 3 seeds, and 8
    # machines at DiLoCo's. The all-reduce at its best batch joins the baselines.
    if muon_setting is not None and muon_ar is not None:
        batch_runs(runner, out, muon_ar, muon_setting, muon, grid, study)
    # 3c. Muon's own momentum inside DiLoCo (its buffer is each machine's and survives
    # the rounds: a shorter memory forgets the other machines' pulls sooner), seed 0.
    if muon_setting is not None:
        betas = {
            beta: (
                label(name(4, 10, ", Muon inner"), shown(muon_setting)) + f", muon_beta={beta:g}",
                muon_setting | {"muon_beta": beta},
            )
            for beta in grid(MUON_BETAS)
        }
        out["muon beta ablation"], best = lever(runner, betas, out.get("muon diloco"))
        if best is not None:
            out["muon beta best"] = best
            beta = min(
                (b for b in betas if out["muon beta ablation"][b]),
                key=lambda b: scale_tables.score(out["muon beta ablation"][b][0]),
            )
            candidates["muon beta best"] = betas[beta][1]
    # 3d. The batch and Muon's momentum together: DiLoCo at its best batch with the best
    # muon_beta, 3 seeds, and 8 machines so; the all-reduce at its best batch with that
    # muon_beta (seed 0, 3 seeds if it beats its own best): the baseline swept as the
    # method is.
    factor = out.get("batch diloco best factor")
    if "muon beta best" in candidates and factor is not None:
        beta = candidates["muon beta best"]["muon_beta"]
        setting = muon_setting | {"muon_beta": beta}
        at_batch = dict(base=batch_config(factor), **study)
        title = f"{name(4, 10, ', Muon inner')}, batch x{factor:g}"
        out["combined"] = seeds(
            runner, label(title, shown(setting)) + f", muon_beta={beta:g}", setting, **at_batch
        )
        eight = setting | {"machines": 8}
        title = f"{name(8, 10, ', Muon inner')}, batch x{factor:g}"
        out["combined 8 machines"] = seeds(
            runner, label(title, shown(eight)) + f", muon_beta={beta:g}", eight, **at_batch
        )
        ar_factor = out.get("batch allreduce best factor", 1.0)
        ar = ALLREDUCE | muon | muon_ar | {"muon_beta": beta}
        ar_label = label(f"all-reduce fp32 Muon, batch x{ar_factor:g}", muon_ar)
        ar_label += f", muon_beta={beta:g}"
        at_batch = dict(base=batch_config(ar_factor), **study)
        first = seeds(runner, ar_label, ar, count=1, **at_batch)
        own = out.get("batch allreduce best") or out.get("muon allreduce")
        out["combined allreduce seed 0"] = first
        if first and own and scale_tables.score(first[0]) < scale_tables.score(own[0]):
            out["combined allreduce"] = seeds(runner, ar_label, ar, **at_batch)
    # 3e. The recipe re-tuned at its best batch (8x the rounds of the study's batch, each
    # on 8x fewer tokens: the outer step and Muon's rate were tuned for the other), and
    # the best baseline's rate swept at its own best batch too.
    if muon_setting is not None and factor is not None and muon_ar is not None:
        beta = (
            candidates["muon beta best"]["muon_beta"]
            if out.get("combined allreduce")
            else DEFAULT_MUON_BETA
        )
        ar = ALLREDUCE | muon | muon_ar | {"muon_beta": beta}
        ar_factor = out.get("batch allreduce best factor", 1.0)
        retune(runner, out, muon_setting, ar, factor, ar_factor, grid, study)
    # 4b. 8 machines x 1 at the best of the levers' winners (3 seeds' mean), if one
    # beats the recipe that 4a took there (Muon inner, H=10, outer 0.7 / 0.8).
    done = {
        k: out[k]
        for k in candidates
        if out.get(k) and len(out[k]) == len(out.get("muon diloco") or ())
    }
    if done and out.get("muon diloco"):
        key = min(done, key=lambda k: scale_tables.mean(done[k]))
        if scale_tables.mean(done[key]) < scale_tables.mean(out["muon diloco"]):
            eight = candidates[key] | {"machines": 8}
            out["8 machines lever"] = seeds(
                runner, label(name(8, eight["local_steps"], ", Muon inner"), shown(eight))
                + ("" if "muon_beta" not in eight else f", muon_beta={eight['muon_beta']:g}"),
                eight, **study,
            )  # fmt: skip
            out["8 machines lever from"] = key
    # 5. The H=10 winner on configs/lm_small.py (1.29M parameters) at its inner rate,
    # 3 seeds, beside the lm study's runs there (its all-reduce; 0.7 / 0.6 on 4 machines).
    if ten is not None and not quick:
        rate = {"learning_rate": lm_small.get_config().learning_rate}
        small = dict(base=headline_config)
        out["lm_small allreduce"] = seeds(
            runner, label("lm_small all-reduce fp32", rate), ALLREDUCE | rate, study="lm", **small
        )
        recipe = at(4, 10) | rate
        out["lm_small recipe"] = seeds(
            runner, label(f"{HEADLINE_DILOCO}, 4 machines x 2", shown(recipe)), recipe,
            study="lm", **small,
        )  # fmt: skip
        tuned = ten | rate
        out["lm_small tuned"] = seeds(
            runner, label(f"lm_small {name(4, 10)}", shown(tuned)), tuned, **study, **small
        )
        # Muon on lm_small at lm_tiny's Muon rates (not swept here), Adam's part at
        # lm_small's Adam rate; seed 0: does the best baseline or recipe change there?
        if muon_setting is not None and muon_ar is not None:
            adam_part = {"muon_adam_lr": rate["learning_rate"]}
            small_muon_ar = ALLREDUCE | muon | muon_ar | adam_part
            out["lm_small muon allreduce"] = seeds(
                runner, label("lm_small all-reduce fp32 Muon", muon_ar | adam_part),
                small_muon_ar, **study, base=headline_config, count=1,
            )  # fmt: skip
            small_muon = muon_setting | adam_part
            out["lm_small muon diloco"] = seeds(
                runner, label(f"lm_small {name(4, 10, ', Muon inner')}", shown(small_muon)),
                small_muon, **study, base=headline_config, count=1,
            )  # fmt: skip
    return out


def scale(runner: Runner, docs: str) -> str:
    """The study's section: its runs (`plan`), rendered by bench/experiments/scale_tables.py."""
    return scale_tables.section(plan(runner), lm_config(runner.quick), docs)
