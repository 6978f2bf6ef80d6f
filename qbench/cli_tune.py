"""The operating-point commands, `qbench sensitivity` and `qbench tune`: thin, like the rest of the command line."""

from __future__ import annotations

from pathlib import Path

import click

search_options = [
    click.option("--schemes", default="w4g128,w4g64,w8", show_default=True,
                 help="Comma-separated schemes: w8, w4g32, w4g64, w4g128 (-asym for asymmetric INT4), fp."),
    click.option("--unit", default="block", show_default=True, type=click.Choice(["block", "linear"]),
                 help="Quantize a whole block, or one linear, at a time."),
    click.option("--samples", default=4, show_default=True, type=int,
                 help="Seeded WikiText-2 valid windows (one batch); the second half of each is scored."),
    click.option("--seq-len", default=512, show_default=True, type=int),
    click.option("--seed", default=0, show_default=True, type=int),
]


def _with(options):
    def wrap(f):
        for o in reversed(options):
            f = o(f)
        return f
    return wrap


@click.command()
@click.argument("model")
@_with(search_options)
@click.option("--out", "out_path", required=True, type=click.Path(),
              help="The JSON file to write; its plot goes beside it (.png).")
def sensitivity(model, schemes, unit, samples, seq_len, seed, out_path):
    """KLD caused by quantizing each block (or linear) of MODEL alone, per scheme, with its SE."""
    from qbench.tune.measured import run_sensitivity
    from qbench.tune.sensitivity import parse_schemes

    r = run_sensitivity(model, parse_schemes(schemes), unit, Path(out_path), samples, seq_len, seed,
                        log=lambda m: click.echo(m, err=True))
    click.echo(f"wrote {out_path} ({len(r['rows'])} {unit}s, {r['seconds']:.0f}s)")


@click.command()
@click.argument("model")
@click.option("--max-kld", type=float, help="Budget: mean KL divergence against the fp model.")
@click.option("--max-ppl-ratio", type=float, help="Budget: perplexity ratio against the fp model.")
@_with(search_options)
@click.option("--sensitivity", "sens", type=click.Path(), help="A file `qbench sensitivity` wrote with the same "
              "unit, windows and schemes (else they are measured first).")
@click.option("--verify-chunks", default=16, show_default=True, type=int,
              help="WikiText-2 test windows for the held-out check.")
@click.option("--rounds", default=5, show_default=True, type=int, help="At most this many verified candidates.")
@click.option("--margin-se", "margin", default=2.0, show_default=True, type=float,
              help="A candidate is within the budget when its loss on the search windows plus this many SE is.")
@click.option("--out", "out_path", required=True, type=click.Path(),
              help="The recipe to write (.yaml); its report (.tune.json) and chart (.pareto.png) go beside it.")
def tune(model, max_kld, max_ppl_ratio, schemes, unit, samples, seq_len, seed, sens, verify_chunks, rounds,
         margin, out_path):
    """Choose the per-unit mix of schemes with the fewest bytes within a KLD or PPL budget; write its recipe."""
    from qbench.tune.sensitivity import parse_schemes
    from qbench.tune.tune import Budget, run_tune

    budget = Budget.of(max_kld, max_ppl_ratio)
    r = run_tune(model, budget, parse_schemes(schemes), unit, Path(out_path), None if sens is None else Path(sens),
                 samples, seq_len, seed, verify_chunks, rounds, log=lambda m: click.echo(m, err=True), margin=margin)
    t, b, f = r["tuned"], r["budget"], r["frontier"]
    click.echo(f"wrote {out_path}: {t['bytes'] / 2**20:.1f} MiB, held-out KLD {t['kld']['mean']:.4f} +- "
               f"{t['kld']['se']:.4f}, PPL ratio {t['ppl_ratio']:.4f}; budget {b['budget']} "
               f"{'held' if b['held'] else 'NOT held'} on WikiText-2 test; "
               + _frontier_line(f))


def _frontier_line(f: dict) -> str:
    """The tuned mix against the uniform recipes, in words."""
    parts = []
    if f["best_within_bytes"]:
        v = f["vs"][f["best_within_bytes"]]
        parts.append(f"KLD {v['kld_minus_tuned']:+.4f} +- {v['se']:.4f} below {f['best_within_bytes']}, the best "
                     f"uniform recipe within its bytes")
    parts += [f"fewer bytes than {n} ({f['vs'][n]['bytes_ratio']:.3f}x) at a KLD {f['vs'][n]['kld_minus_tuned']:+.4f} "
              f"+- {f['vs'][n]['se']:.4f} lower" for n in f["fewer_bytes_than"]]
    m = f.get("mix_line")
    if m:
        parts.append(f"KLD {m['kld_minus_tuned']:+.4f} +- {m['se']:.4f} below the proportional mix {m['of']}")
    return f"{'below' if f['below'] else 'not below'} the uniform frontier: " + ("; ".join(parts) or "no uniform "
                                                                                 "recipe within its bytes")
