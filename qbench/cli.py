"""The qbench command line: a thin layer over the library."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import click

from qbench.errors import QBenchError


# quantize, export and compare: what --force may replace is decided by qbench.paths.check_output
force_option = click.option("--force", is_flag=True, help="Replace an existing output of the same kind even if its "
                            "files were changed since qbench wrote it (never a folder qbench did not write).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
@click.pass_context
def cli(ctx, debug):
    """qbench: quantize, run, evaluate and compare causal LMs on the CPU."""
    ctx.obj = {"debug": debug}


@cli.command()
@click.argument("name")
def pull(name):
    """Fetch a zoo model (e.g. smollm2-135m-instruct) and convert it once, offline-ready."""
    from qbench.models.zoo import pull as do_pull

    folder = do_pull(name, log=lambda m: click.echo(m, err=True))
    click.echo(str(folder))


def _read_prompts(prompt: str | None, prompts_file: str | None) -> list[dict]:
    if (prompt is None) == (prompts_file is None):
        raise QBenchError("give exactly one of PROMPT or --prompts FILE.jsonl")
    if prompt is not None:
        return [{"prompt": prompt}]
    path = Path(prompts_file)
    if not path.is_file():
        raise QBenchError(f"{path}: no such prompts file; give a JSONL file with one {{\"prompt\": ...}} per line")
    rows = []
    from qbench.inputs import read_text
    for n, line in enumerate(read_text(path, "prompts file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise QBenchError(f"{path}:{n}: not valid JSON ({e.msg}); each line must be {{\"prompt\": \"...\"}}") \
                from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise QBenchError(f"{path}:{n}: missing string field \"prompt\"")
        rows.append(row)
    if not rows:
        raise QBenchError(f"{path}: no prompts in the file")
    return rows


@cli.command()
@click.argument("model")
@click.argument("prompt", required=False)
@click.option("--prompts", "prompts_file", help="JSONL file, one {\"prompt\": ...} per line.")
@click.option("--chat", is_flag=True, help="Wrap each prompt in the tokenizer's chat template.")
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, type=int, help="0 is off.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="1 is off.")
@click.option("--seed", default=0, show_default=True, type=int, help="Prompt i samples with seed + i.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--backend", default="qbench", show_default=True, type=click.Choice(["qbench", "hf", "nocache"]))
@click.option("--dtype", default="fp32", show_default=True)
@click.option("--batch-size", default=16, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of text.")
@click.option("--kv", "kv", help="Quantize the KV cache with this recipe's kv section (e.g. kv8, kv4, k4v2).")
@click.option("--tp", "tp", type=click.Choice(["backend", "ring"]),
              help="Tensor parallel over the processes torchrun starts, all-reducing with gloo's own "
                   "all-reduce (backend) or qbench's ring; rank 0 prints.")
@click.option("-n", "n", default=1, show_default=True, type=int,
              help="Samples per prompt, sharing the prompt's KV blocks (sample i uses seed + i).")
def generate(model, prompt, prompts_file, chat, max_new_tokens, temperature, top_k, top_p, seed, stop, backend,
             dtype, batch_size, as_json, kv, tp, n):
    """Generate text from MODEL (a zoo name, a local folder or a hub id)."""
    from qbench.engine.api import Generator
    from qbench.engine.sampling import SamplingParams

    rows = _read_prompts(prompt, prompts_file)
    if batch_size < 1:
        raise QBenchError(f"--batch-size {batch_size}: must be a positive integer")
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                             stop=tuple(stop), seed=seed + i) for i in range(len(rows))]
    from qbench.quant.recipe import load_kv_scheme
    gen = Generator(model, backend=backend, dtype=dtype, max_batch=batch_size,
                    kv_scheme=None if kv is None else load_kv_scheme(kv), tp=tp)
    if n != 1:
        if len(rows) != 1 or backend != "qbench":
            raise QBenchError("-n samples one prompt on qbench's engine; give one prompt and drop --backend")
        results, saved = gen.sample_n(rows[0]["prompt"], params[0], n, chat=chat)
        rows = rows * n
        click.echo(saved, err=True)
    else:
        results = gen.generate([r["prompt"] for r in rows], params, chat=chat)
    if gen.tp_rank:
        return
    for row, c in zip(rows, results):
        if as_json:
            click.echo(json.dumps({"id": row.get("id"), "prompt": c.prompt, "text": c.text, "tokens": c.token_ids,
                                   "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids),
                                   "finish_reason": c.finish_reason}))
        else:
            click.echo(c.text)


@cli.command()
@click.argument("model")
@click.option("--batch-sizes", default="1,4,8,16", show_default=True)
@click.option("--prompt-len", default=64, show_default=True, type=int)
@click.option("--gen-len", default=64, show_default=True, type=int)
@click.option("--backends", default="qbench,hf,hf-generate,llama.cpp,nocache", show_default=True,
              help="Comma list; llama.cpp is skipped when llama-cpp-python is not installed.")
@click.option("--nocache-batch-sizes", default="1,4", show_default=True,
              help="The no-cache baseline is slow; run it only at these batch sizes.")
@click.option("--dtype", default="fp32", show_default=True)
@click.option("--variant", "variants", multiple=True,
              help="A quantized artifact to run on qbench's engine beside the fp model (repeatable).")
@click.option("--kv", "kvs", multiple=True,
              help="Also run MODEL with a quantized KV cache from this recipe (e.g. kv8, kv4; repeatable).")
@click.option("--qlinear", default="native", show_default=True,
              help="Low-bit kernels for the variants, comma list of native, aten, aten-bf16, reference.")
@click.option("--rounds", default=1, show_default=True, type=int,
              help="Run every case this many times, round-robin, each in a fresh process; report each case's "
                   "median round with the range, and each ratio as the median of the rounds' ratios. On a noisy "
                   "host 3 or more show how far one run could mislead.")
@click.option("--out", "out_path", type=click.Path(), help="Write the JSON report here.")
@click.option("--workload", type=click.Choice(["gsm8k", "agent", "mixed"]),
              help="Replay a request stream instead: gsm8k (prefix cache off/on), agent (20 steps, growing "
                   "history), mixed (static vs continuous batching, block sizes 8/16/32).")
@click.option("--suite", default="evals/full.yaml", show_default=True, help="--workload gsm8k: the suite to replay.")
@click.option("--limit", default=8, show_default=True, type=int, help="--workload gsm8k: items to replay.")
@click.option("--tp", "tp", type=click.Choice(["backend", "ring"]),
              help="Under torchrun: the tensor-parallel engine per rank and the ring all-reduce against gloo's.")
def bench(model, batch_sizes, prompt_len, gen_len, backends, nocache_batch_sizes, dtype, variants, kvs, qlinear,
          rounds, out_path, workload, suite, limit, tp):
    """Measure prefill/decode speed and memory of qbench against its peers, in one run."""
    from qbench.bench.runner import BenchConfig, run_bench
    from qbench.bench.table import render_table
    from qbench.paths import check_output_file

    if out_path:
        check_output_file(Path(out_path), "qbench bench")  # before the long measurement

    if rounds != 1 and (tp or workload):
        raise QBenchError("bench: --rounds repeats the table's cases; --tp and --workload runs take one round")
    if tp:
        from qbench.bench.scaleout import render_tp, run_tp_bench
        from qbench.dist.comm import Dist
        report = run_tp_bench(model, tp, prompt_len, gen_len)
        if report is not None:  # rank 0
            _emit(render_tp(report), report, out_path)
        Dist.leave()

    if workload:
        from qbench.bench.workloads import render_workload, run_workload
        if len(kvs) > 1:
            raise QBenchError("bench --workload runs one KV scheme; give --kv once")
        gen = click.get_current_context().get_parameter_source("gen_len").name == "COMMANDLINE"
        report = run_workload(workload, model, kv=kvs[0] if kvs else None, suite=suite, limit=limit,
                              gen_len=gen_len if gen else None)
        _emit(render_workload(report), report, out_path)
        return

    cfg = BenchConfig.parse(model=model, batch_sizes=batch_sizes, prompt_len=prompt_len, gen_len=gen_len,
                            backends=backends, nocache_batch_sizes=nocache_batch_sizes, dtype=dtype,
                            variants=variants, qlinear=qlinear, kv=kvs, rounds=rounds)
    report = run_bench(cfg, log=lambda m: click.echo(m, err=True))
    _emit(render_table(report), report, out_path)


def _emit(text: str, report: dict, out_path: str | None) -> None:
    """A bench's summary on stdout, and its JSON report at ``out_path`` (written atomically) when given."""
    click.echo(text)
    if out_path:
        from qbench.paths import STAMP, atomic_write_text, check_output_file
        check_output_file(Path(out_path), "qbench bench")
        atomic_write_text(Path(out_path), json.dumps({STAMP: "qbench bench", **report}, indent=2) + "\n")
        click.echo(f"wrote {out_path}", err=True)


@cli.command()
@click.argument("model")
@click.option("--recipe", required=True, help="A recipe name from recipes/ (e.g. w4g128) or a YAML file.")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="The artifact folder to write.")
@click.option("--calibration-samples", type=int, help="Override the recipe's number of calibration windows (AWQ, GPTQ).")
@click.option("--reuse", is_flag=True, help="Keep an artifact already in --out that the same qbench code made from "
              "the same model and recipe (a commit that changed only docs or tests counts as the same), instead of "
              "quantizing again.")
@force_option
def quantize(model, recipe, out_dir, calibration_samples, reuse, force):
    """Quantize MODEL with a recipe into a self-describing artifact folder."""
    from qbench.quant.quantize import run_quantize

    m = run_quantize(model, recipe, Path(out_dir), log=lambda s: click.echo(s, err=True),
                     calibration_samples=calibration_samples, force=force, reuse=reuse)
    size = m["size"]
    click.echo(f"wrote {out_dir}: {size['artifact_tensor_bytes'] / 2**20:.1f} MiB of tensors, "
               f"{size['bits_per_weight_all']:.3f} bits per weight over all tensors "
               f"({size['bits_per_weight']:.3f} over the quantized ones)")


@cli.command()
@click.argument("artifact")
@click.option("--format", "fmt", default="compressed-tensors", show_default=True,
              type=click.Choice(["compressed-tensors", "native"]))
@click.option("--out", "out_dir", required=True, type=click.Path(), help="The folder to write.")
@force_option
def export(artifact, fmt, out_dir, force):
    """Write ARTIFACT as safetensors that transformers and vLLM load (compressed-tensors), or as qbench's own."""
    from qbench.quant.export import run_export

    click.echo(str(run_export(Path(artifact), fmt, Path(out_dir), force)))


@cli.command(name="eval")
@click.argument("model")
@click.option("--suite", "suite", required=True, help="An eval suite YAML, e.g. evals/quick.yaml.")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="The run folder, e.g. artifacts/runs/w8.")
@click.option("--baseline", type=click.Path(), help="A finished run of the fp baseline under the same suite.")
@click.option("--batch-size", type=int, help="Override the suite's batch size.")
@click.option("--kv", help="Run MODEL with this recipe's quantized KV cache (e.g. kv4).")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Reuse shared prompt prefixes (few-shot exemplars, haystacks); results are identical either way.")
@click.option("--distributed", is_flag=True,
              help="Data parallel over the processes torchrun starts (automatic under torchrun).")
def eval_cmd(model, suite, out_dir, baseline, batch_size, kv, prefix_cache, distributed):
    """Score MODEL (an fp model or an artifact) on a suite, against a baseline run when given."""
    import os
    rank = int(os.environ.get("RANK", "0"))  # set by torchrun
    if rank > 0:
        os.environ["TQDM_DISABLE"] = "1"  # one progress display: rank 0's
    from qbench.evals.run import run_eval

    record = run_eval(model, suite, Path(out_dir), None if baseline is None else Path(baseline), batch_size, kv,
                      log=lambda m: click.echo(m, err=True), prefix_cache=prefix_cache, distributed=distributed)
    if rank > 0:
        return
    from qbench.evals.summary import render_summary
    click.echo(render_summary(record))
    click.echo(f"wrote {Path(out_dir) / 'results.json'}", err=True)


@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option("--out", "out_dir", required=True, type=click.Path(), help="The report folder, e.g. artifacts/demo.")
@click.option("--baseline", type=click.Path(), help="The fp run (default: the one run made without a baseline).")
@force_option
def compare(runs, out_dir, baseline, force):
    """Side-by-side report of eval RUNS: report.md, report.html (self-contained) and summary.json."""
    from qbench.report.compare import run_compare

    out = run_compare([Path(r) for r in runs], Path(out_dir), None if baseline is None else Path(baseline), force)
    click.echo(f"wrote {out / 'report.md'}, {out / 'report.html'} and {out / 'summary.json'}")


from qbench.cli_tune import sensitivity, tune  # noqa: E402  (the operating-point commands)

cli.add_command(sensitivity)
cli.add_command(tune)


def main(argv=None):
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, standalone_mode=False, prog_name="qbench")
    except QBenchError as e:
        if debug:
            traceback.print_exc()
        click.echo(f"qbench: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.UsageError as e:  # a bad option or argument: one line too, with where to look
        cmd = f" {e.ctx.info_name}" if e.ctx is not None and e.ctx.parent is not None else ""
        click.echo(f"qbench: error: {e.format_message()} (see `qbench{cmd} --help`)", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("qbench: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("qbench: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # a bug: one line unless --debug
        if debug:
            raise
        click.echo(f"qbench: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                   f"(rerun with --debug for the traceback)", err=True)
        sys.exit(1)
